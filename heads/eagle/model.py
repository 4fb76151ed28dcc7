"""EAGLE heads (EAGLE-1 and EAGLE-3): one decoder layer that drafts from the target's features.

    head = EagleHead.for_target(target, "eagle3", vocab_map=vmap)   # frozen embeddings, lm_head from the target
    h = head.project(torch.cat([hs[i] for i in head.config.aux_layer_ids], -1))   # eagle3: fc over the aux states
    cache = DynamicCache()                                                    # HF's; the decoder may hand a StaticCache
    out, logits = head(next_ids, h, position_ids=pos, cache=cache)            # draft step 1
    out, logits = head(head.draft_to_target(logits.argmax(-1)), out, position_ids=pos + 1, cache=cache)  # step 2
    save_eagle(head, "out/eagle")                     # draftsmith layout (save_pretrained)
    export_eagle(head, "out/eagle-vllm", "vllm")      # vLLM speculators format; or "sglang"
    head = load_eagle("out/eagle-vllm", target=target)   # any of the three layouts

Both versions read, at position t, the embedding of token t+1 and a feature of position t:

- EAGLE-1: x = fc(cat(embed(token_{t+1}), f_t)), Linear(2H, H, bias), then one Llama decoder layer
  WITHOUT input_layernorm (f_t is already normalised). f_t is the target's last hidden state after
  the final norm (HF `hidden_states[L]`), so the layer output is a predicted next feature f_{t+1}
  and the target's frozen lm_head turns it into logits for token t+2. `aux_layer_ids == [L]`.
- EAGLE-3: the feature is fc(cat of n_aux target hidden states) (`project`), Linear(n_aux*H, H,
  no bias). The layer's q/k/v read cat(input_layernorm(embed), hidden_norm(h)) (2H wide); the
  residual stream is h itself (vLLM/speculators `norm_before_residual: false`). Logits come from
  lm_head(norm(out)) over a reduced draft vocabulary; `out` (before the norm) is what the next
  draft step reads as `hidden`.
- EAGLE-3 variants (speculators' config flags, all off by default, each a real option here):
  `norm_before_fc` one RMSNorm over the concatenated aux states before fc (`input_norm`);
  `fc_norm` (EAGLE-3.1) one RMSNorm per aux state before the concat (`fc_norm.{i}`), exclusive
  with norm_before_fc; `norm_output` (EAGLE-3.1) the next step reads norm(out) instead of out
  (the logits are lm_head(norm(out)) either way); `norm_before_residual` residual =
  hidden_norm(h); `embed_requires_grad` the embeddings train; `target_hidden_size` the width of
  the target's states that fc reads (None = hidden_size: the draft is as wide as the target).
- `qk_norm` (a layer option, not a speculators top-level flag): a per-head RMSNorm on q and on k
  (`self_attn.q_norm`, `self_attn.k_norm`, [head_dim] each) after the projections and BEFORE RoPE,
  as Qwen3's attention. speculators has it exactly when its `transformer_layer_config` is a `qwen3`
  layer (`Qwen3DecoderLayer`; a `llama` one has none); its trainer's default layer is `llama` for
  eagle3 and `qwen3` for peagle, so draftsmith's EAGLE-3 recipe trains without and P-EAGLE's with.

Auxiliary layer ids are HF `output_hidden_states` indices: i = the INPUT of decoder layer i
(0 = the embedding output), L = the last layer's output after the final norm. Default for
EAGLE-3: the paper's (2, L//2, L-3) when those are three distinct ids in [1, L) (L >= 7);
for tinier targets the first, middle and last of range(1, L) (of range(0, L) when L < 4),
deduplicated: L=4 -> (1, 2, 3), L=5 -> (1, 3, 4), L=6 -> (1, 3, 5), L=3 -> (0, 1, 2).

Layouts (`load_eagle` tells them apart by config.json):
- draftsmith (`save_eagle`, `export_eagle(.., "hf")`): `save_pretrained`, model_type
  `draftsmith_eagle`, the provenance, state_dict keys as below.
- "vllm" (the speculators format, as the speculators trainer writes it; vLLM reads it through
  `SpeculatorsConfig` and builds `Eagle3LlamaForCausalLM`): keys `fc.weight`, `layers.0.*`,
  `norm.weight`, `lm_head.weight`, `embed_tokens.weight`, `d2t`, `t2d` (the last two only with a
  reduced vocabulary); `transformer_layer_config` is a llama layer, or a qwen3 one with `qk_norm`
  (its `layers.0.self_attn.q_norm`/`k_norm` beside). vLLM captures `hidden_states + residual`
  BEFORE layer i, i.e. HF index i: the ids are written as they are. Ids equal to L (post-norm)
  cannot be captured by a server.
- "sglang" (`LlamaForCausalLMEagle3`): a flat llama config, keys `midlayer.*` instead of
  `layers.0.*`. SGLang adds 1 to the ids it reads from `eagle_config` ("the ith layer takes the
  output of the (i-1)th layer"), so the ids are written minus one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.heads.layers import (
    Fp32Rope,
    attend,
    check_target_weights,
    check_vocab_map,
    draft_to_target_ids,
    draft_to_target_logits,
    head_on_target,
    llama_layer_config,
    qkvo_projections,
    record_target,
    rope_of,
    spread_layer_ids,
    target_shape,
    target_weights,
)

VERSIONS = ("eagle1", "eagle3")
# EagleConfig's switches of the EAGLE-3 layer as speculators' config spells them (module docstring);
# target_hidden_size is not one: a head built for a target is always as wide as the target.
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad")
# What `for_target` takes beside the aux layers and the vocabulary: the flags, and `qk_norm`, which the
# speculators layout spells as the layer's model_type (qwen3) rather than as a flag of its own.
HEAD_OPTIONS = (*VARIANT_FLAGS, "qk_norm")


class EagleError(ValueError):
    """A head that cannot be built, loaded, exported or used with a target; the message says why."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's (2, L//2, L-3), or first/middle/last of range(1, L) for tiny targets (module docstring)."""
    return spread_layer_ids(num_layers)


