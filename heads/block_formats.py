"""Block heads on disk (`heads.blocks`): draftsmith's layout and the vLLM speculators one of each
method, told apart by config.json. A method names its layout in one `BlockLayout` (its head class,
speculators type and architecture, and what its config and weights add to the backbone's), and
`heads/<kind>_formats.py` takes its save / load / export from it.

    layout.save(head, "out/head")                 # config.json + weights, without the target's tensors
    layout.export(head, "out/head-vllm")          # for vllm serve TARGET --speculative-config ...
    layout.export_folder("out/head", "out/head-vllm", "vllm", num_speculative_tokens=7)  # from the folder
    head = layout.load("out/head-vllm", target=target)

What the speculators trainer writes for a block head (and vLLM reads):
- config.json: `architectures` (the layout's), `speculators_model_type`, `speculators_version`,
  `block_size`, `aux_hidden_state_layer_ids`, `mask_token_id` (both required by vLLM), `draft_vocab_size`,
  `target_hidden_size` (null = the draft's), `sliding_window_non_causal: false`, `sample_from_anchor`
  (false: the anchor is the previous bonus token, block_size - 1 drafts), `transformer_layer_config` (a
  qwen3 config with `num_hidden_layers` = the draft layers, the target's vocabulary, positions and RoPE),
  `speculators_config` (the greedy proposal of a block's drafts, the verifier) and the layout's own keys.
- weights: `fc.weight`, `hidden_norm.weight`, `layers.{i}.*` (Qwen3 names, q_norm / k_norm included),
  `norm.weight`; `lm_head.weight`, `d2t`, `t2d` only with a reduced vocabulary (the embeddings and a
  full-vocabulary lm_head come from the verifier); the layout's own tensors.
Layer ids: vLLM hands the runner `aux_hidden_state_layer_ids` as its capture ids, the residual stream
entering decoder layer i = HF `hidden_states[i]` (its block drafters read them shifted by one, vLLM PR
#40727), so draftsmith's HF ids are written as they are; an id equal to L (after the final norm) cannot
be captured by a server and is refused.

The heads are not registered with transformers' auto classes (`draftsmith.heads`): their embeddings and
a full-vocabulary lm_head are the target's and are not saved, so a head loads only with its target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.artifacts import has_model_type, read_config, read_weights, write_folder_atomic
from draftsmith.heads.blocks import BlockConfig, BlockHead
from draftsmith.heads.layers import PROVENANCE, target_weights
from draftsmith.heads.speculators import DECODER_LAYER_KEYS, draft_layer_fields, speculators_block, speculators_header

WEIGHTS = "model.safetensors"

SPECULATORS_VERSION = "0.9.0"
PROVENANCE_KEY = "draftsmith"
# The backbone layer's tensors: a Qwen3 decoder layer (its q/k norms).
LAYER_KEYS = (*DECODER_LAYER_KEYS, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
_PROVENANCE_FIELDS = (*PROVENANCE, "mask_token_source")  # the config's provenance, and its mask token's


@dataclass(frozen=True)
class BlockLayout:
    """What tells one block head on disk from another: its classes, its speculators type and
    architecture, and the config keys and tensors it adds to the backbone's (`heads.blocks`)."""

    head: type  # a BlockHead subclass
    speculators_type: str
    architecture: str
    title: str  # how messages name it
    extra_keys: Callable[[BlockConfig], set] = lambda config: set()  # tensors beyond the backbone's
    to_speculators: Callable[[BlockConfig], dict] = lambda config: {}  # speculators config keys it adds
    from_speculators: Callable[[dict], dict] = lambda raw: {}  # and back: config keys from them
    # A head whose tensors meet the target's in what the speculators layout stores (a product with the
    # target's embeddings): `reads_target(config)` says which, `as_speculators(head, tensors)` gives the
    # (config, tensors) to write.
    reads_target: Callable[[BlockConfig], bool] = lambda config: False
    as_speculators: Callable[[BlockHead, dict], tuple] = lambda head, state: (head.config, state)

    @property
    def config(self) -> type:
        return self.head.config_class

    @property
    def error(self) -> type:
        return self.head.error

    @property
    def kind(self) -> str:  # its registry kind: the family names each layout's speculators type after it
        return self.speculators_type

    # The formats for this layout: what heads/<kind>_formats.py names as its own
    # (save_<kind>, load_<kind>, export_<kind>) and gives the registry (export_folder, serving_facts).
    def save(self, head, out_dir, *, overwrite: bool = False) -> Path:
        return save_head(head, out_dir, overwrite=overwrite)

    def load(self, path, *, target, device=None, dtype: torch.dtype | None = None):
        return load_head(path, target=target, device=device, dtype=dtype, layout=self)

    def export(self, head, out_dir, *, overwrite: bool = False) -> Path:
        return export_head(head, out_dir, overwrite=overwrite, layout=self)

    def export_folder(self, folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
        return export_folder(
            folder, out, fmt, num_speculative_tokens=num_speculative_tokens, target=target, layout=self
        )

    def serving_facts(self, folder, config: dict, setting: dict, k: int) -> dict:
        return serving_facts(folder, config, setting, k, layout=self)


def save_head(head: BlockHead, out_dir, *, overwrite: bool = False) -> Path:
    """config.json + model.safetensors without the target's tensors (`frozen_keys`), written
    atomically; a folder holding a draftsmith head of the same kind is replaced (re-running a training)."""
    frozen = set(head.frozen_keys())
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k not in frozen}

    def write(tmp: Path) -> None:
        head.config.save_pretrained(tmp)
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})

    return write_folder_atomic(
        out_dir,
        write,
        overwrite=overwrite,
        error=head.error,
        may_replace=lambda folder: has_model_type(folder, head.config.model_type),
    )


