"""Draft models for DistillSpec-style distillation: a small causal LM of the target's family.

A draft is what users serve with vLLM `--speculative-model`, so it must speak the target's
vocabulary (same ids for the same token strings); it is then distilled towards the target.
Three ways to get one:

    draft = draft_from_config(target, num_layers=2, hidden_size=1024)   # random init, narrower
    draft = draft_by_truncation(target, num_layers=4)                   # the target's first 4 layers
    draft = load_draft("Qwen/Qwen2.5-0.5B-Instruct", target, target_tokenizer=tok)  # a checkpoint
    check_same_vocabulary(target, draft, tok, draft_tok)                # what the trainer calls
    describe_draft(draft, target)                                       # sizes and provenance

Every draft carries `config.draftsmith_build` = {"method": "config" | "truncation" |
"checkpoint", ..., "target_fingerprint": ...}, which `save_pretrained` writes to config.json,
and the target's `generation_config`.

All config fields are read and written by their standard names (`num_hidden_layers`,
`hidden_size`, ...): `PretrainedConfig.attribute_map` maps them to a family's own names
(e.g. GPT-2's `n_layer`), so no builder branches on the family.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from draftsmith.heads.artifacts import write_folder_atomic
from draftsmith.heads.models import (
    ModelLoadError,
    load_causal_lm,
    load_tokenizer,
    parse_dtype,
    resolve_device,
    target_fingerprint,
)

SPEC_HINT = "speculative decoding needs the target's tokenizer"
# What a draft folder carries beside its weights: the target's tokenizer (drafting and verifying
# share token ids), one of these files at least.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Pickle files run code when loaded; the Hub flags them and servers may refuse them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class DraftBuildError(ModelLoadError):
    """A draft that cannot be built or used with this target; the message names the model or
    folder, the key and the value expected. A `ModelLoadError`, hence a `ValueError`."""


# --------------------------------------------------------------------------- small helpers


def _name(model: PreTrainedModel) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def _text_config(config):
    """The language model's config (itself for a plain causal LM)."""
    return config.get_text_config()


def final_norm(model: PreTrainedModel) -> nn.Module | None:
    """The norm between the last decoder layer and the lm_head (`model.norm` in Llama,
    `gpt_neox.final_layer_norm` in GPT-NeoX): the one norm among the backbone's direct children."""
    norms = [m for _, m in model.base_model.named_children() if "norm" in type(m).__name__.lower()]
    return norms[0] if len(norms) == 1 else None


def _per_layer_keys(config, num_layers: int) -> list[str]:
    """Config lists with one entry per decoder layer (`layer_types` for sliding/full attention,
    `mlp_layer_types` for dense/MoE): they must follow `num_hidden_layers` or the config is invalid.
    (`mtp_layer_types` ends the same way but counts extra MTP layers: its length differs.)"""
    return [
        key
        for key, value in vars(config).items()
        if key.endswith("layer_types") and isinstance(value, (list, tuple)) and len(value) == num_layers
    ]


def _copy_config(target: PreTrainedModel, num_layers: int):
    """A deep copy of the target's config with `num_layers` decoder layers and per-layer lists cut."""
    config = copy.deepcopy(target.config)
    text = _text_config(config)
    target_layers = text.num_hidden_layers
    for key in _per_layer_keys(text, target_layers):
        if num_layers > target_layers:
            raise DraftBuildError(
                f"target {_name(target)!r}: num_layers={num_layers} is deeper than the target ({target_layers} "
                f"layers) and its config's `{key}` has one entry per layer; a draft needs num_layers <= {target_layers}"
            )
        setattr(text, key, list(getattr(text, key))[:num_layers])
    # Per-layer overrides (Gemma 4's head_dim of its full layers): those of the kept layers only.
    spec = getattr(text, "_heterogeneity_spec", None)
    if spec is not None:
        spec.per_layer_overrides = {i: o for i, o in spec.per_layer_overrides.items() if i < num_layers}
    text.num_hidden_layers = num_layers
    config._name_or_path = ""  # the target's path would lie about where the draft lives
    return config


def _validate(config, target: PreTrainedModel) -> None:
    """Transformers' own validation (strict configs), reworded to name the target."""
    validate = getattr(config, "validate", None)
    if validate is None:
        return
    try:
        validate()
    except (ValueError, TypeError, StrictDataclassError) as err:  # transformers 5 raises the latter
        reason = str(err).strip().splitlines()[-1].strip()  # transformers' last line says why
        layers = getattr(_text_config(config), "num_hidden_layers", None)
        raise DraftBuildError(
            f"a draft of {layers} layer(s) derived from target {_name(target)!r} is not a valid "
            f"{type(config).__name__}: {reason}"
        ) from None


