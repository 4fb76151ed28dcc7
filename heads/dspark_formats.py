"""DSpark heads on disk: the DFlash family's formats (`heads.dflash_formats`, one mechanism) with
DSpark's layout: draftsmith's (`model_type: draftsmith_dspark`) and the vLLM speculators `dspark`
one (`speculators_model_type: dspark`, `sample_from_anchor: true`: block_size drafts per block).

    save_dspark(head, "out/dspark")
    export_folder("out/dspark", "out/dspark-vllm", "vllm", num_speculative_tokens=7)
    head = load_dspark("out/dspark-vllm", target=target)

What the speculators `dspark` layout adds to `dflash`'s (speculators 0.9.0's DSparkSpeculatorConfig):
config keys `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`; tensors `markov_head.markov_w1.weight` [V_target, r],
`markov_head.markov_w2.weight` [V_draft, r], `markov_head.gate_proj.{weight,bias}` (gated) or
`markov_head.joint_proj.{weight,bias}` (rnn), and `confidence_head.proj.{weight,bias}`.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.heads.dflash_formats import BlockLayout, export_dflash, load_dflash, save_dflash
from draftsmith.heads.dflash_formats import export_folder as export_block_folder
from draftsmith.heads.dflash_formats import serving_facts as block_serving_facts
from draftsmith.heads.dspark import DSparkConfig, DSparkHead

VARIANT_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def _extra_keys(c: DSparkConfig) -> set[str]:
    keys = set()
    if c.markov_rank:
        keys |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        proj = {"gated": "gate_proj", "rnn": "joint_proj"}.get(c.markov_head_type)
        if proj:
            keys |= {f"markov_head.{proj}.weight", f"markov_head.{proj}.bias"}
    if c.enable_confidence_head:
        keys |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return keys


DSPARK = BlockLayout(
    DSparkHead,
    "dspark",
    "DSparkDraftModel",
    "DSpark head",
    extra_keys=_extra_keys,
    to_speculators=lambda c: {key: getattr(c, key) for key in VARIANT_KEYS},
    from_speculators=lambda raw: {key: raw[key] for key in VARIANT_KEYS if key in raw},
)


def save_dspark(head: DSparkHead, out_dir, *, overwrite: bool = False) -> Path:
    return save_dflash(head, out_dir, overwrite=overwrite)


def load_dspark(path, *, target, device=None, dtype=None) -> DSparkHead:
    """A DSpark head of either layout, completed with `target`'s tensors (`load_dflash`)."""
    return load_dflash(path, target=target, device=device, dtype=dtype, layout=DSPARK)


def export_dspark(head: DSparkHead, out_dir, *, overwrite: bool = False) -> Path:
    return export_dflash(head, out_dir, overwrite=overwrite, layout=DSPARK)


def export_folder(folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
    """The registry's exporter ("vllm": the speculators `dspark` layout; "hf": draftsmith's)."""
    return export_block_folder(
        folder, out, fmt, num_speculative_tokens=num_speculative_tokens, target=target, layout=DSPARK
    )


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load a DSpark head: vLLM's `dspark` method reads the speculators layout."""
    return block_serving_facts(folder, config, setting, k, layout=DSPARK)
