"""How much a model's answers repeat themselves: the share of n-grams that already occurred
earlier in the same answer.

    share = repetition_share([answer_ids_1, answer_ids_2], n=4)
    share["pooled"], share["per_answer"]

Loops flatter every drafter (prompt lookup most: it copies the earlier n-gram), so a target
whose greedy answers loop makes every acceptance figure look better than it would be on real
text. An answer of L tokens has L - n + 1 n-grams (overlapping, by start position); the one at
position i repeats when the same n tokens start at some j < i of that answer. Pooled = repeats
over n-grams summed across answers; an answer shorter than n has no n-grams (per answer: None).
"""

from __future__ import annotations

from collections.abc import Sequence


def repeated_ngrams(tokens: Sequence[int], n: int = 4) -> tuple[int, int]:
    """(n-grams that repeat an earlier n-gram of `tokens`, n-grams in `tokens`)."""
    if n < 1:
        raise ValueError(f"n-gram size must be >= 1, got {n}")
    tokens = [int(t) for t in tokens]  # a tensor's elements would hash by identity
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    total = max(0, len(tokens) - n + 1)
    for i in range(total):
        gram = tuple(tokens[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats, total


def repetition_share(answers: Sequence[Sequence[int]], n: int = 4) -> dict:
    """Per answer and pooled share of repeated n-grams (see the module docstring)."""
    counts = [repeated_ngrams(a, n) for a in answers]
    repeats = sum(r for r, _ in counts)
    total = sum(t for _, t in counts)
    return {
        "n": n,
        "answers": len(counts),
        "ngrams": total,
        "pooled": repeats / total if total else None,
        "per_answer": [r / t if t else None for r, t in counts],
    }
