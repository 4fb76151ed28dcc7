"""EAGLE heads on disk: the draftsmith layout (`save_eagle`), the vLLM speculators and SGLang
layouts (`export_eagle`; `export_folder` from a folder, the registry's exporter of every head of
this package), and `load_eagle` for any of the three (told apart by config.json). The
layouts and the index conventions are described in `draftsmith.heads.eagle.model`; a head built
on EAGLE-3's whose speculators layout adds a few keys to it registers them (`SpeculatorsExtension`).
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.artifacts import has_model_type, load_pretrained, read_config, read_weights, write_folder_atomic
from draftsmith.heads.eagle.model import VARIANT_FLAGS, EagleConfig, EagleError, EagleHead
from draftsmith.heads.layers import PROVENANCE
from draftsmith.heads.speculators import DECODER_LAYER_KEYS, draft_layer_fields, speculators_block, speculators_header

EXPORT_FORMATS = ("vllm", "sglang", "hf")
WEIGHTS = "model.safetensors"
# What the speculators trainer writes (read off a 0.9.0 checkpoint; `Eagle3DraftModel` is the
# class name in current speculators, older releases wrote "Eagle3Speculator"). vLLM ignores the
# top-level `architectures` of a speculators config: it picks Eagle3LlamaForCausalLM from
# `speculators_model_type` and `transformer_layer_config.model_type`.
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
SPECULATORS_TYPE = "eagle3"  # speculators_model_type
SPECULATORS_VERSION = "0.9.0"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Provenance travels as one nested dict in the exported configs (vLLM builds its draft config from
# `transformer_layer_config` only; SGLang keeps unknown keys as unused attributes).
PROVENANCE_KEY = "draftsmith"
_PROVENANCE_FIELDS = (*PROVENANCE, "aux_layer_ids")  # the config's provenance, and the layers it reads

# ---------------------------------------------------------------------- required key sets
# The EAGLE-3 decoder layer's tensors, relative to the layer (no biases: attention_bias adds the
# four `self_attn.*_proj.bias`, see `_required_keys`).
LAYER_KEYS = ("hidden_norm.weight", *DECODER_LAYER_KEYS)
# vLLM speculators format (vllm/model_executor/models/llama_eagle3.py: LlamaModel holds
# embed_tokens, layers, fc, norm; Eagle3LlamaForCausalLM holds lm_head and draft_id_to_target_id,
# loaded from `d2t`; `t2d` is read and dropped).
VLLM_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight") + tuple(
    f"layers.0.{k}" for k in LAYER_KEYS
)
# SGLang (python/sglang/srt/models/llama_eagle3.py: LlamaModel holds embed_tokens, fc, midlayer,
# norm; unknown names are skipped SILENTLY by its load_weights, hence the exact check).
SGLANG_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight") + tuple(
    f"midlayer.{k}" for k in LAYER_KEYS
)
VOCAB_MAP_KEYS = ("d2t", "t2d")  # only with a reduced draft vocabulary, in both formats
QK_NORM_KEYS = ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight")  # with qk_norm only
# speculators' EAGLE-3 draft layers by `transformer_layer_config.model_type` (its eagle3
# model_definitions.model_classes: nothing else builds), and whether the layer has per-head q/k
# norms (Qwen3DecoderLayer's attention has them, Llama's not): how the layout spells `qk_norm`.
LAYER_TYPES = {"llama": False, "qwen3": True}


@dataclass(frozen=True)
class SpeculatorsExtension:
    """A head built on EAGLE-3's whose speculators layout is EAGLE-3's plus a few keys. Its own
    module registers it (`register_extension`); the package imports that module, so every function
    here knows it."""

    head: type  # the EagleHead subclass; its config_class is the config's
    model_type: str  # its speculators_model_type
    architecture: str  # the speculators class that reads it
    title: str  # how messages name it
    weight_keys: tuple[str, ...]  # its weights beyond EAGLE-3's
    fields: tuple[str, ...]  # its config fields beyond EAGLE-3's (kept in the provenance block)
    write_keys: Callable[[EagleConfig], dict]  # its top-level keys of the speculators config.json
    read_fields: Callable[[Path, dict], dict]  # (folder, config.json) -> its config's own fields (EagleError)


EXTENSIONS: dict[str, SpeculatorsExtension] = {}  # by speculators_model_type


def register_extension(extension: SpeculatorsExtension) -> None:
    EXTENSIONS[extension.model_type] = extension


def _extension_of(config: EagleConfig) -> SpeculatorsExtension | None:
    return next((e for e in EXTENSIONS.values() if isinstance(config, e.head.config_class)), None)


def _draftsmith_heads() -> dict[str, type]:
    """{draftsmith model_type: head class} of every head this file loads."""
    return {EagleConfig.model_type: EagleHead} | {e.head.config_class.model_type: e.head for e in EXTENSIONS.values()}


# ---------------------------------------------------------------------- export layouts
def _required_keys(config: EagleConfig, fmt: str) -> set[str]:
    base = VLLM_KEYS if fmt == "vllm" else SGLANG_KEYS
    keys = set(base)
    if config.norm_before_fc:  # speculators' names (sglang refuses these variants earlier)
        keys.add("input_norm.weight")
    if config.fc_norm:
        keys |= {f"fc_norm.{i}.weight" for i in range(config.num_aux)}
    if config.qk_norm:
        keys |= set(QK_NORM_KEYS)
    if config.attention_bias:  # vLLM builds q/k/v/o with bias=attention_bias (SGLang refuses it earlier)
        prefix = "layers.0." if fmt == "vllm" else "midlayer."
        keys |= {f"{prefix}self_attn.{p}_proj.bias" for p in "qkvo"}
    if config.draft_vocab_size != config.vocab_size:
        keys |= set(VOCAB_MAP_KEYS)
    extension = _extension_of(config)
    if extension is not None:
        keys |= set(extension.weight_keys)
    return keys


def _export_state(head: EagleHead, fmt: str) -> dict[str, torch.Tensor]:
    """The head's state_dict renamed for `fmt` (d2t/t2d dropped for a full vocabulary)."""
    full_vocab = head.config.draft_vocab_size == head.config.vocab_size
    state = {}
    for key, tensor in head.state_dict().items():
        if key in VOCAB_MAP_KEYS and full_vocab:
            continue
        if fmt == "sglang" and key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        state[key] = tensor.detach().to("cpu").contiguous()
    return state


