"""The decoding runtime: one batch-aware speculative decoding loop, its KV store,
verification, and every drafter written once.

    from draftsmith.decoding import DraftModelDrafter, generate, generate_batch

A method's drafter lives in its own module, named by its registry entry (`Method.rows_of`):
`get_method(KIND).rows(head, target, name)` builds its rows.
"""

from draftsmith.decoding.drafters import Drafter, DraftModelDrafter, PromptLookupDrafter, Proposal
from draftsmith.decoding.loop import decode, eos_set, generate, generate_batch, row_seed
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.stats import BatchResult, DecodeStats, Generation
from draftsmith.decoding.target import synchronize

__all__ = [
    "BatchResult",
    "DecodeStats",
    "DraftModelDrafter",
    "Drafter",
    "Generation",
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
