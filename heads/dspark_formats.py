"""DSpark heads on disk: the block heads' formats (`heads.block_formats`, one mechanism) with
DSpark's layout: draftsmith's (`model_type: draftsmith_dspark`) and the vLLM speculators `dspark`
one (`speculators_model_type: dspark`, `sample_from_anchor: true`: block_size drafts per block).

    save_dspark(head, "out/dspark")
    export_folder("out/dspark", "out/dspark-vllm", "vllm", num_speculative_tokens=7)
    head = load_dspark("out/dspark-vllm", target=target)

What the speculators `dspark` layout adds to the backbone's (speculators 0.9.0's DSparkSpeculatorConfig):
config keys `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`; tensors `markov_head.markov_w1.weight` [V_target, r],
`markov_head.markov_w2.weight` [V_draft, r], `markov_head.gate_proj.{weight,bias}` (gated) or
`markov_head.joint_proj.{weight,bias}` (rnn), and `confidence_head.proj.{weight,bias}`.
"""

from __future__ import annotations

from draftsmith.heads.block_formats import BlockLayout
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


# the block heads' formats (`heads.block_formats`) for DSpark's layout
save_dspark, load_dspark, export_dspark = DSPARK.save, DSPARK.load, DSPARK.export
export_folder, serving_facts = DSPARK.export_folder, DSPARK.serving_facts  # the registry's exporter and server
