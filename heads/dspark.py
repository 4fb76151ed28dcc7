"""DSpark heads: the block backbone whose block is corrected left to right by a cheap sequential
head, with a confidence head that predicts each draft's survival (docs/dspark.md).

    head = DSparkHead.for_target(target, block_size=7, mask_token_id=mid, vocab_map=vmap, markov_rank=256)
    h = head.hidden(block_ids, ctx, positions=pos, attention_mask=mask)   # [N, B, H], one backbone pass
    logits, state = head.corrected(head.lm_head(h[:, k]), prev_ids, h[:, k], state)  # slot k, after x_{k-1}
    save_dspark(head, "out/dspark")                    # draftsmith.heads.dflash_formats
    head = load_dspark("out/dspark", target=target)

What it adds to `BlockHead` (DSpark, arXiv 2607.05147; the speculators `dspark` model type):
- slots: `sample_from_anchor`: the block [anchor, mask, ..., mask] at positions p..p+B-1 drafts
  B tokens, slot k the token at p + k + 1 (the backbone's slot 0 drafts nothing);
- the Markov bias (`markov_head`, rank r): logits_k = U_k + bias_k, U_k = lm_head(h_k) the
  backbone's, bias_k from the token before slot k's target (the anchor for slot 0, then the
  previous draft), e_k = W1[x_{k-1}] ([V, r], indexed by target ids; `markov_embedding: target`
  makes it W1 = E P, the target's frozen embeddings E [V, H] through a trained P [H -> r], H x r
  parameters in place of V x r, exported as the product):
    vanilla  bias_k = W2 e_k
    gated    bias_k = W2 (sigmoid(G [h_k; e_k]) * e_k)
    rnn      s_k = g * s_{k-1} + (1 - g) * tanh(c), bias_k = W2 tanh(o), [g; c; o] = J [s_{k-1}; e_k; h_k]
  (W2: [r -> draft vocabulary]); drafting samples slot k from softmax(logits_k) after x_{k-1}, so
  q_k is the corrected distribution and speculative sampling stays exact;
- the confidence head: c_k = sigmoid(w . [h_k; e_k]) (or [h_k]), trained to 1 - TV(q_k, p_k),
  the expected acceptance of slot k; prod_{j<=k} c_j estimates a chain's survival to k.
Weights as speculators names them: `markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`,
`markov_head.gate_proj.*` or `markov_head.joint_proj.*`, `confidence_head.proj.*`.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.blocks import BlockConfig, BlockError, BlockHead
from draftsmith.heads.layers import describe_mask_head

MARKOV_HEADS = ("vanilla", "gated", "rnn")
MARKOV_EMBEDDINGS = ("table", "target")  # W1: a free [V, r] table (the paper's), or E P (module docstring)


class DSparkError(BlockError):
    """A DSpark head that cannot be built, loaded or used; the message says why."""


class DSparkConfig(BlockConfig):
    model_type = "draftsmith_dspark"

    def __init__(
        self,
        markov_rank: int = 256,  # r of the bias W2 W1[x]: 0 = no sequential head (the block backbone drafting B)
        markov_head_type: str = "vanilla",  # vanilla | gated | rnn (module docstring)
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,  # the confidence head reads [h_k; W1[x_{k-1}]], else h_k
        markov_embedding: str = "table",  # W1: table (a free [V, r]) | target (E P, module docstring)
        **kwargs,
    ):
        if not isinstance(markov_rank, int) or markov_rank < 0:
            raise DSparkError(f"DSparkConfig: markov_rank={markov_rank!r}; expected an integer >= 0 (0 = none)")
        if markov_head_type not in MARKOV_HEADS:
            raise DSparkError(f"DSparkConfig: markov_head_type={markov_head_type!r}; expected one of {MARKOV_HEADS}")
        if markov_embedding not in MARKOV_EMBEDDINGS:
            raise DSparkError(
                f"DSparkConfig: markov_embedding={markov_embedding!r}; expected one of {MARKOV_EMBEDDINGS}"
            )
        if enable_confidence_head and confidence_head_with_markov and markov_rank == 0:
            raise DSparkError("DSparkConfig: confidence_head_with_markov needs markov_rank > 0")
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = bool(enable_confidence_head)
        self.confidence_head_with_markov = bool(confidence_head_with_markov)
        self.markov_embedding = markov_embedding
        super().__init__(**kwargs)

    sample_from_anchor = True  # slot k drafts the token at p + k + 1: block_size drafts per forward

    @property
    def drafts_per_block(self) -> int:
        return self.block_size


class MarkovHead(nn.Module):
    """The sequential bias over the draft vocabulary from the previous token (and, gated or rnn,
    the slot's state); `step` is one slot, the form drafting needs, `block` a whole teacher-forced block."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        r, H = config.markov_rank, config.hidden_size
        self.kind = config.markov_head_type
        if config.markov_embedding == "table":
            self.markov_w1 = nn.Embedding(config.vocab_size, r)  # indexed by target ids
        else:
            self.markov_w1_proj = nn.Linear(H, r, bias=False)  # P of W1 = E P, over the target's embeddings
        self.markov_w2 = nn.Linear(r, config.draft_vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)  # [gate; candidate; output] of [state; e; h]

    def step(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """(bias [..., Vd], the next state) of slots with previous-token embeddings e [..., r] and
        backbone states h [..., H]; `state` [..., r] (rnn; None: zeros)."""
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h.to(e.dtype), e], -1))) * e), state
        state = torch.zeros_like(e) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, e, h.to(e.dtype)], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state

    def block(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Bias [N, B, Vd] of whole blocks: e [N, B, r], h [N, B, H] (teacher forcing)."""
        if self.kind != "rnn":
            return self.step(e, h, None)[0]
        out, state = [], None
        for k in range(e.shape[1]):
            bias, state = self.step(e[:, k], h[:, k], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)  # logits: sigmoid is the predicted acceptance


class DSparkHead(BlockHead):
    """A DSpark block drafter for one target (module docstring)."""

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    error = DSparkError
    title = "DSpark head"

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        H, r = config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(config) if r else None
        width = H + (r if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.enable_confidence_head else None
        if self.markov_head is not None:
            if config.markov_embedding == "table":
                nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
            nn.init.zeros_(self.markov_head.markov_w2.weight)  # starts as the backbone: bias 0
        self._freeze()

    def previous(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """W1[x] [..., r] of target ids (None without a sequential head)."""
        if self.markov_head is None:
            return None
        if self.config.markov_embedding == "table":
            return self.markov_head.markov_w1(prev_ids)
        return self.markov_head.markov_w1_proj(
            self.embed_tokens(prev_ids).to(self.markov_head.markov_w1_proj.weight.dtype)
        )

    def markov_table(self) -> torch.Tensor:
        """W1 [V, r] as a table, whichever way the head holds it (E P in float32 when it is a product;
        the speculators layout stores the table)."""
        if self.config.markov_embedding == "table":
            return self.markov_head.markov_w1.weight
        return self.embed_tokens.weight.float() @ self.markov_head.markov_w1_proj.weight.float().t()

    def corrected(self, base: torch.Tensor, prev_ids: torch.Tensor, h: torch.Tensor, state=None):
        """(logits_k = U_k + bias_k [..., Vd], the next rnn state) of slots whose backbone logits
        are `base` and state `h`, after the tokens `prev_ids` (target ids)."""
        e = self.previous(prev_ids)
        if e is None:
            return base, state
        bias, state = self.markov_head.step(e.to(h.dtype), h, state)
        return base + bias.to(base.dtype), state

    def confidence(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits [...] of slots with states h after `prev_ids` (None without the head)."""
        if self.confidence_head is None:
            return None
        features = h
        if self.config.confidence_head_with_markov:
            features = torch.cat([h, self.previous(prev_ids).to(h.dtype)], dim=-1)
        return self.confidence_head(features)

    def block_logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Corrected logits [N, B, Vd] of teacher-forced blocks: states h [N, B, H], prev_ids [N, B]
        the token before each slot's target (the anchor, then the block's own tokens)."""
        base = self.lm_head(h)
        e = self.previous(prev_ids)
        if e is None:
            return base
        return base + self.markov_head.block(e.to(h.dtype), h).to(base.dtype)

    def describe(self) -> str:
        c = self.config
        seq = f"{c.markov_head_type} Markov bias (rank {c.markov_rank})" if c.markov_rank else "no sequential head"
        conf = "a confidence head" if c.enable_confidence_head else "no confidence head"
        title = f"DSpark head: {c.num_hidden_layers} layer(s), block {c.block_size} ({c.block_size} drafts per forward)"
        return describe_mask_head(self, f"{title}, {seq}, {conf}")
