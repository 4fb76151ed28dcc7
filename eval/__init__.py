"""The speculative decoder, the drafters and the evaluator."""

from draftsmith.eval.decoder import DecodeStats, Generation, generate
from draftsmith.eval.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter, Proposal
from draftsmith.eval.sampling import SamplingConfig, verify_chain, verify_chain_greedy

__all__ = [
    "DecodeStats",
    "DraftModelDrafter",
    "Drafter",
    "Generation",
    "PromptLookupDrafter",
    "Proposal",
    "SamplingConfig",
    "generate",
    "verify_chain",
    "verify_chain_greedy",
]
