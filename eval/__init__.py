"""The instrument: the decoding runtime (`eval.runtime`), the evaluator, the serving sweep, tuning
and reports."""

from draftsmith.eval.runtime import (
    DecodeStats,
    DraftModelDrafter,
    Drafter,
    EagleDrafter,
    Generation,
    MedusaDrafter,
    PromptLookupDrafter,
    Proposal,
    SamplingConfig,
    generate,
    generate_batch,
)
from draftsmith.eval.medusa_tree import build_medusa_tree

__all__ = [
    "DecodeStats",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "Generation",
    "MedusaDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SamplingConfig",
    "build_medusa_tree",
    "generate",
    "generate_batch",
]
