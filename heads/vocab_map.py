"""A reduced draft vocabulary (of a head that drafts over fewer tokens than the target), as the head stores it:

    d2t: int64[draft_vocab]   target_id = draft_id + d2t[draft_id]   (draft ids in target-id order)
    t2d: bool[target_vocab]   t2d[target_id] = the token is in the draft vocabulary

(the tensors vLLM and SGLang read). Built from the target's own generations by
`draftsmith.distill.vocab`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class VocabMapError(ValueError):
    pass


@dataclass(frozen=True)
class VocabMap:
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [target_vocab]
    coverage: float  # share of trained target tokens inside the draft vocabulary
    data_hash: str

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """int64[draft_vocab]: the target id of every draft id."""
        return torch.arange(self.draft_vocab_size) + self.d2t

    def describe(self) -> str:
        return (
            f"draft vocabulary {self.draft_vocab_size} of {self.target_vocab_size} target tokens, "
            f"covering {100 * self.coverage:.2f}% of the answer tokens (data {self.data_hash[:12]})"
        )


def check_consistent(vmap: VocabMap) -> None:
    """Every draft id maps to a distinct target id that t2d marks, and t2d marks nothing else."""
    targets = vmap.target_ids()
    if targets.numel() and (targets.min() < 0 or targets.max() >= vmap.target_vocab_size):
        raise VocabMapError("d2t maps a draft id outside the target vocabulary")
    if targets.unique().numel() != targets.numel():
        raise VocabMapError("d2t maps two draft ids to the same target id")
    if int(vmap.t2d.sum()) != vmap.draft_vocab_size or not bool(vmap.t2d[targets].all()):
        raise VocabMapError("t2d does not mark exactly the target ids of d2t")
