"""The decoding runtime: one batch-aware speculative decoding loop, its KV cache (two stores),
verification, and every drafter written once.

    from draftsmith.eval.runtime import DraftModelDrafter, generate, generate_batch
"""

from draftsmith.eval.runtime.drafters import DraftModelDrafter, Drafter, MedusaDrafter, PromptLookupDrafter, Proposal
from draftsmith.eval.runtime.eagle import EagleDrafter
from draftsmith.eval.runtime.loop import decode, eos_set, generate, generate_batch, row_seed
from draftsmith.eval.runtime.sampling import SamplingConfig
from draftsmith.eval.runtime.stats import BatchResult, DecodeStats, Generation
from draftsmith.eval.runtime.target import synchronize

__all__ = [
    "BatchResult", "DecodeStats", "DraftModelDrafter", "Drafter", "EagleDrafter", "Generation", "MedusaDrafter",
    "PromptLookupDrafter", "Proposal", "SamplingConfig", "decode", "eos_set", "generate", "generate_batch", "row_seed",
    "synchronize",
]
