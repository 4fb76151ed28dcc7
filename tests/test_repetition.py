"""The repeated-n-gram share of `draftsmith.eval.repetition` on hand-made token lists."""

import pytest
import torch

from draftsmith.eval.repetition import repeated_ngrams, repetition_share


def test_counts_ngrams_that_occurred_earlier_in_the_same_answer():
    assert repeated_ngrams([1, 2, 3, 4, 5, 6], n=4) == (0, 3)  # all distinct
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4], n=4) == (1, 5)  # only the last 1 2 3 4 repeats
    assert repeated_ngrams([7, 7, 7, 7, 7, 7], n=4) == (2, 3)  # overlapping repeats count
    assert repeated_ngrams([1, 2, 3], n=4) == (0, 0)  # too short to hold one
    assert repeated_ngrams([1, 2, 1, 2, 1], n=2) == (2, 4)
    assert repeated_ngrams(torch.tensor([5, 6, 5, 6, 5, 6]), n=2) == (3, 5)  # tensors count by value


def test_pooled_share_weights_answers_by_their_ngrams():
    loop = [1, 2, 3, 4] * 3  # 9 4-grams, the last 5 repeat
    fresh = list(range(10, 24))  # 11 4-grams, none repeat
    share = repetition_share([loop, fresh, [9]], n=4)
    assert share["per_answer"] == [pytest.approx(5 / 9), 0.0, None]
    assert share["pooled"] == pytest.approx(5 / 20) and share["ngrams"] == 20 and share["answers"] == 3
    # the same n-gram in two answers is not a repeat: answers are measured apart
    assert repetition_share([[1, 2, 3, 4], [1, 2, 3, 4]])["pooled"] == 0.0
    assert repetition_share([])["pooled"] is None


def test_ngram_size_must_be_positive():
    with pytest.raises(ValueError, match="n-gram size must be >= 1"):
        repeated_ngrams([1, 2], n=0)