def _check_keys(state: dict, required: set[str], fmt: str) -> None:
    missing, extra = sorted(required - set(state)), sorted(set(state) - required)
    if missing or extra:
        raise EagleError(
            f"{fmt} export: the weights do not match the key set the server loads: missing {missing}, left over {extra}. "
            "Nothing was written (a server would skip or misplace these tensors silently)."
        )


def _provenance(config: EagleConfig) -> dict:
    extension = _extension_of(config)
    fields = _PROVENANCE_FIELDS + (extension.fields if extension is not None else ())
    return {field: getattr(config, field) for field in fields}


def _dtype_name(head: EagleHead) -> str:
    return str(head.dtype).removeprefix("torch.")


def _layer_config_dict(config: EagleConfig) -> dict:
    d = config.layer_config().to_dict()
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id", "dtype"):
        d.pop(key, None)
    if config.qk_norm:
        # speculators builds q/k norms from the layer's type, not from a flag: a qk_norm head is a
        # one-layer qwen3 config of full attention (the llama-only keys dropped).
        for key in ("mlp_bias", "pretraining_tp"):
            d.pop(key, None)
        d.update(
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=1,
            layer_types=["full_attention"],
        )
    else:
        d["architectures"] = ["LlamaForCausalLM"]
    # Servers on transformers 4.x read rope_theta / rope_scaling; 5.x reads rope_parameters.
    d["rope_theta"] = config.rope_parameters.get("rope_theta")
    if config.rope_parameters.get("rope_type", "default") != "default":
        d["rope_scaling"] = copy.deepcopy(config.rope_parameters)
    return d


def _vllm_config(head: EagleHead, num_speculative_tokens: int) -> dict:
    c = head.config
    proposal = {"speculative_tokens": num_speculative_tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    extension = _extension_of(c)
    kind, architecture = (
        (extension.model_type, extension.architecture)
        if extension is not None
        else (SPECULATORS_TYPE, SPECULATORS_ARCHITECTURE)
    )
    return {
        **speculators_header(architecture, kind, SPECULATORS_VERSION),
        **(extension.write_keys(c) if extension is not None else {}),
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),  # HF indices = vLLM's capture indices
        # Written explicitly: vLLM defaults a missing norm_before_residual to True, speculators to False.
        **{flag: bool(getattr(c, flag)) for flag in VARIANT_FLAGS},
        "target_hidden_size": c.target_hidden_size,  # null = the draft's hidden size (same as the target's)
        "tie_word_embeddings": False,
        "transformer_layer_config": _layer_config_dict(c),
        "speculators_config": speculators_block(kind, proposal, c),
        "torch_dtype": _dtype_name(head),
        PROVENANCE_KEY: _provenance(c),
    }