def load_head(
    path, *, target: PreTrainedModel, layout: BlockLayout, device=None, dtype: torch.dtype | None = None
) -> BlockHead:
    """A head of `layout` saved by `save_head` (or exported in the speculators layout of `layout`), completed
    with `target`'s embeddings (and lm_head with the full vocabulary) and checked against it."""
    if target is None:
        raise layout.error(
            f"loading a {layout.title} needs the target: its embeddings (and full-vocabulary lm_head) are the target's"
        )
    path, config, state = _read_folder(path, layout)
    with torch.device("meta"):
        head = layout.head(config)
    head.check_target(target)
    lm_weight, embed_weight = target_weights(target, layout.error)
    frozen = {"embed_tokens.weight": embed_weight, "lm_head.weight": lm_weight}
    expected = set(head.state_dict()) - set(head.frozen_keys())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise layout.error(
            f"{str(path / WEIGHTS)!r} does not match its config: missing {missing[:6]}, unexpected {extra[:6]}"
        )
    state.update({k: frozen[k].detach().to("cpu") for k in head.frozen_keys()})
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise layout.error(f"cannot load {str(path / WEIGHTS)!r}: {err}") from None
    head.rotary_emb = LlamaRotaryEmbedding(config.layer_config())
    device = device if device is not None else lm_weight.device
    head = head.to(device=device, dtype=dtype if dtype is not None else state["fc.weight"].dtype)
    head._freeze()
    return head.eval()


def _read_folder(path, layout: BlockLayout) -> tuple[Path, BlockConfig, dict[str, torch.Tensor]]:
    """(folder, config, saved tensors) of a draftsmith or speculators folder of `layout`'s head:
    the head without the target's tensors."""
    path, raw = read_config(path, layout.title, layout.error)
    if raw.get("speculators_model_type") is not None:
        config = config_from_speculators(path, raw, layout)
    elif raw.get("model_type") == layout.config.model_type:
        try:
            config = layout.config.from_dict({k: v for k, v in raw.items() if k != "transformers_version"})
        except (TypeError, ValueError) as err:
            raise layout.error(f"{str(path / 'config.json')!r}: {err}") from None
    else:
        raise layout.error(
            f"{str(path / 'config.json')!r} is not a {layout.title}: expected model_type {layout.config.model_type!r} "
            f"(draftsmith) or speculators_model_type {layout.speculators_type!r} (vLLM speculators)"
        )
    return path, config, read_weights(path / WEIGHTS, f"{layout.title} weights", layout.error)


