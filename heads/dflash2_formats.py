"""DFlash2 heads on disk: the block heads' formats (`heads.block_formats`, one mechanism) with
DFlash2's layout: draftsmith's (`model_type: draftsmith_dflash2`) and the vLLM speculators `dflash2`
one (`speculators_model_type: dflash2`, `DFlash2DraftModel`, `sample_from_anchor: false`).

    save_dflash2(head, "out/dflash2")
    export_folder("out/dflash2", "out/dflash2-vllm", "vllm", num_speculative_tokens=7)
    head = load_dflash2("out/dflash2-vllm", target=target)

What the speculators `dflash2` layout adds to the backbone's (speculators 0.9.0's DFlash2SpeculatorConfig,
speculators/models/dflash2/config.py): config keys `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k`, and `sliding_window_non_causal: true` (its default for dflash2; the
draft layers here are full attention, which it does not affect); tensors, per draft layer i,
`layers.{i}.attention_conv.base_kernel` [2, kernel, H], `layers.{i}.attention_conv.kernel_projection.weight`
[2 kernel H/group, H], the same under `mlp_conv`, and `candidate_selector.predecessor_codebook` [V, rank],
`candidate_selector.successor_codebook` [V, rank], `candidate_selector.hidden_projection.weight`
[rank, H]. The vocabulary is always the target's: no `lm_head`, `d2t` or `t2d` is written.
"""

from __future__ import annotations

from draftsmith.heads.block_formats import BlockLayout
from draftsmith.heads.dflash2 import DFlash2Config, DFlash2Head

VARIANT_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_KEYS = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")


def _extra_keys(c: DFlash2Config) -> set[str]:
    keys = {f"candidate_selector.{name}" for name in SELECTOR_KEYS}
    for i in range(c.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            keys |= {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"}
    return keys


def _to_speculators(c: DFlash2Config) -> dict:
    # speculators' DFlash2 default, written over the backbone's False: it only changes sliding-window
    # draft layers, and draftsmith builds full-attention ones (a folder with others is refused on load)
    return {**{key: getattr(c, key) for key in VARIANT_KEYS}, "sliding_window_non_causal": True}


DFLASH2 = BlockLayout(
    DFlash2Head,
    "dflash2",
    "DFlash2DraftModel",
    "DFlash2 head",
    extra_keys=_extra_keys,
    to_speculators=_to_speculators,
    from_speculators=lambda raw: {key: raw[key] for key in VARIANT_KEYS if key in raw},  # absent: the defaults,
    # which are speculators' (2, 16, 256, 16)
)


# the block heads' formats (`heads.block_formats`) for DFlash2's layout
save_dflash2, load_dflash2, export_dflash2 = DFLASH2.save, DFLASH2.load, DFLASH2.export
export_folder = DFLASH2.export_folder  # the registry's exporter ("vllm": the speculators `dflash2` layout)


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load a DFlash2 head: vLLM's `dflash2` method on the speculators layout (not run here)."""
    facts = DFLASH2.serving_facts(folder, config, setting, k)
    facts["notes"].append("vLLM's dflash2 method has not been run on this export by draftsmith (no GPU server)")
    return facts
