"""Domino heads: the block backbone whose drafts are corrected left to right by a GRU over the
target's embeddings of the tokens drafted before them (docs/domino.md).

    head = DominoHead.for_target(target, block_size=8, mask_token_id=mid, gru_hidden=1024, proj_dim=256)
    h = head.hidden(block_ids, ctx, positions=pos, attention_mask=mask)     # [N, B, H], one backbone pass
    logits, state = head.corrected(head.lm_head(h[:, k]), prev_ids, h[:, k], state)  # slot k >= 1, after x_{k-1}
    base, final = head.block_logits(h, block_tokens)                         # slots 1..B-1, teacher-forced (training)
    save_domino(head, "out/domino")                                          # draftsmith.heads.domino_formats
    head = load_domino("out/domino", target=target)

What it adds to `BlockHead` (Domino, arXiv 2605.29707; SpecForge's `DominoDraftModel`):
- slots as the backbone's (`sample_from_anchor: false`): the block [anchor, mask, ..., mask] at positions
  p..p+B-1, slot k >= 1 drafts the token at p + k; slot 0 (the anchor) drafts nothing;
- the GRU: a 1-layer bias-free GRU (`prefix_gru`, hidden `gru_hidden`) over E[x], E the target's
  (frozen) input embeddings, run over the tokens before each slot's target:
      s_1 = GRU(E[anchor], 0),  s_k = GRU(E[x_{k-1}], s_{k-1})          k = 2..B-1
  (x_{k-1} the previous draft while drafting, the data's token at p + k - 1 in training);
- the correction: logits_k = U_k + W2 SiLU(W1 [h_k; s_k]) for k >= 1, U_k = lm_head(h_k) the
  backbone's logits, W1 [H + gru_hidden -> proj_dim], W2 [proj_dim -> draft vocabulary], both
  bias-free (`embed_proj.0`, `embed_proj.2`); slot 0 is left as U_0.
Drafting samples slot k from softmax(logits_k) after x_{k-1}, so q_k is the corrected law the draft
is really drawn from and speculative sampling stays exact (decoding/domino.py).
Weights as SpecForge names them: `prefix_gru.weight_ih_l0` [3 gru_hidden, H] (gates r, z, n),
`prefix_gru.weight_hh_l0` [3 gru_hidden, gru_hidden], `embed_proj.0.weight`, `embed_proj.2.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.blocks import BlockConfig, BlockError, BlockHead
from draftsmith.heads.layers import describe_mask_head


class DominoError(BlockError):
    """A Domino head that cannot be built, loaded or used; the message says why."""


class DominoConfig(BlockConfig):
    model_type = "draftsmith_domino"

    def __init__(
        self,
        gru_hidden: int = 1024,  # the GRU's state width (SpecForge's gru_hidden_dim; the paper's 1024)
        proj_dim: int = 256,  # the correction MLP's bottleneck (SpecForge's emb_dim)
        **kwargs,
    ):
        for name, value in (("gru_hidden", gru_hidden), ("proj_dim", proj_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DominoError(f"DominoConfig: {name}={value!r}; expected an integer >= 1")
        self.gru_hidden = gru_hidden
        self.proj_dim = proj_dim
        super().__init__(**kwargs)

    # sample_from_anchor stays the backbone's False: slot 0 is the anchor, block_size - 1 drafts per block


class DominoHead(BlockHead):
    """A Domino block drafter for one target (module docstring)."""

    config_class = DominoConfig
    base_model_prefix = "domino"
    error = DominoError
    title = "Domino head"

    def __init__(self, config: DominoConfig):
        super().__init__(config)
        H, G, P = config.hidden_size, config.gru_hidden, config.proj_dim
        self.prefix_gru = nn.GRU(H, G, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(H + G, P, bias=False), nn.SiLU(), nn.Linear(P, config.draft_vocab_size, bias=False)
        )
        nn.init.zeros_(self.embed_proj[2].weight)  # a new head drafts as its backbone: correction 0
        self._freeze()

    def gru_inputs(self, token_ids: torch.Tensor) -> torch.Tensor:
        """E[x] [..., H] of target ids, in the GRU's dtype (fp32 master weights under autocast)."""
        return self.embed_tokens(token_ids).to(self.prefix_gru.weight_ih_l0.dtype)

    def correction(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """W2 SiLU(W1 [h; s]) [..., Vd] of backbone states h [..., H] and GRU states s [..., G]."""
        dtype = self.embed_proj[0].weight.dtype
        return self.embed_proj(torch.cat([h.to(dtype), s.to(dtype)], dim=-1))

    def step(self, prev_ids: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """The GRU state [N, G] after the tokens `prev_ids` [N] (target ids), from `state` [N, G]
        (None: zeros, before the anchor)."""
        h0 = None if state is None else state[None]  # nn.GRU's [num_layers, N, G]
        out, _ = self.prefix_gru(self.gru_inputs(prev_ids)[:, None], h0)  # [N, 1, G]
        return out[:, 0]

    def corrected(self, base: torch.Tensor, prev_ids: torch.Tensor, h: torch.Tensor, state=None):
        """(logits_k = U_k + correction [N, Vd], s_k [N, G]) of drafting slots k >= 1 whose backbone
        logits are `base` [N, Vd] and states `h` [N, H], after the tokens `prev_ids` [N] (the anchor
        for slot 1, then the previous draft) from the GRU state `state` (s_{k-1}; None for slot 1)."""
        s = self.step(prev_ids, state)
        return base + self.correction(h, s).to(base.dtype), s

    def block_logits(self, h: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(base U [N, B-1, Vd], final [N, B-1, Vd]) of the drafting slots 1..B-1 of teacher-forced
        blocks: h [N, B, H] the backbone's final-norm states, tokens [N, B] the block's tokens at
        p..p+B-1 (target ids; the last feeds no slot). One GRU pass over tokens[:, :B-1] gives
        s_1..s_{B-1}. Slot 0, the anchor, drafts nothing and gets no logits."""
        h = h[:, 1:]
        base = self.lm_head(h)  # [N, B-1, Vd]
        states, _ = self.prefix_gru(self.gru_inputs(tokens[:, :-1]))  # [N, B-1, G]: s_k after tokens p..p+k-1
        return base, base + self.correction(h, states).to(base.dtype)

    def describe(self) -> str:
        c = self.config
        title = (
            f"Domino head: {c.num_hidden_layers} layer(s), block {c.block_size} ({c.block_size - 1} drafts per forward)"
        )
        return describe_mask_head(self, f"{title}, GRU {c.gru_hidden} -> {c.proj_dim} correction")