class EagleConfig(PretrainedConfig):
    model_type = "draftsmith_eagle"

    def __init__(
        self,
        version: str = "eagle3",
        hidden_size: int = 4096,
        intermediate_size: int = 14336,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,  # None = num_attention_heads (no GQA)
        head_dim: int | None = None,  # None = hidden_size // num_attention_heads
        rms_norm_eps: float = 1e-5,
        rope_parameters: dict | None = None,  # the target's, verbatim: positions must rotate as in the target
        max_position_embeddings: int = 8192,  # MUST equal the target's (servers size RoPE/caches from it)
        attention_bias: bool = False,
        hidden_act: str = "silu",
        vocab_size: int = 128256,  # the target's output vocabulary
        draft_vocab_size: int | None = None,  # eagle3: reduced vocabulary; None = vocab_size
        aux_layer_ids: list[int] | None = None,  # HF hidden_states indices; see default_aux_layer_ids
        norm_before_residual: bool = False,  # speculators variant: residual = hidden_norm(h); draftsmith trains False
        norm_before_fc: bool = False,  # eagle3: RMSNorm over the concatenated aux states before fc (`input_norm`)
        fc_norm: bool = False,  # eagle3 (EAGLE-3.1): an RMSNorm per aux state before the concat (`fc_norm.{i}`)
        norm_output: bool = False,  # eagle3 (EAGLE-3.1): feed norm(out) back, steadier magnitudes over depths
        embed_requires_grad: bool = False,  # the embeddings train too (default: the target's, frozen)
        target_hidden_size: int | None = None,  # eagle3: width of the target's aux states; None = hidden_size
        qk_norm: bool = False,  # eagle3: per-head RMSNorm on q and k before RoPE (speculators' qwen3 layer)
        initializer_range: float = 0.02,
        rope_theta: float | None = None,  # legacy spelling, folded into rope_parameters
        **kwargs,  # the provenance (layers.PROVENANCE: target, data hashes), then PretrainedConfig's
    ):
        record_target(self, kwargs)
        if version not in VERSIONS:
            raise EagleError(f"EagleConfig: version={version!r}; expected one of {', '.join(map(repr, VERSIONS))}")
        kwargs.setdefault("tie_word_embeddings", False)  # embed_tokens and lm_head are distinct tensors
        if rope_parameters is None:
            rope_parameters = {
                "rope_type": "default",
                "rope_theta": float(rope_theta if rope_theta is not None else 10000.0),
            }
        draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        if version == "eagle1" and draft_vocab_size != vocab_size:
            raise EagleError(
                f"EagleConfig: eagle1 projects with the target's lm_head, so draft_vocab_size must equal vocab_size "
                f"({vocab_size}), got {draft_vocab_size}"
            )
        if not 1 <= draft_vocab_size <= vocab_size:
            raise EagleError(f"EagleConfig: draft_vocab_size={draft_vocab_size}; expected 1..vocab_size ({vocab_size})")
        variants = dict(norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output, qk_norm=qk_norm)
        flags = dict(variants, norm_before_residual=norm_before_residual, embed_requires_grad=embed_requires_grad)
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise EagleError(f"EagleConfig: {name}={value!r}; expected true or false")
        if version == "eagle1" and (any(variants.values()) or target_hidden_size is not None):
            raise EagleError(
                f"EagleConfig: {', '.join(variants)} and target_hidden_size are EAGLE-3 options (version eagle1)"
            )
        if norm_before_fc and fc_norm:
            raise EagleError(
                "EagleConfig: norm_before_fc and fc_norm are exclusive: one norm over the concat or one per aux state"
            )
        if target_hidden_size is not None and not (isinstance(target_hidden_size, int) and target_hidden_size > 0):
            raise EagleError(f"EagleConfig: target_hidden_size={target_hidden_size!r}; expected a positive int or null")
        if aux_layer_ids is None:
            L = self.target_num_layers
            aux_layer_ids = ([L] if version == "eagle1" else default_aux_layer_ids(L)) if L is not None else []
        self.version = version
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters)
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.hidden_act = hidden_act
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.norm_before_residual = norm_before_residual
        self.norm_before_fc, self.fc_norm, self.norm_output = norm_before_fc, fc_norm, norm_output
        self.embed_requires_grad, self.target_hidden_size = embed_requires_grad, target_hidden_size
        self.qk_norm = qk_norm
        self.initializer_range = initializer_range
        super().__init__(**kwargs)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def aux_hidden_size(self) -> int:
        """Width of one target hidden state as fc reads it (the target's hidden size)."""
        return self.target_hidden_size or self.hidden_size

    def layer_config(self) -> LlamaConfig:
        """The decoder layer as a 1-layer llama config (RoPE and MLP are built from it; the vLLM
        export writes it as `transformer_layer_config`). vocab_size is the TARGET's."""
        return llama_layer_config(self, 1)


