"""What the heads over the target's states share: Llama-style decoder layers built from the
target's shapes, with the target's embeddings (and lm_head rows) copied in.

    rope = rope_of(target.config.get_text_config())       # the target's RoPE, transformers-5 spelling
    lm_weight, embed_weight = target_weights(target, EagleError)
    config = EagleConfig(**target_shape(target, lm_weight.shape[0], vocab_map, name, data_hash))
    head = head_on_target(EagleHead, config, embed_weight, lm_weight, vocab_map)

Each function takes the caller's error class, so a user sees EagleError or DFlashError as before.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, repeat_kv


def layer_value(text_config, name: str, layer: int | None = None, default=None):
    """`text_config.NAME` (`default` when absent); for an attribute that varies per layer (Gemma 4's
    `head_dim`, which transformers refuses to read globally), layer `layer`'s, by default the first
    full-attention layer's (what a head's layers, attending to the whole context, are shaped as)."""
    per_layer = getattr(text_config, "per_layer_config", None)
    if layer is None:
        try:
            return getattr(text_config, name, default)
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            types = list(getattr(text_config, "layer_types", None) or ())
            layer = types.index("full_attention") if "full_attention" in types else 0
    if per_layer is None:
        return getattr(text_config, name, default)
    return getattr(per_layer[layer], name, default)


def rope_of(text_config) -> dict:
    """The target's RoPE as transformers 5 spells it (older configs: rope_theta + rope_scaling). A
    target with one RoPE per layer type (Gemma 3, OLMo 3: {"full_attention": {...},
    "sliding_attention": {...}}) gives its full-attention one: a head's layers attend to the whole
    context, as those layers do (a llama config given the nested form would apply theta 10,000)."""
    rope = getattr(text_config, "rope_parameters", None)
    if rope:
        rope = dict(rope)
        if all(isinstance(v, dict) for v in rope.values()):
            rope = rope.get("full_attention") or next(iter(rope.values()))
        return copy.deepcopy(dict(rope))
    rope = dict(getattr(text_config, "rope_scaling", None) or {"rope_type": "default"})
    rope.setdefault("rope_theta", float(getattr(text_config, "rope_theta", 10000.0)))
    return rope


# A head config's fields that shape its decoder layers, named as a llama config names them.
LAYER_FIELDS = (
    "vocab_size",  # the TARGET's
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "attention_bias",
    "initializer_range",
)


def llama_layer_config(config, num_layers: int) -> LlamaConfig:
    """A head config's decoder layers as a llama config (RoPE and the MLP are built from it):
    its `LAYER_FIELDS`, `num_layers` layers, its RoPE, no MLP bias, untied embeddings."""
    return LlamaConfig(
        **{name: getattr(config, name) for name in LAYER_FIELDS},
        num_hidden_layers=num_layers,
        rope_parameters=copy.deepcopy(config.rope_parameters),
        mlp_bias=False,
        tie_word_embeddings=False,
    )


class Fp32Rope:
    """A head's mixin (before PreTrainedModel in its bases) for its own `rotary_emb`: `.to(bfloat16)`
    would cast RoPE's inverse frequencies too; HF targets loaded in bf16 keep them in fp32
    (from_pretrained recomputes them), so the head does the same or its positions drift."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        inv = self.rotary_emb.inv_freq
        if inv.dtype != torch.float32 and inv.device.type != "meta":
            self.rotary_emb = LlamaRotaryEmbedding(self.config.layer_config()).to(inv.device)
        return self


# A head config's provenance: the target it was built for (name, revision, fingerprint
# (draftsmith.heads.models.target_fingerprint), depth, architectures), the training data's hash and
# the data hash the draft vocabulary was counted on.
PROVENANCE = (
    "target_name_or_path",
    "target_revision",
    "target_fingerprint",
    "target_num_layers",
    "target_architectures",
    "data_hash",
    "vocab_map_data_hash",
)