def _sglang_config(head: EagleHead, num_speculative_tokens: int) -> dict:
    c = head.config
    d = _layer_config_dict(c)
    d.update(
        {
            "architectures": [SGLANG_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "draft_vocab_size": c.draft_vocab_size,
            "tie_word_embeddings": False,
            # SGLang captures layers_to_capture = [id + 1 for id in these]: write HF index - 1.
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids],
                "use_aux_hidden_state": True,
            },
            "num_speculative_tokens": num_speculative_tokens,  # informational: SGLang takes --speculative-num-steps
            "torch_dtype": _dtype_name(head),
            PROVENANCE_KEY: _provenance(c),
        }
    )
    return d


def _check_exportable(head: EagleHead, fmt: str, num_speculative_tokens: int) -> None:
    c = head.config
    if c.version != "eagle3":
        raise EagleError(
            f"export to {fmt!r}: only EAGLE-3 heads have a {fmt} layout here (vLLM's EAGLE-1 layout is not implemented); "
            "save EAGLE-1 heads with format 'hf' (save_eagle)"
        )
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise EagleError(f"num_speculative_tokens={num_speculative_tokens!r}: expected an int >= 1")
    extension = _extension_of(c)
    if fmt == "sglang" and extension is not None:
        raise EagleError(
            f"export to 'sglang': SGLang has no {extension.title} layout here; export this head with --format vllm"
        )
    L = c.target_num_layers
    if c.num_aux != 3:
        raise EagleError(
            f"export to {fmt!r}: the server's fc reads exactly 3 aux hidden states, this head reads {c.aux_layer_ids}"
        )
    if L is not None and max(c.aux_layer_ids) >= L:
        raise EagleError(
            f"export to {fmt!r}: aux layer id {max(c.aux_layer_ids)} is the target's post-norm output; servers capture "
            f"only layer inputs (ids 0..{L - 1})"
        )
    unsupported = [
        flag
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "qk_norm")
        if getattr(c, flag)
    ]
    if fmt == "sglang" and (c.attention_bias or unsupported or c.target_hidden_size not in (None, c.hidden_size)):
        raise EagleError(
            f"export to 'sglang': SGLang's Eagle3 layer has no attention bias, no {'/'.join(unsupported) or 'norm'} "
            "variant and no draft narrower than its target; export this head with --format vllm"
        )


# ---------------------------------------------------------------------- writing
def _write_atomic(out_dir, write, *, overwrite: bool, may_replace=None) -> Path:
    return write_folder_atomic(out_dir, write, overwrite=overwrite, may_replace=may_replace, error=EagleError)


def _is_draftsmith_eagle(folder: Path) -> bool:
    return any(has_model_type(folder, model_type) for model_type in _draftsmith_heads())


def save_eagle(head: EagleHead, out_dir, *, overwrite: bool = False) -> Path:
    """Draftsmith layout (`save_pretrained`, safetensors), written atomically. An existing folder is
    replaced when it holds a draftsmith EAGLE head (re-running a training), anything else only with
    `overwrite`."""
    return _write_atomic(
        out_dir,
        lambda tmp: head.save_pretrained(tmp, safe_serialization=True),
        overwrite=overwrite,
        may_replace=_is_draftsmith_eagle,
    )