def _build(config, target: PreTrainedModel) -> PreTrainedModel:
    """Random-init model of `config` in the target's dtype, created directly on its device."""
    with torch.device(target.device):
        return AutoModelForCausalLM.from_config(config, dtype=target.dtype)


def _finish(draft: PreTrainedModel, target: PreTrainedModel, build: dict) -> PreTrainedModel:
    draft.config.draftsmith_build = {
        **build,
        "target_name_or_path": getattr(target.config, "_name_or_path", "") or None,  # None: built in memory
        "target_fingerprint": target_fingerprint(target),
    }
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()  # like a loaded model; the trainer calls .train()


# --------------------------------------------------------------------------- builders


def draft_from_config(
    target: PreTrainedModel,
    *,
    num_layers: int,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    copy_embeddings: bool = True,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised model of the target's config class with the given shape.

    Everything else (vocab_size, tie_word_embeddings, rope settings, max_position_embeddings,
    bos/eos/pad ids) is the target's. Defaults for what is not given:
    - intermediate_size: the target's MLP ratio (intermediate / hidden) at the new width;
    - num_attention_heads: the target's (narrower heads when hidden shrinks);
    - num_key_value_heads: the target's; or equal to the heads when the target is full multi-head
      attention (kv == heads) and only the heads change.
    With the target's hidden size and `copy_embeddings`, the input embeddings, lm_head and final
    norm start as the target's: the draft begins in the target's token space, which is most of
    what a shallow draft can share with it.
    """
    text = _text_config(target.config)
    if num_layers < 1:
        raise DraftBuildError(f"target {_name(target)!r}: num_layers={num_layers}; a draft needs at least 1 layer")
    requested = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
    }
    for key, value in requested.items():
        if value is not None and not hasattr(text, key):
            raise DraftBuildError(
                f"target {_name(target)!r} ({type(text).__name__}) has no `{key}` in its config; "
                f"drop {key}={value} (e.g. GPT-NeoX has one key/value head per attention head)"
            )

    hidden = text.hidden_size if hidden_size is None else hidden_size
    heads = text.num_attention_heads if num_attention_heads is None else num_attention_heads
    changes = {"hidden_size": hidden, "num_attention_heads": heads}
    if hasattr(text, "intermediate_size"):
        mlp = intermediate_size
        if mlp is None and text.intermediate_size is not None:
            mlp = round(text.intermediate_size * hidden / text.hidden_size)
        changes["intermediate_size"] = mlp
    if hasattr(text, "num_key_value_heads"):
        kv = num_key_value_heads
        if kv is None:
            full_mha = text.num_key_value_heads in (None, text.num_attention_heads)
            kv = heads if full_mha else text.num_key_value_heads
        changes["num_key_value_heads"] = kv
    for key, value in changes.items():  # before any division by them
        if value is not None and value < 1:
            raise DraftBuildError(f"target {_name(target)!r}: {key}={value}; expected a positive integer")
    if hidden % heads:
        raise DraftBuildError(
            f"target {_name(target)!r}: hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
            f"pick heads that divide {hidden} (the target has {text.num_attention_heads} heads of "
            f"{text.hidden_size // text.num_attention_heads})"
        )
    kv = changes.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise DraftBuildError(
            f"target {_name(target)!r}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv}; "
            "each key/value head must serve a whole group of query heads (pass num_key_value_heads)"
        )

    config = _copy_config(target, num_layers)
    draft_text = _text_config(config)
    for key, value in changes.items():
        setattr(draft_text, key, value)
    # Llama/Mistral store head_dim explicitly; when it was derived (hidden / heads) it follows the
    # new shape, when it was decoupled from the width (e.g. Gemma, Qwen3) it stays the target's.
    if getattr(text, "head_dim", None) is not None and text.head_dim == text.hidden_size // text.num_attention_heads:
        draft_text.head_dim = hidden // heads
    _validate(config, target)

    with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
        torch.manual_seed(seed)
        draft = _build(config, target)

    copied = copy_embeddings and hidden == text.hidden_size
    if copied:
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            draft_head, target_head = draft.get_output_embeddings(), target.get_output_embeddings()
            draft_head.weight.copy_(target_head.weight)  # a no-op copy of itself when tied
            if getattr(target_head, "bias", None) is not None:
                draft_head.bias.copy_(target_head.bias)
            draft_norm, target_norm = final_norm(draft), final_norm(target)
            if draft_norm is not None and target_norm is not None:
                draft_norm.load_state_dict(target_norm.state_dict())
    build = {"method": "config", "num_layers": num_layers, **changes, "copied_embeddings": copied, "seed": seed}
    return _finish(draft, target, build)


def draft_by_truncation(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target's embeddings, first `num_layers` decoder layers, final norm and lm_head.

    Exactly the target's early exit: its logits are lm_head(norm(h_k)) of the target's k-th
    layer output, so distillation starts from a draft that already agrees with the target often.
    """
    total = _text_config(target.config).num_hidden_layers
    if not 1 <= num_layers < total:
        raise DraftBuildError(
            f"target {_name(target)!r} has {total} layers: truncation needs 1 <= num_layers < {total}, got {num_layers}"
        )
    config = _copy_config(target, num_layers)
    _validate(config, target)
    draft = _build(config, target)

    source = target.state_dict()
    wanted = draft.state_dict()
    missing = [key for key in wanted if key not in source]
    if missing:
        raise DraftBuildError(
            f"target {_name(target)!r}: the truncated draft has weights the target lacks: {missing[:5]}; "
            "its layers are not named alike (is the target wrapped, e.g. by PEFT? pass the base model)"
        )
    weights = {key: _layer_major_slice(source[key], value.shape, num_layers, total) for key, value in wanted.items()}
    mismatched = [
        f"{key}: draft {tuple(value.shape)} vs target {tuple(source[key].shape)}"
        for key, value in wanted.items()
        if value.shape != weights[key].shape
    ]
    if mismatched:
        raise DraftBuildError(f"target {_name(target)!r}: truncated draft weights differ in shape: {mismatched[:3]}")
    draft.load_state_dict(weights, strict=True)  # copies: the target is untouched
    return _finish(draft, target, {"method": "truncation", "num_layers": num_layers, "target_num_layers": total})


def _layer_major_slice(weight: torch.Tensor, shape, num_layers: int, total: int) -> torch.Tensor:
    """`weight` cut to the truncated model's `shape` where one dimension holds a block per layer, in
    layer order (Gemma 4's per-layer inputs: `embed_tokens_per_layer` [V, L x d] and
    `per_layer_model_projection` [L x d, H]): the first `num_layers` blocks, which are exactly what
    the first layers read. Any other difference is left for the caller to refuse."""
    differ = [d for d in range(weight.dim()) if len(shape) == weight.dim() and shape[d] != weight.shape[d]]
    if len(differ) != 1 or weight.shape[differ[0]] % total:
        return weight
    d = differ[0]
    block = weight.shape[d] // total
    return weight.narrow(d, 0, block * num_layers) if shape[d] == block * num_layers else weight


def load_draft(path, target: PreTrainedModel, *, target_tokenizer=None, device=None, dtype=None) -> PreTrainedModel:
    """An existing small checkpoint (local folder or hub id), checked against the target's vocabulary.

    `target_tokenizer` is the in-memory target's tokenizer; without it, the tokenizer of the
    folder the target was loaded from is used when there is one. Device and dtype default to
    the target's.
    """
    if device is None:
        device = target.device
    elif isinstance(device, str):
        device = resolve_device(device)
    if dtype is None:
        dtype = target.dtype
    elif isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    draft = load_causal_lm(path, device=device, dtype=dtype, role="draft")
    if target_tokenizer is None:
        target_dir = getattr(target.config, "_name_or_path", "")
        if target_dir and Path(target_dir).is_dir():
            target_tokenizer = load_tokenizer(target_dir)
    draft_tokenizer = load_tokenizer(path)
    resized_from = None
    v_target = target.get_output_embeddings().weight.shape[0]
    v_draft = draft.get_output_embeddings().weight.shape[0]
    if v_draft != v_target and target_tokenizer is not None and draft_tokenizer is not None:
        # Sizes that differ only by padding (Qwen2.5 0.5B pads to 151,936, 7B+ to 152,064): with
        # identical tokenizers that fit both, the padding rows are never real tokens, so the
        # draft is resized to the target's logit size and the losses compare id by id.
        if target_tokenizer.get_vocab() == draft_tokenizer.get_vocab() and len(target_tokenizer) <= min(
            v_target, v_draft
        ):
            draft.resize_token_embeddings(v_target, mean_resizing=False)
            resized_from = v_draft
    check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer, draft_name=str(path))
    if target_tokenizer is None or draft_tokenizer is None:
        which = "target" if target_tokenizer is None else "draft"
        warnings.warn(
            f"draft {str(path)!r}: no {which} tokenizer, so only the vocabulary sizes were compared; "
            f"pass target_tokenizer= to check that the token strings agree ({SPEC_HINT})",
            stacklevel=2,
        )
    previous = getattr(draft.config, "draftsmith_build", None)  # e.g. a draft built here, then trained
    return _finish(
        draft,
        target,
        {"method": "checkpoint", "path": str(path), "source_build": previous, "resized_vocab_from": resized_from},
    )


