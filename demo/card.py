"""What the demo measures about its target besides the drafters: how much the target's greedy
answers loop (`draftsmith.eval.repetition`; loops are easy to predict and inflate every drafter's
acceptance, prompt lookup's most).
"""

from __future__ import annotations

import torch

from draftsmith.eval.repetition import repetition_share

REPETITION_N = 4  # n-gram size of the repetition share: long enough that code's short idioms rarely count


@torch.no_grad()
def greedy_answers(target, prompts: list[torch.Tensor], new_tokens: int, eos_token_id=None) -> list[list[int]]:
    """The target's plain greedy answers (no repetition penalty), new tokens only."""
    from draftsmith.decoding import generate

    return [generate(target, None, ids, max_new_tokens=new_tokens, eos_token_id=eos_token_id).tokens for ids in prompts]


def greedy_repetition(target, prompts: list[torch.Tensor], new_tokens: int, eos_token_id=None) -> dict:
    """The repeated-4-gram share (per answer and pooled) of the target's greedy answers."""
    share = repetition_share(greedy_answers(target, prompts, new_tokens, eos_token_id), n=REPETITION_N)
    return {**share, "new_tokens": new_tokens}


def repetition_line(rep: dict) -> str:
    """One sentence on how much greedy answers loop (a `greedy_repetition` result)."""
    per = sorted(x for x in rep["per_answer"] if x is not None)
    pooled = "-" if rep["pooled"] is None else f"{100 * rep['pooled']:.1f}%"
    spread = f" (per answer: median {100 * per[len(per) // 2]:.0f}%, max {100 * per[-1]:.0f}%)" if per else ""
    return (
        f"greedy answers (no repetition penalty, up to {rep['new_tokens']} new tokens, {rep['answers']} held-out prompts) "
        f"repeat {pooled} of their {rep['n']}-grams{spread}"
    )