def required_keys(config: BlockConfig, layout: BlockLayout) -> set[str]:
    """The tensors a speculators checkpoint of a head must hold, no more: the tensors draftsmith
    saves too (the target's embeddings and full-vocabulary lm_head stay out of both)."""
    c = config
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    layer = list(LAYER_KEYS) + ([f"self_attn.{p}_proj.bias" for p in "qkvo"] if c.attention_bias else [])
    keys |= {f"layers.{i}.{k}" for i in range(c.num_hidden_layers) for k in layer}
    if c.reduced_vocab:
        keys |= {"lm_head.weight", "d2t", "t2d"}
    return keys | layout.extra_keys(c)


def _layer_config(c: BlockConfig) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": dict(c.rope_parameters),
        "rope_theta": c.rope_parameters.get("rope_theta"),
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.num_hidden_layers,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "initializer_range": c.initializer_range,
    }


def speculators_config(c: BlockConfig, layout: BlockLayout) -> dict:
    """config.json of the speculators layout of `layout` (module docstring; `sample_from_anchor`
    and the drafts per block are the head's)."""
    return {
        **speculators_header(layout.architecture, layout.speculators_type, SPECULATORS_VERSION),
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "mask_token_id": c.mask_token_id,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": None,  # the draft is as wide as the target
        "sliding_window_non_causal": False,
        "sample_from_anchor": c.sample_from_anchor,
        "tie_word_embeddings": False,
        "transformer_layer_config": _layer_config(c),
        **layout.to_speculators(c),
        "speculators_config": speculators_block(layout.speculators_type, {"speculative_tokens": c.drafts_per_block}, c),
        PROVENANCE_KEY: {field: getattr(c, field) for field in _PROVENANCE_FIELDS},
    }


def export_head(head: BlockHead, out_dir, *, layout: BlockLayout, overwrite: bool = False) -> Path:
    """Write `head` in the speculators layout of `layout`; the weights are checked against the key
    set vLLM loads before anything is written."""
    frozen = set(head.frozen_keys())
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k not in frozen}
    config, state = layout.as_speculators(head, state)
    return _write_speculators(config, state, out_dir, overwrite=overwrite, layout=layout)


def _write_speculators(c: BlockConfig, state: dict, out_dir, *, layout: BlockLayout, overwrite: bool = False) -> Path:
    if c.target_num_layers is not None and max(c.aux_layer_ids) >= c.target_num_layers:
        raise layout.error(
            f"vllm export: aux layer ids {c.aux_layer_ids} include {c.target_num_layers} (after the final norm), "
            "which a server cannot capture: train with aux_layers below the target's layer count"
        )
    required = required_keys(c, layout)
    missing, extra = sorted(required - set(state)), sorted(set(state) - required)
    if missing or extra:
        raise layout.error(f"vllm export: missing {missing}, left over {extra}; nothing was written")
    config = speculators_config(c, layout)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return write_folder_atomic(out_dir, write, overwrite=overwrite, error=layout.error)