# --------------------------------------------------------------------------- checks and reports


def check_same_vocabulary(
    target, draft, target_tokenizer=None, draft_tokenizer=None, *, draft_name: str | None = None
) -> None:
    """The draft outputs logits over the target's vocabulary: same size, and the same token
    strings at the same ids when both tokenizers are given.

    Stricter than `models.check_vocab_compatible`, which lets the sizes differ by padding: the
    distillation losses compare the two distributions over the full vocabulary, id by id.
    """
    target_name, draft_name = _name(target), draft_name or _name(draft)
    v_target = target.get_output_embeddings().weight.shape[0]
    v_draft = draft.get_output_embeddings().weight.shape[0]
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            by_id_t = {i: tok for tok, i in t_vocab.items()}
            by_id_d = {i: tok for tok, i in d_vocab.items()}
            ids = sorted(i for i in by_id_t.keys() | by_id_d.keys() if by_id_t.get(i) != by_id_d.get(i))
            example = ", ".join(f"id {i}: target {by_id_t.get(i)!r} vs draft {by_id_d.get(i)!r}" for i in ids[:3])
            raise DraftBuildError(
                f"draft {draft_name!r} has a different tokenizer from target {target_name!r}: "
                f"{len(t_vocab)} vs {len(d_vocab)} tokens, {len(ids)} ids map to other tokens ({example}); "
                f"{SPEC_HINT}"
            )
        if v_target != v_draft and len(t_vocab) > min(v_target, v_draft):  # as `models.check_vocab_compatible`
            raise DraftBuildError(
                f"tokenizer of target {target_name!r} has {len(t_vocab)} tokens but the models output "
                f"{v_target} (target) and {v_draft} (draft {draft_name!r}) logits"
            )
    if v_target != v_draft:
        raise DraftBuildError(
            f"draft {draft_name!r} outputs {v_draft} logits, target {target_name!r} outputs {v_target}: "
            f"the vocab_size must equal the target's ({v_target}); {SPEC_HINT}"
        )


