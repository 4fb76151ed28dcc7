"""Domino heads on disk: draftsmith's layout (`model_type: draftsmith_domino`, the block heads'
formats, `heads.block_formats`, with Domino's `BlockLayout`) and SpecForge's (`DominoDraftModel`, what
SpecForge's `export/to_hf.py` writes); `load_domino` reads both, told apart by config.json.

    save_domino(head, "out/domino")                       # config.json + weights, without the target's tensors
    export_specforge(head, "out/domino-specforge")        # SpecForge's layout
    export_folder("out/domino", "out/domino-specforge", "specforge", num_speculative_tokens=7)
    head = load_domino("out/domino-specforge", target=target)

SpecForge's layout, as read from its source (sgl-project/SpecForge `specforge/modeling/draft/domino.py`
and its base class's module, `configs/qwen3-8b-domino.json`, commit a6b6b023); no speculators class exists:
- config.json: a qwen3 config of the draft layers (`hidden_size`, `num_hidden_layers` = draft layers,
  `layer_types`, RoPE, the target's `vocab_size`), `architectures: ["DominoDraftModel"]`, `block_size`,
  `num_target_layers`, and `dflash_config`: `mask_token_id`, `target_layer_ids`, `projector_type:
  "domino"`, `emb_dim` (draftsmith's proj_dim), `gru_hidden_dim` (gru_hidden), `shift_label`,
  `pure_draft_prefix_len`;
- layer ids: SpecForge reads `hidden_states[layer_id + 1]` (the output of decoder layer `layer_id`),
  draftsmith the HF id itself: target_layer_ids = aux_layer_ids - 1 (the embeddings, id 0, and the
  final norm's output, id L, are refused on export, as a server captures neither);
- slots: `shift_label: false` with `pure_draft_prefix_len: 0` is the backbone's convention (slot 0 is
  the anchor, the GRU reads the anchor first, slot 1 on are corrected), the one draftsmith builds.
  SpecForge's shipped Qwen3 configs set `shift_label: true, pure_draft_prefix_len: 1` (slot 0
  drafts the token after the anchor, uncorrected); such a folder is refused naming the key;
- weights: the block backbone's (`fc`, `hidden_norm`, `layers.{i}.*` with Qwen3's q/k norms,
  `norm`) and `prefix_gru.weight_ih_l0`, `prefix_gru.weight_hh_l0`, `embed_proj.0.weight`,
  `embed_proj.2.weight` (early checkpoints nest the last two under `logit_head.`); no embeddings
  and no lm_head: both are the target's, so the correction covers the whole vocabulary and a head
  with a reduced draft vocabulary has no SpecForge layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.artifacts import read_config, read_weights, write_folder_atomic
from draftsmith.heads.block_formats import PROVENANCE_KEY, WEIGHTS, BlockLayout, load_head, required_keys
from draftsmith.heads.domino import DominoConfig, DominoError, DominoHead
from draftsmith.heads.layers import PROVENANCE, target_weights
from draftsmith.heads.speculators import draft_layer_fields

SPECFORGE_ARCHITECTURE = "DominoDraftModel"
CORRECTION_KEYS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")
EXPORT_FORMATS = ("hf", "specforge")
_OLD_PREFIX = "logit_head."  # SpecForge's early checkpoints: logit_head.prefix_gru.*, logit_head.embed_proj.*
_PROVENANCE_FIELDS = (*PROVENANCE, "mask_token_source")

# The family's layout of a Domino head. Its speculators type is never read or written: Domino has no
# speculators class, and `load_domino` refuses a speculators folder before `load_head` sees one.
DOMINO = BlockLayout(
    DominoHead, "domino", SPECFORGE_ARCHITECTURE, "Domino head", extra_keys=lambda config: set(CORRECTION_KEYS)
)


save_domino = DOMINO.save  # the block heads' (`heads.block_formats`)


def is_specforge(raw: dict) -> bool:
    """Whether a config.json is SpecForge's Domino layout (its class, or its base block class told
    `projector_type: domino` as SpecForge's SGLang normaliser writes it)."""
    flash = raw.get("dflash_config")
    return isinstance(flash, dict) and (
        SPECFORGE_ARCHITECTURE in (raw.get("architectures") or []) or flash.get("projector_type") == "domino"
    )