def export_folder(folder, out, fmt: str, *, num_speculative_tokens: int, layout: BlockLayout, target=None) -> Path:
    """The registry's exporter: the head of `folder` (either layout) written to `out` as `fmt`
    ("vllm": the layout's speculators one; "hf": the draftsmith layout, saved as it is).

    Both layouts hold the same tensors (never the target's), so the head is converted without
    its target; `target`, a zero-argument loader, is called to check that the head fits it, and is
    required where the layout `reads_target` (vllm stores a product with the target's embeddings).
    The drafts per call are the block's (block_size - 1): `num_speculative_tokens` is not written."""
    path, config, state = _read_folder(folder, layout)
    if fmt == "vllm" and layout.reads_target(config):
        if target is None:
            raise layout.error(
                f"{str(path)!r}: this {layout.title} reads the target's embeddings, and the vllm layout stores their "
                "product with its weights: give the target (--target), or export with format 'hf'"
            )
        return export_head(load_head(path, target=target(), layout=layout), out, layout=layout)
    if target is not None:
        load_head(path, target=target(), layout=layout)  # sizes, depth, positions and RoPE against the target
    if fmt == "vllm":
        return _write_speculators(config, state, out, layout=layout)
    if fmt != "hf":
        raise layout.error(f"export format {fmt!r}: a {layout.title} exports as vllm or hf")
    required = required_keys(config, layout)
    if set(state) != required:
        raise layout.error(
            f"{str(path / WEIGHTS)!r} does not match its config: missing {sorted(required - set(state))[:6]}, "
            f"unexpected {sorted(set(state) - required)[:6]}"
        )

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})

    return write_folder_atomic(out, write, overwrite=False, error=layout.error)


def config_from_speculators(path: Path, raw: dict, layout: BlockLayout):
    """The config of a speculators folder of `layout`'s type (this exporter's, or the speculators
    trainer's with full attention and the head's own slot convention)."""
    where, error = str(Path(path) / "config.json"), layout.error
    if raw.get("speculators_model_type") != layout.speculators_type:
        raise error(
            f"{where}: speculators_model_type={raw.get('speculators_model_type')!r}; "
            f"a {layout.title} reads {layout.speculators_type!r}"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise error(f"{where} has no transformer_layer_config")
    anchor = layout.config.sample_from_anchor
    for key, ok in (("sample_from_anchor", anchor), ("projector_type", layout.speculators_type)):
        if raw.get(key, ok) != ok:
            raise error(f"{where}: {key}={raw[key]!r} is a variant draftsmith does not implement")
    if any(t != "full_attention" for t in layer.get("layer_types") or []):
        raise error(f"{where}: sliding-window draft layers are not implemented (layer_types {layer['layer_types']})")
    if raw.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise error(f"{where}: target_hidden_size={raw['target_hidden_size']} differs from the draft's hidden size")
    provenance = dict(raw.get(PROVENANCE_KEY) or {})
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    try:
        return layout.config(
            **layout.from_speculators(raw),
            **draft_layer_fields(layer),
            draft_vocab_size=raw.get("draft_vocab_size"),
            block_size=raw.get("block_size", 8),
            mask_token_id=raw["mask_token_id"],
            aux_layer_ids=raw["aux_hidden_state_layer_ids"],
            target_name_or_path=provenance.get("target_name_or_path") or verifier.get("name_or_path"),
            target_architectures=provenance.get("target_architectures") or verifier.get("architectures") or None,
            **{
                k: provenance.get(k)
                for k in _PROVENANCE_FIELDS
                if k not in ("target_name_or_path", "target_architectures")
            },
        )
    except KeyError as err:
        raise error(f"{where} lacks {err.args[0]!r}") from None


def serving_facts(folder, config: dict, setting: dict, k: int, layout: BlockLayout) -> dict:
    """How servers load a block head (`publish.serve` writes the commands): vLLM serves
    the speculators layout of `layout` (one block of drafts per call); SGLang's drafters read
    another layout, not written here."""
    exported = "speculators_model_type" in config
    return {
        "layout": f"a {layout.title} in the {'speculators' if exported else 'draftsmith'} layout",
        "vllm": {"method": layout.speculators_type, "export": not exported},
        "notes": [
            f"SGLang: no {layout.title} layout is written here (draftsmith exports the speculators layout vLLM loads)",
            "the head reads the target's hidden states at fixed layers: serve it with exactly this target",
        ],
    }
