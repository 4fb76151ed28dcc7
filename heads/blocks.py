"""Block heads: the backbone every anchored block drafter shares (one method's head is this
backbone as it is, the others add a correction on top). One forward proposes a whole block.

    head = layout.head.for_target(target, num_layers=1, block_size=8, mask_token_id=mid, vocab_map=vmap)
    ctx = head.project(torch.cat([hs[i] for i in head.config.aux_layer_ids], -1))  # [N, C, H]
    logits = head(block_ids, ctx, positions=pos, attention_mask=mask)             # [N, Q, draft_vocab]

What one forward computes (arXiv 2602.06036; the layouts on disk: `heads.block_formats`):
- a block of `block_size` slots at positions p, p+1, ..., p+B-1: slot 0 holds the anchor (the
  last committed token, at position p), slots 1..B-1 the mask token. Slot k's output predicts
  the token at position p + k, so one forward drafts B - 1 tokens (the anchor is the bonus
  token of the previous verification: speculators' `sample_from_anchor: false`; a head whose
  config says true drafts from slot 0 too, B tokens);
- the context: c_s = hidden_norm(fc(concat of the target's hidden states at `aux_layer_ids`)) for
  the positions s < p (HF `output_hidden_states` ids: 0 = embeddings, L = after the final norm);
- `num_hidden_layers` Qwen3-style decoder layers over the block's embeddings. In each layer the
  queries are the block's slots (after input_layernorm), the keys/values are
  [k/v_proj(c_s) for the context | k/v_proj(slots)], with per-head RMSNorm on q and k (Qwen3's
  q_norm / k_norm) and RoPE at the positions. Inside a block attention is bidirectional; the
  caller's mask says which context columns each block sees (all s < p). The context's keys do
  not depend on the block, so a decoder caches them per layer (a HF `DynamicCache`);
- output: lm_head(norm(h)) over the draft vocabulary (a reduced one maps back with d2t/t2d,
  `draftsmith.heads.vocab_map`).

Target copies: `embed_tokens` is the target's (frozen, never saved); with the full vocabulary
`lm_head` is the target's too (frozen, not saved), with a reduced vocabulary it starts from the
target's rows of the draft tokens, trains, and is saved with d2t/t2d. So a head loads with its
target (`BlockLayout.load(path, target=...)`).

The mask token: an id of the target's vocabulary whose (frozen) embedding marks "to be
predicted". `mask_token_id` picks the recipe's id, else the tokenizer's mask token, else a
reserved id nothing uses (`choose_mask_token`); the config records the id and where it came from.

A method's head subclasses `BlockConfig` (its `model_type`) and `BlockHead` (its `config_class`,
`error` and `title`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import Cache, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.heads import layers


class BlockError(ValueError):
    """A block head that cannot be built, loaded or used with a target; the message says why."""


def default_aux_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers evenly spaced from 1 to L-3 (the released drafters of arXiv 2602.06036
    read one per draft layer this way, e.g. L=36, 5 -> 1, 9, 17, 25, 33); tiny targets use 1..L-1."""
    L = num_target_layers
    if L < 2:
        return [0]
    lo, hi = 1, (L - 3 if L - 3 > 1 else L - 1)
    if count <= 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def choose_mask_token(vocab_size: int, *, explicit: int | None = None, tokenizer=None, used=None) -> tuple[int, str]:
    """`heads.layers.choose_mask_token`, raising BlockError."""
    return layers.choose_mask_token(vocab_size, explicit=explicit, tokenizer=tokenizer, used=used, error=BlockError)


