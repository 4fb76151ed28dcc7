"""The speculative decoder, the drafters and the evaluator."""

from draftsmith.eval.decoder import DecodeStats, Generation, generate
from draftsmith.eval.drafters import DraftModelDrafter, Drafter, MedusaDrafter, PromptLookupDrafter, Proposal
from draftsmith.eval.sampling import SamplingConfig, verify_chain, verify_chain_greedy
from draftsmith.eval.tree import build_medusa_tree, verify_tree, verify_tree_greedy

__all__ = [
    "DecodeStats",
    "DraftModelDrafter",
    "Drafter",
    "Generation",
    "MedusaDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "SamplingConfig",
    "build_medusa_tree",
    "generate",
    "verify_chain",
    "verify_chain_greedy",
    "verify_tree",
    "verify_tree_greedy",
]

from draftsmith.eval.eagle import EagleDrafter  # noqa: E402  (imports heads.eagle only when used)

__all__ += ["EagleDrafter"]