# ---------------------------------------------------------------------- the decoder layer
class EagleAttention(nn.Module):
    """Llama attention (RoPE, GQA) whose q/k/v read `in_features` (2H for EAGLE-3); with `qk_norm`,
    Qwen3's: q and k RMS-normalised per head before RoPE."""

    def __init__(self, config: EagleConfig, in_features: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = qkvo_projections(c, in_features, EagleError)
        self.qk_norm = c.qk_norm
        if c.qk_norm:  # one gain per channel of a head, shared by the heads (Qwen3Attention's q_norm/k_norm)
            self.q_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, heads, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, kv_heads, hd]
        if self.qk_norm:  # over each head's hd channels, before RoPE: the cache keeps normed, rotated keys
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # keys are cached after RoPE, as in HF
        return self.o_proj(attend(q, k, v, mask, cache, 0))


class EagleDecoderLayer(nn.Module):
    """One Llama decoder layer, named like Llama's so that the keys match the servers'."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        H = config.hidden_size
        self.eagle3 = config.version == "eagle3"
        self.norm_before_residual = config.norm_before_residual
        layer_config = config.layer_config()
        self.self_attn = EagleAttention(config, 2 * H if self.eagle3 else H)
        self.mlp = LlamaMLP(layer_config)
        if self.eagle3:  # EAGLE-1 drops input_layernorm: its input is fc of an already normalised feature
            self.input_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, mask, cache) -> torch.Tensor:
        if self.eagle3:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = x = hidden
        h = residual + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------- the head
class EagleHead(Fp32Rope, PreTrainedModel):
    """An EAGLE-1 or EAGLE-3 draft head for one target (see the module docstring)."""

    config_class = EagleConfig
    base_model_prefix = "eagle"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.eagle3 = config.version == "eagle3"
        self.embed_tokens = nn.Embedding(V, H)
        if self.eagle3:
            n, Ht, eps = config.num_aux, config.aux_hidden_size, config.rms_norm_eps
            if config.norm_before_fc:
                self.input_norm = LlamaRMSNorm(n * Ht, eps=eps)
            if config.fc_norm:
                self.fc_norm = nn.ModuleList([LlamaRMSNorm(Ht, eps=eps) for _ in range(n)])
            self.fc = nn.Linear(n * Ht, H, bias=False)
        else:
            self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)])
        if self.eagle3:
            self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.layer_config())  # non-persistent buffers: not saved
        if self.eagle3:
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64), persistent=True)
            self.register_buffer("t2d", torch.ones(V, dtype=torch.bool), persistent=True)
        self.post_init()
        self._freeze()

    def _freeze(self) -> None:
        # Target copies never train: EAGLE's embeddings are the target's (unless embed_requires_grad),
        # and EAGLE-1's lm_head is the target's (its loss targets are that head's outputs).
        self.embed_tokens.weight.requires_grad_(self.config.embed_requires_grad)
        if not self.eagle3:
            self.lm_head.weight.requires_grad_(False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        version: str = "eagle3",
        *,
        aux_layer_ids=None,
        vocab_map=None,
        target_name_or_path: str | None = None,
        data_hash: str | None = None,
        **variant,
    ) -> EagleHead:
        """A head shaped like `target`'s decoder layers, on its device and dtype: embeddings copied
        (frozen), lm_head copied (EAGLE-1: frozen; EAGLE-3: the rows of the draft vocabulary).
        `variant`: EAGLE-3 options of `EagleConfig` (HEAD_OPTIONS, e.g. fc_norm=True, qk_norm=True)."""
        if version not in VERSIONS:
            raise EagleError(f"version {version!r}: expected one of {', '.join(map(repr, VERSIONS))}")
        unknown = sorted(set(variant) - set(HEAD_OPTIONS))
        if unknown:
            raise EagleError(f"for_target: unknown option(s) {unknown}; the options are {', '.join(HEAD_OPTIONS)}")
        tc = target.config.get_text_config()
        L = tc.num_hidden_layers
        lm_weight, embed_weight = target_weights(target, EagleError)
        check_target_weights(lm_weight, embed_weight, tc.hidden_size, EagleError)
        V = lm_weight.shape[0]
        if aux_layer_ids is None:
            aux_layer_ids = [L] if version == "eagle1" else default_aux_layer_ids(L)
        aux_layer_ids = [int(i) for i in aux_layer_ids]
        if not aux_layer_ids:
            raise EagleError("aux_layer_ids is empty: give at least one HF hidden_states index")
        for i in aux_layer_ids:
            if not 0 <= i <= L:
                raise EagleError(
                    f"aux layer id {i} is out of range: the target has {L} layers, so valid HF hidden_states "
                    f"indices are 0..{L} (0 = embeddings, {L} = last layer after the final norm)"
                )
        if len(set(aux_layer_ids)) != len(aux_layer_ids):
            raise EagleError(f"aux_layer_ids {aux_layer_ids} repeat an id")
        if version == "eagle1" and aux_layer_ids != [L]:
            raise EagleError(
                f"eagle1 reads the post-norm last hidden state: aux_layer_ids must be [{L}], got {aux_layer_ids}"
            )
        if vocab_map is not None:
            if version == "eagle1":
                raise EagleError("eagle1 uses the target's full lm_head: a vocab_map applies to eagle3 only")
            check_vocab_map(vocab_map, V, EagleError)
        config = EagleConfig(
            **target_shape(target, V, vocab_map, target_name_or_path, data_hash),
            version=version,
            attention_bias=bool(getattr(tc, "attention_bias", False)),
            aux_layer_ids=aux_layer_ids,
            **variant,
        )
        return head_on_target(cls, config, embed_weight, lm_weight, vocab_map)

    # ------------------------------------------------------------------ computation
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: fc over the concatenated aux hidden states [..., n_aux*H] -> [..., H];
        EAGLE-1: the identity (its fc reads the embedding too, inside `forward`)."""
        if not self.eagle3:
            return aux_hidden
        c = self.config
        expected = c.num_aux * c.aux_hidden_size
        if aux_hidden.shape[-1] != expected:
            raise EagleError(
                f"project: the aux hidden states are {aux_hidden.shape[-1]} wide, expected {c.num_aux} "
                f"layers {c.aux_layer_ids} x hidden {c.aux_hidden_size} = {expected}"
            )
        x = aux_hidden.to(self.fc.weight.dtype)
        if c.norm_before_fc:
            x = self.input_norm(x)
        if c.fc_norm:  # each layer's state on its own scale: deep layers' norms grow with depth
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(c.num_aux, dim=-1))], dim=-1)
        return self.fc(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_hidden [B, T, H], logits [B, T, draft_vocab]) for input_ids [B, T] (token t+1 at
        position t) and hidden [B, T, H] (EAGLE-1: f_t; EAGLE-3: project(aux) or a previous out_hidden).
        With `logits_at` (bool [B, T]) the logits are those positions' only, [N, draft_vocab] in
        row-major order: training projects just the positions its loss reads.

        cache: a HF cache (`DynamicCache`: the head's past columns; a `StaticCache` of the decoder's
        static store: its whole buffer) or None. attention_mask: None = causal among the T new
        tokens, each sees the whole (growing) cache; else a float additive mask [B, 1, T, S] over
        the S columns the cache's layer returns (past + T for a growing one; 0 = attend, large
        negative = blocked)."""
        if (
            input_ids.dim() != 2
            or tuple(hidden.shape[:2]) != tuple(input_ids.shape)
            or hidden.shape[-1] != self.config.hidden_size
        ):
            raise EagleError(
                f"forward: input_ids {list(input_ids.shape)} and hidden {list(hidden.shape)} must be [B, T] and "
                f"[B, T, {self.config.hidden_size}]"
            )
        B, T = input_ids.shape
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != T:
            raise EagleError(f"forward: position_ids {list(position_ids.shape)} do not cover the {T} new tokens")
        past = 0 if cache is None else cache.get_mask_sizes(T, 0)[0] - T
        if logits_at is not None and tuple(logits_at.shape) != (B, T):
            raise EagleError(f"forward: logits_at {list(logits_at.shape)} must be [B, T] = [{B}, {T}]")
        mask = self._mask(attention_mask, B, T, past, self.embed_tokens.weight.dtype, input_ids.device)
        return self.decode(input_ids, hidden, position_ids.expand(B, T), mask, cache, logits_at)

    def decode(self, input_ids, hidden, position_ids, mask, cache, logits_at=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` without its checks, for the decoder's steps: position_ids [B, T], `cache` a
        HF cache (growing or static) or None, mask a float additive [B or 1, 1, T, S] over the S
        columns its layer returns (the past and the new ones; a static layer's whole buffer;
        S = T without a cache)."""
        embeds = self.embed_tokens(input_ids)
        hidden = hidden.to(embeds.dtype)
        x = hidden if self.eagle3 else self.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = self.rotary_emb(x, position_ids)
        out = self.layers[0](embeds, x, cos, sin, mask, cache)
        normed = self.norm(out) if self.eagle3 else out  # EAGLE-1 projects the layer's output as it is
        projected = normed if logits_at is None else normed[logits_at]
        # EAGLE-3.1 norm_output: the next step reads the post-norm state (the logits are the same).
        return (normed if self.config.norm_output else out), self.lm_head(projected)

    @staticmethod
    def _mask(mask, B, T, past, dtype, device) -> torch.Tensor:
        if mask is None:
            blocked = torch.ones(T, past + T, dtype=torch.bool, device=device).triu(past + 1)
            return torch.zeros(T, past + T, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[
                None, None
            ]
        if mask.dtype == torch.bool or not mask.is_floating_point():
            raise EagleError(
                "forward: pass a float additive attention_mask (0 = attend, large negative = blocked), not a bool mask"
            )
        if (
            mask.dim() != 4
            or mask.shape[1] != 1
            or tuple(mask.shape[-2:]) != (T, past + T)
            or mask.shape[0] not in (1, B)
        ):
            raise EagleError(
                f"forward: attention_mask must be [B, 1, {T}, {past + T}] (cache {past} + new {T}), got {list(mask.shape)}"
            )
        return mask.to(device=device, dtype=dtype)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (target = draft + d2t[draft]); the identity for EAGLE-1."""
        if not self.eagle3:
            return draft_ids
        return draft_to_target_ids(draft_ids, self.d2t)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] placed into the target vocabulary [..., V], -inf elsewhere."""
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        if not self.eagle3 or (Vd == V and not bool(self.d2t.any())):
            return logits
        return draft_to_target_logits(logits, self.d2t, V)

    def check_target(self, target: PreTrainedModel) -> None:
        """EagleError when the head cannot serve `target` (sizes, depth, positions, RoPE). Whether it
        was trained on this very target (the fingerprint) is `heads.provenance`'s check, which
        `draftsmith eval` runs."""
        c = self.config
        tc = target.config.get_text_config()
        name = getattr(target.config, "_name_or_path", None) or type(target).__name__
        trained_on = c.target_name_or_path or "an unrecorded target"
        vocab = target_weights(target, EagleError)[0].shape[0]
        checks = [
            ("hidden size", c.aux_hidden_size, tc.hidden_size),
            ("vocab size", c.vocab_size, vocab),
            ("num_hidden_layers", c.target_num_layers, tc.num_hidden_layers),
            ("max_position_embeddings", c.max_position_embeddings, tc.max_position_embeddings),
            ("rope_parameters", c.rope_parameters, rope_of(tc)),
        ]
        for what, ours, theirs in checks:
            if ours is not None and ours != theirs:
                raise EagleError(
                    f"EAGLE head has {what} {ours} (trained on {trained_on}) but target {name!r} has {theirs}"
                    + (
                        ": a mismatch here silently collapses acceptance"
                        if what in ("max_position_embeddings", "rope_parameters")
                        else ""
                    )
                )
        if max(c.aux_layer_ids) > tc.num_hidden_layers:
            raise EagleError(
                f"EAGLE head reads hidden states {c.aux_layer_ids}, target {name!r} has only {tc.num_hidden_layers} layers"
            )