def _count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def describe_draft(draft: PreTrainedModel, target: PreTrainedModel) -> dict:
    """Sizes of the draft next to the target's, and how the draft was built."""
    d_text, t_text = _text_config(draft.config), _text_config(target.config)
    build = getattr(draft.config, "draftsmith_build", None)
    params, target_params = _count(draft), _count(target)
    return {
        "method": (build or {}).get("method"),
        "parameters": params,
        "embedding_parameters": draft.get_input_embeddings().weight.numel(),
        "target_parameters": target_params,
        "share_of_target": params / target_params,
        "num_layers": d_text.num_hidden_layers,
        "target_num_layers": t_text.num_hidden_layers,
        "hidden_size": d_text.hidden_size,
        "target_hidden_size": t_text.hidden_size,
        "vocab_size": draft.get_output_embeddings().weight.shape[0],
        "built_from_this_target": None
        if build is None
        else build.get("target_fingerprint") == target_fingerprint(target),
        "build": build,
    }


# --------------------------------------------------------------------------- export


def export_draft(folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
    """The registry's exporter: a draft is served as the plain HF causal LM it is, so its one
    layout, "hf", is a copy of its files (safetensors weights, config, the target's tokenizer;
    not README.md). A folder holding pickle weights, or no tokenizer, is refused; `target` and
    `num_speculative_tokens` (the server's flag) are not used."""
    folder = Path(folder)
    if fmt != "hf":
        raise DraftBuildError(f"export format {fmt!r}: a draft model exports as hf (the model as it is)")
    if not folder.is_dir():
        raise DraftBuildError(f"draft {str(folder)!r} does not exist or is not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != "README.md")
    names = [p.name for p in files]
    pickles = [n for n in names if Path(n).suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise DraftBuildError(
            f"draft {str(folder)!r} holds pickle weights ({', '.join(pickles)}): only safetensors are exported "
            "(pickle files run code when loaded); re-save it with save_pretrained(..., safe_serialization=True)"
        )
    if not any(n.endswith(".safetensors") for n in names):
        raise DraftBuildError(f"draft {str(folder)!r} has no safetensors weights (save it with save_pretrained)")
    if not any(n in TOKENIZER_FILES for n in names):
        raise DraftBuildError(
            f"draft {str(folder)!r} has no tokenizer files: save the target's tokenizer beside it "
            "(AutoTokenizer.from_pretrained(target).save_pretrained(draft_dir))"
        )

    def write(tmp: Path) -> None:
        for file in files:
            shutil.copy2(file, tmp / file.name)

    return write_folder_atomic(out, write, overwrite=False, error=DraftBuildError)


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load a draft model folder (`publish.serve` writes the commands): vLLM's
    `draft_model` and SGLang's STANDALONE drafter read it as it is."""
    return {
        "layout": "a draft model (a plain causal LM)",
        "vllm": {"method": "draft_model"},
        "sglang": {"algorithm": "STANDALONE", "steps": k},
    }