class BlockConfig(PretrainedConfig):
    """The backbone's config; a method's subclass names its `model_type` (and adds its keys)."""

    def __init__(
        self,
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_hidden_layers: int = 1,  # draft decoder layers (the target's count is target_num_layers)
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,  # None = num_attention_heads
        head_dim: int | None = None,  # None = hidden_size // num_attention_heads
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict | None = None,  # the target's: positions rotate as in the target
        max_position_embeddings: int = 8192,  # MUST equal the target's (servers size RoPE from it)
        attention_bias: bool = False,
        hidden_act: str = "silu",
        vocab_size: int = 128256,  # the target's output vocabulary
        draft_vocab_size: int | None = None,  # reduced vocabulary (None = vocab_size)
        block_size: int = 8,  # slots per block: one forward drafts block_size - 1 tokens
        mask_token_id: int | None = None,  # required by a head; see choose_mask_token
        mask_token_source: str | None = None,  # recipe | tokenizer | reserved
        aux_layer_ids: list[int] | None = None,  # HF hidden_states ids of the target
        initializer_range: float = 0.02,
        **kwargs,  # the provenance (layers.PROVENANCE: target, data hashes), then PretrainedConfig's
    ):
        layers.record_target(self, kwargs)
        target_num_layers = self.target_num_layers
        kwargs.setdefault("tie_word_embeddings", False)
        draft_vocab_size = vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        if not isinstance(block_size, int) or block_size < 2:
            raise BlockError(
                f"{type(self).__name__}: block_size={block_size!r}; expected an integer >= 2 (slot 0 is the anchor)"
            )
        if mask_token_id is not None and not 0 <= int(mask_token_id) < vocab_size:
            raise BlockError(
                f"{type(self).__name__}: mask_token_id={mask_token_id} is outside the vocabulary 0..{vocab_size - 1}"
            )
        if mask_token_source is not None and mask_token_source not in layers.MASK_SOURCES:
            raise BlockError(
                f"{type(self).__name__}: mask_token_source={mask_token_source!r}; expected one of {layers.MASK_SOURCES}"
            )
        if not 1 <= draft_vocab_size <= vocab_size:
            raise BlockError(
                f"{type(self).__name__}: draft_vocab_size={draft_vocab_size}; expected 1..vocab_size ({vocab_size})"
            )
        if num_hidden_layers < 1:
            raise BlockError(
                f"{type(self).__name__}: num_hidden_layers={num_hidden_layers}; a head needs at least one layer"
            )
        aux_layer_ids = [int(i) for i in (aux_layer_ids or [])]
        if target_num_layers is not None and any(not 0 <= i <= target_num_layers for i in aux_layer_ids):
            raise BlockError(
                f"{type(self).__name__}: aux_layer_ids {aux_layer_ids} are outside the target's hidden states "
                f"0..{target_num_layers} (0 = embeddings, {target_num_layers} = last layer after the final norm)"
            )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.hidden_act = hidden_act
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.block_size = block_size
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.mask_token_source = mask_token_source
        self.aux_layer_ids = aux_layer_ids
        self.initializer_range = initializer_range
        super().__init__(**kwargs)

    sample_from_anchor = False  # slot 0 is the anchor (the previous bonus token); slot k drafts position p + k

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - 1

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def layer_config(self) -> LlamaConfig:
        """The draft layers as a llama config (RoPE and the MLP are built from it)."""
        return layers.llama_layer_config(self, self.num_hidden_layers)