def export_eagle(
    head: EagleHead, out_dir, format: str, *, num_speculative_tokens: int = 3, overwrite: bool = False
) -> Path:
    """Write `head` for a server: "vllm" (speculators format), "sglang", or "hf" (= save_eagle).

    The produced weights are compared with the format's required key set before anything is
    written; `num_speculative_tokens` is the draft length the vLLM config proposes."""
    if format not in EXPORT_FORMATS:
        raise EagleError(f"export format {format!r}: expected one of {', '.join(map(repr, EXPORT_FORMATS))}")
    if format == "hf":
        return save_eagle(head, out_dir, overwrite=overwrite)
    _check_exportable(head, format, num_speculative_tokens)
    state = _export_state(head, format)
    _check_keys(state, _required_keys(head.config, format), format)
    config = (_vllm_config if format == "vllm" else _sglang_config)(head, num_speculative_tokens)
    layer = config["transformer_layer_config"] if format == "vllm" else config
    for key, expected in (
        ("max_position_embeddings", head.config.max_position_embeddings),
        ("rope_parameters", head.config.rope_parameters),
        ("vocab_size", head.config.vocab_size),
    ):
        if layer.get(key) != expected:  # guards against a future edit of the config writers
            raise EagleError(f"{format} export: config {key}={layer.get(key)!r}, expected the target's {expected!r}")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return _write_atomic(out_dir, write, overwrite=overwrite)


