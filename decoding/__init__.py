"""The decoding runtime: one batch-aware speculative decoding loop, its KV store,
verification, and every drafter written once.

    from draftsmith.decoding import DraftModelDrafter, generate, generate_batch
"""

from draftsmith.decoding.drafters import Drafter, DraftModelDrafter, PromptLookupDrafter, Proposal
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.loop import decode, eos_set, generate, generate_batch, row_seed
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.stats import BatchResult, DecodeStats, Generation
from draftsmith.decoding.target import synchronize

__all__ = [
    "BatchResult",
    "DecodeStats",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "Generation",
    "MedusaDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SamplingConfig",
    "decode",
    "eos_set",
    "generate",
    "generate_batch",
    "row_seed",
    "synchronize",
]