def record_target(config, kwargs: dict) -> None:
    """Set a head config's `PROVENANCE` fields, taken out of its __init__'s `kwargs` (None when not given)."""
    for name in PROVENANCE:
        setattr(config, name, kwargs.pop(name, None))
    config.target_architectures = list(config.target_architectures) if config.target_architectures else None


# ---------------------------------------------------------------------- attention
def qkvo_projections(config, in_features: int, error: type[Exception]) -> tuple[nn.Linear, ...]:
    """q/k/v/o projections of a GQA attention whose q/k/v read `in_features`."""
    c = config
    if c.num_attention_heads % c.num_key_value_heads:
        raise error(
            f"num_attention_heads={c.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={c.num_key_value_heads}"
        )
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return (
        nn.Linear(in_features, q_width, bias=c.attention_bias),
        nn.Linear(in_features, kv_width, bias=c.attention_bias),
        nn.Linear(in_features, kv_width, bias=c.attention_bias),
        nn.Linear(q_width, c.hidden_size, bias=c.attention_bias),
    )


def attend(q, k, v, mask, cache, layer_idx: int) -> torch.Tensor:
    """Attention of q [N, heads, Q, hd] over what layer `layer_idx` of the HF cache `cache` (or
    None) returns for k, v [N, kv_heads, S, hd] (keys after RoPE, as HF caches them: a growing
    `DynamicCache` its past and them, a `StaticCache` its whole buffer); [N, Q, heads * hd]."""
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


# ---------------------------------------------------------------------- built from a target
def target_weights(target: PreTrainedModel, error: type[Exception]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head weight [V, H], embedding weight [V, H]) of the target."""
    out, emb = target.get_output_embeddings(), target.get_input_embeddings()
    if out is None or emb is None:
        raise error(f"target {type(target).__name__} lacks input or output embeddings")
    return out.weight, emb.weight


def check_target_weights(lm_weight, embed_weight, hidden_size: int, error: type[Exception]) -> None:
    V = lm_weight.shape[0]
    if lm_weight.shape[1] != hidden_size or tuple(embed_weight.shape) != (V, hidden_size):
        raise error(
            f"target's embeddings {tuple(embed_weight.shape)} and lm_head {tuple(lm_weight.shape)} do not both "
            f"match [vocab, hidden_size={hidden_size}]"
        )


def check_vocab_map(vocab_map, vocab_size: int, error: type[Exception]) -> None:
    """`vocab_map` covers the target's `vocab_size` tokens and is consistent."""
    from draftsmith.heads.vocab_map import VocabMapError, check_consistent

    if vocab_map.target_vocab_size != vocab_size:
        raise error(f"vocab_map covers {vocab_map.target_vocab_size} target tokens, the target outputs {vocab_size}")
    try:
        check_consistent(vocab_map)
    except VocabMapError as err:
        raise error(f"vocab_map is inconsistent: {err}") from None


def target_provenance(target: PreTrainedModel, target_name_or_path, data_hash) -> dict:
    """The provenance every head records of the target it is built for: its name, revision,
    fingerprint and depth, and the hash of the training data."""
    from draftsmith.heads.models import target_fingerprint

    return dict(
        target_name_or_path=target_name_or_path or getattr(target.config, "_name_or_path", None) or None,
        target_revision=getattr(target.config, "_commit_hash", None),
        target_fingerprint=target_fingerprint(target),
        target_num_layers=target.config.get_text_config().num_hidden_layers,
        data_hash=data_hash,
    )


def target_shape(target: PreTrainedModel, vocab_size: int, vocab_map, target_name_or_path, data_hash) -> dict:
    """The config fields a head built for `target` takes from it: the layers' shapes, RoPE, the
    vocabularies and the provenance (`target_provenance`, the architectures, the vocabulary's data hash)."""
    tc = target.config.get_text_config()
    return dict(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=layer_value(tc, "num_key_value_heads") or tc.num_attention_heads,
        head_dim=layer_value(tc, "head_dim") or tc.hidden_size // tc.num_attention_heads,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=rope_of(tc),
        max_position_embeddings=tc.max_position_embeddings,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        vocab_size=vocab_size,
        draft_vocab_size=vocab_map.draft_vocab_size if vocab_map is not None else vocab_size,
        initializer_range=getattr(tc, "initializer_range", 0.02),
        **target_provenance(target, target_name_or_path, data_hash),
        target_architectures=list(getattr(target.config, "architectures", None) or [type(target).__name__]),
        vocab_map_data_hash=vocab_map.data_hash if vocab_map is not None else None,
    )