def load_domino(path, *, target, device=None, dtype: torch.dtype | None = None) -> DominoHead:
    """A Domino head of either layout, completed with `target`'s embeddings (and full-vocabulary
    lm_head) and checked against it."""
    if target is None:
        raise DominoError(
            "loading a Domino head needs the target: its embeddings (and full-vocabulary lm_head) are the target's"
        )
    folder, raw = read_config(path, DOMINO.title, DominoError)
    if not is_specforge(raw):
        _check_draftsmith(folder, raw)
        return load_head(folder, target=target, device=device, dtype=dtype, layout=DOMINO)
    folder, config, state = read_folder(folder)
    with torch.device("meta"):
        head = DominoHead(config)
    head.check_target(target)
    lm_weight, embed_weight = target_weights(target, DominoError)
    frozen = {"embed_tokens.weight": embed_weight, "lm_head.weight": lm_weight}
    state.update({k: frozen[k].detach().to("cpu") for k in head.frozen_keys()})
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise DominoError(f"cannot load {str(folder / WEIGHTS)!r}: {err}") from None
    head.rotary_emb = LlamaRotaryEmbedding(config.layer_config())  # its buffers are not saved: rebuilt off meta
    device = device if device is not None else lm_weight.device
    head = head.to(device=device, dtype=dtype if dtype is not None else state["fc.weight"].dtype)
    head._freeze()
    return head.eval()


def _check_draftsmith(folder: Path, raw: dict) -> None:
    where = str(folder / "config.json")
    if raw.get("speculators_model_type") is not None:
        raise DominoError(
            f"{where}: speculators_model_type={raw['speculators_model_type']!r}; Domino has no speculators "
            "layout (expected draftsmith's or SpecForge's)"
        )
    if raw.get("model_type") != DominoConfig.model_type:
        raise DominoError(
            f"{where} is not a Domino head: expected model_type {DominoConfig.model_type!r} (draftsmith) or "
            f"architectures [{SPECFORGE_ARCHITECTURE!r}] with a dflash_config (SpecForge), "
            f"found model_type {raw.get('model_type')!r}"
        )


def read_folder(path) -> tuple[Path, DominoConfig, dict[str, torch.Tensor]]:
    """(folder, config, saved tensors under draftsmith's names) of a folder of either layout: the head
    without the target's tensors, its keys checked against the config."""
    folder, raw = read_config(path, DOMINO.title, DominoError)
    if is_specforge(raw):
        config = config_from_specforge(folder, raw)
    else:
        _check_draftsmith(folder, raw)
        try:
            config = DominoConfig.from_dict({k: v for k, v in raw.items() if k != "transformers_version"})
        except (TypeError, ValueError) as err:
            raise DominoError(f"{str(folder / 'config.json')!r}: {err}") from None
    weights = folder / WEIGHTS
    state = read_weights(weights, "Domino head weights", DominoError)
    state = {k.removeprefix(_OLD_PREFIX): v for k, v in state.items()}
    expected = required_keys(config, DOMINO)
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise DominoError(f"{str(weights)!r} does not match its config: missing {missing[:6]}, unexpected {extra[:6]}")
    return folder, config, state


# ---------------------------------------------------------------------- SpecForge's layout
def specforge_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's default `target_layer_ids` (its `build_target_layer_ids`), for a config without them."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4  # from layer 1 to L - 3
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def config_from_specforge(path: Path, raw: dict) -> DominoConfig:
    """The config of a SpecForge Domino folder (module docstring), refusing what draftsmith does not build."""
    where, flash = str(Path(path) / "config.json"), raw["dflash_config"]
    for key, built in (("projector_type", "domino"), ("shift_label", False), ("pure_draft_prefix_len", 0)):
        if flash.get(key, built) != built:
            raise DominoError(
                f"{where}: dflash_config.{key}={flash[key]!r}; draftsmith builds Domino with {key}={built!r} "
                "(the backbone's slots: slot 0 the anchor, every later slot corrected)"
            )
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise DominoError(
            f"{where}: sliding-window draft layers are not implemented (layer_types {raw['layer_types']})"
        )
    provenance = dict(raw.get(PROVENANCE_KEY) or {})
    try:
        L = raw.get("num_target_layers") or provenance.get("target_num_layers")
        ids = flash.get("target_layer_ids")
        if ids is None:
            ids = specforge_layer_ids(int(raw["num_target_layers"]), int(raw["num_hidden_layers"]))
        return DominoConfig(
            gru_hidden=flash["gru_hidden_dim"],
            proj_dim=flash["emb_dim"],
            **draft_layer_fields(raw),
            block_size=raw["block_size"],
            mask_token_id=flash["mask_token_id"],
            aux_layer_ids=[int(i) + 1 for i in ids],  # SpecForge's layer_id reads hidden_states[layer_id + 1]
            **{k: provenance.get(k) for k in _PROVENANCE_FIELDS if k != "target_num_layers"},
            target_num_layers=L,
        )
    except KeyError as err:
        raise DominoError(f"{where} lacks {err.args[0]!r}") from None