# ---------------------------------------------------------------------- the decoder layer
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class BlockAttention(nn.Module):
    """Queries from the block, keys/values from [context | block] (module docstring)."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = layers.qkvo_projections(c, c.hidden_size, BlockError)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask, cache, layer_idx: int) -> torch.Tensor:
        N, Q, _ = x.shape
        fed = torch.cat([context, x], dim=1)  # [N, C + Q, H]
        q = self.q_norm(self.q_proj(x).view(N, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(fed).view(N, fed.shape[1], self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(fed).view(N, fed.shape[1], self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, C + Q, hd]
        q, k = _rotate(q, cos[:, :, -Q:], sin[:, :, -Q:]), _rotate(k, cos, sin)  # keys cached after RoPE
        return self.o_proj(layers.attend(q, k, v, mask, cache, layer_idx))


class BlockDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context (keys named as Qwen3's)."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        H = config.hidden_size
        self.self_attn = BlockAttention(config)
        self.mlp = LlamaMLP(config.layer_config())
        self.input_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask, cache, layer_idx: int) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------- the head
class BlockHead(layers.Fp32Rope, PreTrainedModel):
    """A block drafter for one target (module docstring); a method's head subclasses it."""

    config_class = BlockConfig
    base_model_prefix = "block"
    title = "block head"  # how messages name it
    error = BlockError  # what its loaders raise

    def __init__(self, config: BlockConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise BlockError(f"{type(config).__name__}.mask_token_id is not set: a {self.title} needs a mask token id")
        if not config.aux_layer_ids:
            raise BlockError(
                f"{type(config).__name__}.aux_layer_ids is empty: name the target hidden states the head reads"
            )
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(len(config.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([BlockDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.layer_config())  # non-persistent buffers
        if config.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64), persistent=True)
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool), persistent=True)
        self.post_init()
        self._freeze()

    def _freeze(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)  # the target's embeddings
        self.lm_head.weight.requires_grad_(self.config.reduced_vocab)  # full vocabulary: the target's head

    def frozen_keys(self) -> tuple[str, ...]:
        """The target's tensors: never saved, taken from the target on load."""
        return ("embed_tokens.weight",) + (() if self.config.reduced_vocab else ("lm_head.weight",))

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        *,
        num_layers: int = 1,
        block_size: int = 8,
        mask_token_id: int,
        mask_token_source: str | None = None,
        aux_layer_ids=None,
        vocab_map=None,
        target_name_or_path: str | None = None,
        data_hash: str | None = None,
        **variant,
    ) -> BlockHead:
        """A head shaped like the target's layers, on its device and dtype, with the target's
        embeddings and lm_head (rows of the draft vocabulary) copied in; `variant`: the config keys
        of a head built on this one (its `config_class`'s)."""
        tc = target.config.get_text_config()
        L = tc.num_hidden_layers
        lm_weight, embed_weight = layers.target_weights(target, BlockError)
        layers.check_target_weights(lm_weight, embed_weight, tc.hidden_size, BlockError)
        V = lm_weight.shape[0]
        aux = [int(i) for i in (aux_layer_ids if aux_layer_ids is not None else default_aux_layer_ids(L, num_layers))]
        bad = [i for i in aux if not 0 <= i <= L]
        if not aux or bad or len(set(aux)) != len(aux):
            raise BlockError(
                f"aux_layer_ids {aux}: expected distinct HF hidden_states ids of the target, 0..{L} "
                f"(0 = embeddings, {L} = last layer after the final norm)"
            )
        if vocab_map is not None:
            layers.check_vocab_map(vocab_map, V, BlockError)
        config = cls.config_class(
            **layers.target_shape(target, V, vocab_map, target_name_or_path, data_hash),
            num_hidden_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            mask_token_source=mask_token_source,
            aux_layer_ids=aux,
            **variant,
        )
        return layers.head_on_target(cls, config, embed_weight, lm_weight, vocab_map)

    # ------------------------------------------------------------------ computation
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Context features: hidden_norm(fc(aux states concatenated [..., n_aux*H])) -> [..., H]."""
        expected = len(self.config.aux_layer_ids) * self.config.hidden_size
        if aux_hidden.shape[-1] != expected:
            raise BlockError(
                f"project: the aux hidden states are {aux_hidden.shape[-1]} wide, "
                f"expected {len(self.config.aux_layer_ids)} "
                f"layers {self.config.aux_layer_ids} x hidden {self.config.hidden_size} = {expected}"
            )
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def forward(self, block_ids, context, *, positions, attention_mask, cache: Cache | None = None):
        """Draft logits [N, Q, draft_vocab] of the Q block slots `block_ids [N, Q]`: lm_head of
        `hidden` (its arguments)."""
        return self.lm_head(
            self.hidden(block_ids, context, positions=positions, attention_mask=attention_mask, cache=cache)
        )

    def hidden(self, block_ids, context, *, positions, attention_mask, cache: Cache | None = None):
        """The final-norm states [N, Q, H] of the Q block slots `block_ids [N, Q]` (blocks of
        `block_size`, possibly several packed per row), given C new context columns `context
        [N, C, H]` (`project`'s output, C may be 0). positions [N, C + Q]: the context's then the
        slots'. attention_mask: float additive [N or 1, 1, Q, S + C + Q] over the S columns
        already in `cache` (a growing `DynamicCache`; a `StaticCache`: the rest of its buffer),
        the context, then the slots (0 = attend, large negative = blocked)."""
        N, Q = block_ids.shape
        C = context.shape[1]  # S: the columns the cache returns besides these (a StaticCache: its whole buffer)
        S = 0 if cache is None else cache.get_mask_sizes(C + Q, 0)[0] - (C + Q)
        if context.dim() != 3 or context.shape[0] != N or context.shape[-1] != self.config.hidden_size:
            raise BlockError(f"forward: context {list(context.shape)} must be [{N}, C, {self.config.hidden_size}]")
        if tuple(positions.shape) != (N, C + Q):
            raise BlockError(f"forward: positions {list(positions.shape)} must be [{N}, {C + Q}] (context, then block)")
        if attention_mask.dim() != 4 or tuple(attention_mask.shape[1:]) != (1, Q, S + C + Q):
            raise BlockError(f"forward: attention_mask {list(attention_mask.shape)} must be [N, 1, {Q}, {S + C + Q}]")
        x = self.embed_tokens(block_ids)
        context = context.to(x.dtype)
        cos, sin = self.rotary_emb(x, positions)
        mask = attention_mask.to(dtype=x.dtype, device=x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, mask, cache, i)
        return self.norm(x)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (target = draft + d2t[draft]); the identity for a full vocabulary."""
        if not self.config.reduced_vocab:
            return draft_ids
        return layers.draft_to_target_ids(draft_ids, self.d2t)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] placed into the target vocabulary [..., V], -inf elsewhere."""
        if not self.config.reduced_vocab:
            return logits
        return layers.draft_to_target_logits(logits, self.d2t, self.config.vocab_size)

    def check_target(self, target: PreTrainedModel) -> None:
        """BlockError when the head cannot serve `target`; a warning when only the fingerprint differs."""
        from draftsmith.heads.models import target_fingerprint

        c, tc = self.config, target.config.get_text_config()
        name = getattr(target.config, "_name_or_path", None) or type(target).__name__
        vocab = layers.target_weights(target, BlockError)[0].shape[0]
        for what, ours, theirs in (
            ("hidden size", c.hidden_size, tc.hidden_size),
            ("vocab size", c.vocab_size, vocab),
            ("num_hidden_layers", c.target_num_layers, tc.num_hidden_layers),
            ("max_position_embeddings", c.max_position_embeddings, tc.max_position_embeddings),
            ("rope_parameters", c.rope_parameters, layers.rope_of(tc)),
        ):
            if ours is not None and ours != theirs:
                raise BlockError(
                    f"{self.title} has {what} {ours} (trained on {c.target_name_or_path or 'an unrecorded target'}) "
                    f"but target {name!r} has {theirs}"
                )
        if max(c.aux_layer_ids) > tc.num_hidden_layers:
            raise BlockError(
                f"{self.title} reads hidden states {c.aux_layer_ids}, target {name!r} has {tc.num_hidden_layers} layers"
            )
        if c.target_fingerprint and target_fingerprint(target) != c.target_fingerprint:
            warnings.warn(
                f"{self.title} was trained on target fingerprint {c.target_fingerprint[:12]} "
                f"but target {name!r} differs: "
                "fine for a fine-tuned target, otherwise expect low acceptance",
                stacklevel=2,
            )

    def describe(self) -> str:
        c = self.config
        blocks = f"block {c.block_size} ({c.block_size - 1} drafts per forward)"
        return layers.describe_mask_head(self, f"{self.title}: {c.num_hidden_layers} layer(s), {blocks}")