def head_on_target(cls, config, embed_weight, lm_weight, vocab_map):
    """A new head `cls(config)` on the target's device and dtype, with the target's embeddings in
    `embed_tokens` and its lm_head (the draft vocabulary's rows with a vocab map, and the map's
    d2t/t2d) in `lm_head`, frozen where they are the target's (the head's `_freeze`)."""
    head = cls(config).to(device=lm_weight.device, dtype=lm_weight.dtype)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embed_weight)
        if vocab_map is not None:
            head.lm_head.weight.copy_(lm_weight[vocab_map.target_ids().to(lm_weight.device)])
            head.d2t.copy_(vocab_map.d2t)
            head.t2d.copy_(vocab_map.t2d)
        else:
            head.lm_head.weight.copy_(lm_weight)
    head._freeze()
    return head


# ---------------------------------------------------------------------- a reduced draft vocabulary
def draft_to_target_ids(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of draft ids: target = draft + d2t[draft] (`heads.vocab_map`)."""
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


def draft_to_target_logits(logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., Vd] placed into the target vocabulary [..., vocab_size], -inf elsewhere."""
    ids = torch.arange(d2t.shape[0], device=logits.device) + d2t.to(logits.device)
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


def describe_mask_head(head, what: str) -> str:
    """The console line of a head that drafts with a mask token (a one-pass head): `what` (its
    shape), then the target layers it reads, its mask token, its vocabulary, its trained size."""
    c = head.config
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return (
        f"{what}, aux layers {c.aux_layer_ids}, mask token {c.mask_token_id} ({c.mask_token_source}), "
        f"draft vocabulary {c.draft_vocab_size}/{c.vocab_size}, {trained / 1e6:.2f}M trained parameters"
    )


MASK_SOURCES = ("recipe", "tokenizer", "reserved")  # where a head's mask token came from (its config records it)


def choose_mask_token(
    vocab_size: int, *, explicit: int | None = None, tokenizer=None, used=None, error: type[Exception] = ValueError
) -> tuple[int, str]:
    """(mask token id, where it came from): the explicit id, else the tokenizer's mask token, else
    the highest id below `vocab_size` that nothing uses: not a token the tokenizer knows (padding
    rows of the embedding matrix) or, failing that, not in `used` (ids of the training data)."""
    if explicit is not None:
        return int(explicit), "recipe"
    mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask is not None and 0 <= mask < vocab_size:
        return int(mask), "tokenizer"
    known = len(tokenizer) if tokenizer is not None else vocab_size
    if known < vocab_size:  # rows past the tokenizer's vocabulary: never produced, never fed
        return vocab_size - 1, "reserved"
    used = set(int(t) for t in (used if used is not None else ()))
    specials = set(getattr(tokenizer, "all_special_ids", None) or [])
    for token in range(vocab_size - 1, -1, -1):
        if token not in used and token not in specials:
            return token, "reserved"
    raise error(f"no unused token id below vocab_size={vocab_size} for the mask token: give mask_token_id")


def spread_layer_ids(num_layers: int) -> list[int]:
    """Three hidden states spread over a target of `num_layers` layers, as heads that read several
    target layers take them: (2, L//2, L-3), or first/middle/last of range(1, L)
    for tiny targets; HF hidden_states indices, increasing, none the embedding output when L >= 4."""
    L = num_layers
    if L >= 7:
        return [2, L // 2, L - 3]
    pool = list(range(1, L)) if L >= 4 else list(range(max(L, 1)))
    return sorted({pool[0], pool[len(pool) // 2], pool[-1]})