def export_folder(folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
    """The registry's exporter for the heads of this package: the head of `folder` (any of the three
    layouts) written to `out` as `fmt` ("vllm", "sglang", or "hf" = the draftsmith layout, saved as
    it is), proposing `num_speculative_tokens`. The head holds everything it writes: `target` (a
    zero-argument loader, the registry's one signature) is never called."""
    return export_eagle(load_eagle(folder), out, fmt, num_speculative_tokens=num_speculative_tokens)


# ---------------------------------------------------------------------- loading
def load_eagle(
    path,
    *,
    target: PreTrainedModel | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    expected_data_hash: str | None = None,
) -> EagleHead:
    """A head from a draftsmith, vLLM speculators or SGLang folder (detected from config.json).

    With `target`: `check_target`. With `expected_data_hash`: the draft vocabulary must have been
    counted on that data (a stale vocabulary map trains and serves a head at alpha ~ 0)."""
    path, raw = read_config(path, "EAGLE head", EagleError)
    heads = _draftsmith_heads()
    if raw.get("model_type") in heads:
        head = load_pretrained(heads[raw["model_type"]], path, "an EAGLE head", EagleError, dtype)
        head._freeze()
    elif raw.get("speculators_model_type") is not None:
        head = _load_vllm(path, raw)
    elif SGLANG_ARCHITECTURE in (raw.get("architectures") or []):
        head = _load_sglang(path, raw)
    else:
        raise EagleError(
            f"{str(path / 'config.json')!r} is not an EAGLE head config: expected model_type {EagleConfig.model_type!r} "
            f"(draftsmith), a speculators_model_type (vLLM) or architectures [{SGLANG_ARCHITECTURE!r}] (SGLang)"
        )
    if dtype is not None or device is not None:
        head = head.to(device=device, dtype=dtype)
    c = head.config
    if (
        expected_data_hash is not None
        and c.draft_vocab_size != c.vocab_size
        and c.vocab_map_data_hash != expected_data_hash
    ):
        recorded = c.vocab_map_data_hash[:12] if c.vocab_map_data_hash else "an unrecorded hash"
        raise EagleError(
            f"EAGLE head {str(path)!r} has a draft vocabulary counted on data {recorded}, but the data is "
            f"{expected_data_hash[:12]}: rebuild the vocabulary map (`draftsmith vocab-map`) and retrain the head"
        )
    if target is not None:
        head.check_target(target)
    return head.eval()


def _load_vllm(path: Path, raw: dict) -> EagleHead:
    kinds = (SPECULATORS_TYPE, *EXTENSIONS)
    if raw.get("speculators_model_type") not in kinds:
        raise EagleError(
            f"{str(path)!r}: speculators_model_type={raw.get('speculators_model_type')!r}; "
            f"expected {' or '.join(map(repr, kinds))} "
            "(another method's folder loads as its own kind, --drafter KIND=DIR)"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise EagleError(f"{str(path)!r}: config.json has no transformer_layer_config")
    # The variant flags as speculators writes them (absent = off); vLLM reads a missing
    # norm_before_residual as True (speculators' own default is False), so that one follows vLLM.
    variant = {flag: raw.get(flag, False) for flag in VARIANT_FLAGS}
    variant["norm_before_residual"] = raw.get("norm_before_residual", True)
    for flag, value in variant.items():
        if not isinstance(value, bool):
            raise EagleError(f"{str(path / 'config.json')!r}: {flag}={value!r}; expected true or false")
    variant["target_hidden_size"] = raw.get("target_hidden_size")
    variant["qk_norm"] = _layer_qk_norm(path, layer)
    extension = EXTENSIONS.get(raw["speculators_model_type"])
    if extension is not None:
        variant.update(extension.read_fields(path, raw))
    state = read_weights(path / WEIGHTS, "EAGLE weights", EagleError)
    return _from_state(
        path,
        raw,
        layer,
        state,
        raw.get("eagle_aux_hidden_state_layer_ids"),
        variant,
        raw.get("draft_vocab_size"),
        extension,
    )


def _layer_qk_norm(path: Path, layer: dict) -> bool:
    """Whether the speculators `transformer_layer_config` builds per-head q/k norms: a `qwen3` layer
    does, a `llama` one does not; speculators parses a layer without model_type as qwen3. Any other
    type, or a llama MLP with biases (draftsmith's has none), is refused rather than misread."""
    where = str(path / "config.json")
    model_type = layer.get("model_type", "qwen3")
    if model_type not in LAYER_TYPES:
        raise EagleError(
            f"{where!r}: transformer_layer_config.model_type={model_type!r}; speculators' EAGLE-3 layer is "
            f"{' or '.join(map(repr, LAYER_TYPES))} (qwen3: per-head q/k norms), and so is draftsmith's"
        )
    if layer.get("mlp_bias"):
        raise EagleError(
            f"{where!r}: transformer_layer_config.mlp_bias={layer['mlp_bias']!r}; draftsmith's EAGLE-3 MLP has no biases"
        )
    return LAYER_TYPES[model_type]


def _load_sglang(path: Path, raw: dict) -> EagleHead:
    if raw.get("num_hidden_layers", 1) != 1:
        raise EagleError(
            f"{str(path)!r}: num_hidden_layers={raw['num_hidden_layers']}; only 1-layer EAGLE-3 heads are supported"
        )
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [i + 1 for i in ids] if ids is not None else None  # SGLang's "output of layer i" -> HF index i + 1
    state = {}
    for key, tensor in read_weights(path / WEIGHTS, "EAGLE weights", EagleError).items():
        key = key.removeprefix("model.")
        state["layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key] = tensor
    # SGLang's LlamaForCausalLMEagle3 has no q/k norms (a head with them is refused at export).
    variant = {"target_hidden_size": raw.get("target_hidden_size"), "qk_norm": False}
    return _from_state(path, raw, raw, state, ids, variant, raw.get("draft_vocab_size"))


def _from_state(path, raw, layer: dict, state, aux_ids, variant: dict, draft_vocab, extension=None) -> EagleHead:
    provenance = dict(raw.get(PROVENANCE_KEY) or {})
    fc = state.get("fc.weight")
    if fc is None or "embed_tokens.weight" not in state:
        raise EagleError(
            f"{str(path / WEIGHTS)!r} has no fc.weight / embed_tokens.weight (embeddings are required to draft)"
        )
    if layer.get("num_hidden_layers", 1) != 1:
        raise EagleError(
            f"{str(path)!r}: the draft has {layer['num_hidden_layers']} decoder layers; draftsmith's EAGLE-3 head has one"
        )
    if "sliding_attention" in (layer.get("layer_types") or []) and layer.get("sliding_window"):
        # speculators' trainer default: the draft attends to the last `sliding_window` tokens only.
        warnings.warn(
            f"{str(path)!r}: the draft layer was trained with sliding-window attention over {layer['sliding_window']} "
            "tokens; draftsmith's head attends to the whole context (the same up to that length; decoding stays lossless)",
            stacklevel=3,
        )
    missing = [key for key in extension.weight_keys if key not in state] if extension is not None else []
    if missing:
        raise EagleError(
            f"{str(path / WEIGHTS)!r} has no {', '.join(missing)}: a {extension.model_type} checkpoint holds it"
        )
    head_class = extension.head if extension is not None else EagleHead
    H = layer.get("hidden_size", fc.shape[0])
    if aux_ids is None:
        aux_ids = provenance.get("aux_layer_ids")
    if aux_ids is None:
        raise EagleError(
            f"{str(path)!r}: config.json does not say which target layers the head reads (eagle_aux_hidden_state_layer_ids)"
        )
    V = state["embed_tokens.weight"].shape[0]
    if layer.get("vocab_size") not in (None, V):
        raise EagleError(f"{str(path)!r}: vocab_size={layer['vocab_size']} but embed_tokens.weight has {V} rows")
    try:
        config = head_class.config_class(
            version="eagle3",
            hidden_size=H,
            **draft_layer_fields(layer, sizes=False),
            vocab_size=V,
            draft_vocab_size=draft_vocab or state["lm_head.weight"].shape[0],
            aux_layer_ids=list(aux_ids),
            **variant,
            **{k: provenance.get(k) for k in _PROVENANCE_FIELDS if k != "aux_layer_ids"},
        )
    except KeyError as err:
        raise EagleError(f"{str(path / 'config.json')!r} lacks {err.args[0]!r}") from None
    except EagleError as err:
        raise EagleError(f"{str(path / 'config.json')!r}: {err}") from None
    if config.target_name_or_path is None:
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        config.target_name_or_path = verifier.get("name_or_path")
        config.target_architectures = verifier.get("architectures") or None
    if config.draft_vocab_size == config.vocab_size:  # full vocabulary: the maps may be omitted
        state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    fc_in = config.num_aux * config.aux_hidden_size
    if tuple(fc.shape) != (config.hidden_size, fc_in):
        # vLLM reads target_hidden_size (fc over n x that width), speculators' own Eagle3DraftModel
        # ignores it (fc over n x hidden_size): a file only one of them can load is refused here.
        raise EagleError(
            f"{str(path / WEIGHTS)!r}: fc.weight is {list(fc.shape)}, but config.json (target_hidden_size="
            f"{config.target_hidden_size!r}, {config.num_aux} aux layers) asks for [{config.hidden_size}, {fc_in}]"
        )
    with torch.device("meta"):  # no random init of tensors that are overwritten at once
        head = head_class(config)
    expected = set(head.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        hint = ""
        if any(k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for k in missing + extra):
            hint = (
                f"; q/k norms come with a qwen3 transformer_layer_config and only with it (this one is "
                f"{layer.get('model_type', 'untyped')!r}, qk_norm={config.qk_norm})"
            )
        raise EagleError(
            f"{str(path / WEIGHTS)!r} does not match its config: missing {missing[:6]}, unexpected {extra[:6]}{hint}"
        )
    try:
        head.load_state_dict({k: state[k] for k in expected}, strict=True, assign=True)
    except RuntimeError as err:  # shape mismatches
        raise EagleError(f"cannot load {str(path / WEIGHTS)!r}: {err}") from None
    head.rotary_emb = LlamaRotaryEmbedding(config.layer_config()).to(
        state["fc.weight"].device
    )  # real buffers, not meta
    head._freeze()
    return head


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load an EAGLE head (`publish.serve` writes the commands): vLLM the speculators
    layout (method "eagle3"), SGLang its own layout (EAGLE3: a chain, or the tree `tune --write`
    recorded); the other layout is exported first. An EAGLE-1 head has no server layout here."""
    import shlex

    version = config.get("version") or config.get("speculators_model_type") or "eagle3"
    if version != "eagle3":
        return {
            "layout": f"an {version.upper()} head in the draftsmith layout",
            "notes": [
                "vLLM and SGLang load EAGLE-3 heads from draftsmith's exports; an EAGLE-1 head has no server layout "
                f"here: decode with it through draftsmith (draftsmith eval --drafter eagle={shlex.quote(str(folder))})"
            ],
        }
    depth, topk, total = setting.get("depth"), setting.get("top_k"), setting.get("total_tokens")
    tree = {"topk": topk, "draft_tokens": total + 1} if depth and topk and total else {}  # SGLang counts the root
    speculators = "speculators_model_type" in config
    sglang = not speculators and SGLANG_ARCHITECTURE in (config.get("architectures") or [])
    if speculators:
        layout = "an EAGLE-3 head in the speculators layout (vLLM)"
    elif sglang:
        layout = "an EAGLE-3 head in SGLang's layout"
    else:
        layout = "an EAGLE-3 head in the draftsmith layout"
    notes = [f"vLLM drafts a chain of K = {k}; SGLang the tuned tree (depth {depth}, top-k {topk})"] if tree else []
    notes.append("the head reads the target's hidden states at fixed layers: serve it with exactly this target")
    return {
        "layout": layout,
        "vllm": {"method": "eagle3", "export": not speculators},
        "sglang": {"algorithm": "EAGLE3", "steps": depth or k, "options": tree, "export": not sglang},
        "notes": notes,
    }
