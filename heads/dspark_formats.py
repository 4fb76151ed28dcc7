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
A head with `markov_embedding: target` saves `markov_head.markov_w1_proj.weight` [r, H] (W1 = E P
over the target's embeddings E) and exports the table E P, so its vllm export needs the target;
the exported head is a `table` head that drafts the same tokens.
"""

from __future__ import annotations

import copy

import torch

from draftsmith.heads.block_formats import BlockLayout
from draftsmith.heads.dspark import DSparkConfig, DSparkHead

VARIANT_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def _extra_keys(c: DSparkConfig) -> set[str]:
    keys = set()
    if c.markov_rank:
        w1 = "markov_w1" if c.markov_embedding == "table" else "markov_w1_proj"
        keys |= {f"markov_head.{w1}.weight", "markov_head.markov_w2.weight"}
        proj = {"gated": "gate_proj", "rnn": "joint_proj"}.get(c.markov_head_type)
        if proj:
            keys |= {f"markov_head.{proj}.weight", f"markov_head.{proj}.bias"}
    if c.enable_confidence_head:
        keys |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return keys


def _reads_target(c: DSparkConfig) -> bool:
    return bool(c.markov_rank) and c.markov_embedding == "target"


def _as_speculators(head: DSparkHead, state: dict) -> tuple[DSparkConfig, dict]:
    """The head as speculators stores it: W1 = E P written as the table [V, r] (a `table` head)."""
    if not _reads_target(head.config):
        return head.config, state
    config = copy.deepcopy(head.config)
    config.markov_embedding = "table"
    dtype = state.pop("markov_head.markov_w1_proj.weight").dtype
    with torch.no_grad():
        table = head.markov_table().to(device="cpu", dtype=dtype).contiguous()
    return config, {**state, "markov_head.markov_w1.weight": table}


DSPARK = BlockLayout(
    DSparkHead,
    "dspark",
    "DSparkDraftModel",
    "DSpark head",
    extra_keys=_extra_keys,
    to_speculators=lambda c: {key: getattr(c, key) for key in VARIANT_KEYS},
    from_speculators=lambda raw: {key: raw[key] for key in VARIANT_KEYS if key in raw},
    reads_target=_reads_target,
    as_speculators=_as_speculators,
)


# the block heads' formats (`heads.block_formats`) for DSpark's layout
save_dspark, load_dspark, export_dspark = DSPARK.save, DSPARK.load, DSPARK.export
export_folder, serving_facts = DSPARK.export_folder, DSPARK.serving_facts  # the registry's exporter and server