def specforge_config(c: DominoConfig) -> dict:
    """config.json of SpecForge's layout (its shipped configs' keys; no `auto_map`: it names a
    modeling file SpecForge ships, not this folder), draftsmith's provenance under `draftsmith`."""
    rope = dict(c.rope_parameters)
    return {
        "architectures": [SPECFORGE_ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "block_size": c.block_size,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": [i - 1 for i in c.aux_layer_ids],
            "projector_type": "domino",
            "pure_draft_prefix_len": 0,
            "emb_dim": c.proj_dim,
            "gru_hidden_dim": c.gru_hidden,
            "shift_label": False,
        },
        "emb_dim": c.proj_dim,  # SpecForge's shipped configs repeat it at the top
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "max_position_embeddings": c.max_position_embeddings,
        "max_window_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "num_target_layers": c.target_num_layers,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": c.vocab_size,
        PROVENANCE_KEY: {field: getattr(c, field) for field in _PROVENANCE_FIELDS},
    }


def _write_specforge(c: DominoConfig, state: dict, out_dir, *, overwrite: bool = False) -> Path:
    L = c.target_num_layers
    if c.reduced_vocab:
        raise DominoError(
            f"specforge export: the head drafts over a reduced vocabulary ({c.draft_vocab_size} of {c.vocab_size}); "
            "SpecForge's Domino uses the target's lm_head and corrects the whole vocabulary: train with "
            "draft_vocab_size unset; nothing was written"
        )
    if min(c.aux_layer_ids) < 1 or (L is not None and max(c.aux_layer_ids) >= L):
        raise DominoError(
            f"specforge export: aux layer ids {c.aux_layer_ids} must lie in 1..{'L-1' if L is None else L - 1} "
            "(SpecForge names a decoder layer's output: neither the embeddings, 0, nor the final norm's, L); "
            "nothing was written"
        )
    required = required_keys(c, DOMINO)
    if set(state) != required:
        raise DominoError(
            f"specforge export: missing {sorted(required - set(state))}, left over {sorted(set(state) - required)}; "
            "nothing was written"
        )
    config = specforge_config(c)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return write_folder_atomic(out_dir, write, overwrite=overwrite, error=DominoError)


def export_specforge(head: DominoHead, out_dir, *, overwrite: bool = False) -> Path:
    """Write `head` in SpecForge's layout (checked before anything is written)."""
    frozen = set(head.frozen_keys())
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items() if k not in frozen}
    return _write_specforge(head.config, state, out_dir, overwrite=overwrite)


def export_folder(folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
    """The registry's exporter: the head of `folder` (either layout) written to `out` as `fmt`
    ("hf": the draftsmith layout; "specforge": SpecForge's). Both hold the same tensors (never the
    target's), so the head converts without its target; `target`, a zero-argument loader, is called
    only to check that the head fits it. The drafts per call are the block's: K is not written."""
    if fmt not in EXPORT_FORMATS:
        raise DominoError(f"export format {fmt!r}: a Domino head exports as {' or '.join(EXPORT_FORMATS)}")
    path, config, state = read_folder(folder)
    if target is not None:
        load_domino(path, target=target())  # sizes, depth, positions and RoPE against the target
    if fmt == "specforge":
        return _write_specforge(config, state, out)

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})

    return write_folder_atomic(out, write, overwrite=False, error=DominoError)


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load a Domino head: neither vLLM nor upstream SGLang has a Domino drafter (no
    speculators class); SpecForge's SGLang fork reads SpecForge's layout, which draftsmith writes
    but has not served."""
    specforge = is_specforge(config)
    return {
        "layout": f"a Domino head in the {'SpecForge' if specforge else 'draftsmith'} layout",
        "notes": [
            "vLLM and upstream SGLang have no Domino drafter; SpecForge's SGLang fork reads SpecForge's layout"
            + ("" if specforge else f" (draftsmith export {folder} --format specforge)")
            + ", not checked by draftsmith",
            "the head reads the target's hidden states at fixed layers: serve it with exactly this target",
        ],
    }
