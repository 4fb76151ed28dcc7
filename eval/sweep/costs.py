"""A chain drafter's costs as the autotuner (`tune_chain`) takes them: the draft cost per drafted
token or per step, a context as long as a typical decode's for timing v(n), and
`ChainMeasurement`, what `draftsmith tune` measures of one chain drafter (`measure_chain`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from draftsmith.decoding import Drafter


def typical_context(prompts: Sequence[torch.Tensor], max_new_tokens: int, minimum: int) -> torch.Tensor:
    """Real tokens as long as a context halfway through a decode (mean prompt length +
    max_new_tokens / 2, at least `minimum`): the prompts concatenated, cut to that length."""
    mean_prompt = sum(p.numel() for p in prompts) / len(prompts)
    length = max(minimum, int(mean_prompt + max_new_tokens / 2))
    joined = torch.cat([p.flatten() for p in prompts])
    while joined.numel() < length:
        joined = torch.cat([joined, joined])
    return joined[:length]


def draft_cost_per_step(drafter: Drafter) -> bool:
    """True when the drafter's cost is per step whatever K (one forward drafts every position),
    False when it grows with every drafted token (`Drafter.cost_per_step`)."""
    return drafter.cost_per_step


def chain_draft_seconds(drafter: Drafter, drafter_seconds: float, target_calls: int, drafts: int):
    """The draft cost for `tune_chain`: seconds per drafted token, or for a per-step drafter a
    function of K that is the same for every K >= 1."""
    return chain_draft_seconds_from(
        draft_cost_per_step(drafter), drafter_seconds, target_calls, drafts, getattr(drafter, "name", "drafter")
    )


def chain_draft_seconds_from(per_step: bool, drafter_seconds: float, target_calls: int, drafts: int, name: str):
    if target_calls < 1 or drafts < 1:
        raise ValueError(f"drafter {name!r} drafted nothing in the measurement: no draft cost to tune with")
    if per_step:
        step = drafter_seconds / target_calls
        return lambda k: step if k >= 1 else 0.0
    return drafter_seconds / drafts


@dataclass
class ChainMeasurement:
    """What `draftsmith tune` measures of one chain drafter: acceptance per position at k_max
    (one batch-1 decode pass over the prompts), its draft cost, and the verify cost curve."""

    name: str
    k_max: int
    alpha_per_position: list[float | None]
    tau: float
    target_calls: int
    drafts: int
    drafter_seconds: float
    per_step: bool  # the draft cost is per step (`Drafter.cost_per_step`), not per drafted token
    verify_seconds: dict[int, float]

    @property
    def draft_seconds(self):
        """`tune_chain`'s draft cost: seconds per drafted token, or a function of K."""
        return chain_draft_seconds_from(self.per_step, self.drafter_seconds, self.target_calls, self.drafts, self.name)

    @property
    def draft_ms_per_step(self) -> float:
        return 1000 * self.drafter_seconds / max(1, self.target_calls)

    @property
    def draft_ms_per_token(self) -> float:
        return 1000 * self.drafter_seconds / max(1, self.drafts)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verify_seconds"] = {str(n): v for n, v in self.verify_seconds.items()}
        out["draft_ms_per_step"], out["draft_ms_per_token"] = self.draft_ms_per_step, self.draft_ms_per_token
        return out
