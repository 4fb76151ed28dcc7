"""What the load simulator knows about one serving method, all of it measured: cost curves
(seconds per engine step or verify forward as a function of its size), the tokens a row gains
per step, and `StepProfile`, which holds both with the prefill cost."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


# ---------------------------------------------------------------------- cost curves
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class CostCurve:
    """Seconds as a function of a size (rows in an engine step, tokens in a verify forward),
    from measured points {size: seconds}.

    Between two points: linear interpolation. Past the largest point: the line through the last
    two points, its slope floored at 0 (a bigger batch is never assumed cheaper than the largest
    one measured). Below the smallest point: that point's cost (conservative; measure the
    smallest size you care about). One point: a constant.
    `allow_zero`: a cost of 0 is a valid measurement (a drafter that costs nothing, such as
    prompt lookup); engine steps and verify forwards always cost something.
    """

    def __init__(self, points: Mapping, what: str = "cost", *, allow_zero: bool = False):
        if not isinstance(points, Mapping) or not points:
            raise ValueError(f"{what}: expected measured points {{size: seconds}}, got {points!r}")
        for x, y in points.items():
            if not _is_number(x) or x < 1:
                raise ValueError(f"{what}: size {x!r} is not a size; expected a number >= 1")
            if not _is_number(y) or y < 0 or (y == 0 and not allow_zero):
                bound = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"{what}: the cost at size {x} is {y!r} seconds; expected a finite number {bound}")
        self.what = what
        self.xs = sorted(float(x) for x in points)
        by_x = {float(x): float(y) for x, y in points.items()}
        self.ys = [by_x[x] for x in self.xs]

    def __call__(self, size: float) -> float:
        if not _is_number(size) or size < 0:
            raise ValueError(f"{self.what}: size {size!r}; expected a number >= 0")
        xs, ys = self.xs, self.ys
        if size <= xs[0]:
            return ys[0]
        if size >= xs[-1]:
            if len(xs) == 1:
                return ys[0]
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (size - xs[-1])
        j = bisect.bisect_right(xs, size)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def __repr__(self) -> str:
        return f"CostCurve({dict(zip(self.xs, self.ys))!r}, what={self.what!r})"


class _CheckedCost:
    """A cost given as a function: every value it returns is checked like a measured point."""

    def __init__(self, fn: Callable[[float], float], what: str, allow_zero: bool):
        self.fn, self.what, self.allow_zero = fn, what, allow_zero

    def __call__(self, size: float) -> float:
        y = self.fn(size)
        if not _is_number(y) or y < 0 or (y == 0 and not self.allow_zero):
            bound = ">= 0" if self.allow_zero else "> 0"
            raise ValueError(
                f"{self.what}: the cost function returned {y!r} seconds at size {size}; "
                f"expected a finite number {bound}"
            )
        return float(y)


def as_cost_curve(spec, what: str, *, allow_zero: bool = False) -> Callable[[float], float]:
    """A cost curve from measured points {size: seconds}, a constant (seconds), a function of
    the size, or a CostCurve. Bad values raise ValueError naming `what`."""
    if isinstance(spec, (CostCurve, _CheckedCost)):
        return spec
    if isinstance(spec, Mapping):
        return CostCurve(spec, what, allow_zero=allow_zero)
    if _is_number(spec):
        return CostCurve({1: spec}, what, allow_zero=allow_zero)
    if callable(spec):
        return _CheckedCost(spec, what, allow_zero)
    raise ValueError(
        f"{what}: expected measured points {{size: seconds}}, a number of seconds or a function, got {spec!r}"
    )


# ---------------------------------------------------------------------- tokens per step
def tokens_histogram(accepted: Sequence[int]) -> dict[int, float]:
    """Tokens per step from a decode's per-call accepted counts (`DecodeStats.accepted`): each
    call emits its accepted drafts + 1 (the correction or bonus token)."""
    if not accepted:
        raise ValueError("accepted: no target calls recorded; expected DecodeStats.accepted of a decode")
    counts: dict[int, float] = {}
    for a in accepted:
        if not isinstance(a, int) or isinstance(a, bool) or a < 0:
            raise ValueError(f"accepted: {a!r} is not a count of accepted drafts; expected an int >= 0")
        counts[a + 1] = counts.get(a + 1, 0) + 1
    return {n: c / len(accepted) for n, c in sorted(counts.items())}


def histogram_from_alphas(alpha_per_position: Sequence[float | None]) -> dict[int, float]:
    """Tokens per step implied by per-position conditional acceptance (a report's
    `alpha_per_position`): P(tokens >= n + 1) = prod_{j<=n} alpha_j, so
    P(tokens = n) = prod_{j<n} alpha_j * (1 - alpha_n), and P(tokens = K + 1) = prod_{j<=K} alpha_j.
    A position never reached (None) ends the chain there: nothing was measured beyond it."""
    alphas = []
    for i, a in enumerate(alpha_per_position):
        if a is None:
            break
        if not _is_number(a) or not 0.0 <= a <= 1.0:
            raise ValueError(
                f"alpha_per_position[{i}] = {a!r}; expected a probability in [0, 1] (or None: not reached)"
            )
        alphas.append(float(a))
    hist: dict[int, float] = {}
    reach = 1.0  # P(tokens >= n)
    for n, a in enumerate(alphas, start=1):
        if reach * (1 - a) > 0:
            hist[n] = reach * (1 - a)
        reach *= a
    if reach > 0:
        hist[len(alphas) + 1] = reach
    return hist


def _normalise_histogram(hist, name: str) -> dict[int, float]:
    if not isinstance(hist, Mapping) or not hist:
        raise ValueError(
            f"{name}: tokens_per_step must be a non-empty histogram {{tokens: probability or count}}, got {hist!r}"
        )
    for n, w in hist.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}: tokens_per_step key {n!r}; expected tokens per step as an int >= 1")
        if not _is_number(w) or w < 0:
            raise ValueError(f"{name}: tokens_per_step[{n}] = {w!r}; expected a probability or count >= 0")
    total = sum(hist.values())
    if total <= 0:
        raise ValueError(f"{name}: tokens_per_step has no mass (all weights are 0)")
    return {n: hist[n] / total for n in sorted(hist) if hist[n] > 0}


# ---------------------------------------------------------------------- the method's profile
@dataclass
class StepProfile:
    """What the simulator knows about one serving method, all of it measured.

    step_seconds: one engine step as a function of the active rows: measured points
      {batch size: seconds} (see CostCurve), a constant, or a function of the batch size.
    tokens_per_step: tokens one row gains per step, {tokens: probability or count}; target-only
      decoding is {1: 1.0}; from a decode: `tokens_histogram(stats.accepted)`.
    prefill_seconds_per_token / prefill_seconds_per_request: a request's prefill costs
      per_request + per_token * prompt tokens, added to the step that admits it.
    """

    name: str
    step_seconds: Mapping | Callable[[float], float] | float
    tokens_per_step: Mapping[int, float] = field(default_factory=lambda: {1: 1.0})
    prefill_seconds_per_token: float = 0.0
    prefill_seconds_per_request: float = 0.0

    def __post_init__(self):
        self._step = as_cost_curve(self.step_seconds, f"{self.name}: step_seconds")
        self.tokens_per_step = _normalise_histogram(self.tokens_per_step, self.name)
        for key in ("prefill_seconds_per_token", "prefill_seconds_per_request"):
            value = getattr(self, key)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{self.name}: {key} = {value!r}; expected a finite number of seconds >= 0")
        self._tokens = list(self.tokens_per_step)
        cumulative, total = [], 0.0
        for n in self._tokens:
            total += self.tokens_per_step[n]
            cumulative.append(total)
        self._cumulative = cumulative

    @classmethod
    def target_only(cls, step_seconds, *, name: str = "target-only", **prefill) -> StepProfile:
        """Plain decoding: one token per row per step."""
        return cls(name, step_seconds, {1: 1.0}, **prefill)

    @classmethod
    def from_report_row(cls, row: Mapping, step_seconds, **prefill) -> StepProfile:
        """A profile from one `methods` row of report.json: the tokens per step implied by its
        `alpha_per_position` (target-only: 1), named as the report names it (lossy rows marked).
        The report measures batch 1 only: `step_seconds` per batch size must be measured apart
        (`batch1_step_seconds(row)` is the report's own batch-1 point, to check against)."""
        from draftsmith.eval.report import method_name

        if "method" not in row:
            raise ValueError(f"report row without a 'method' field: {sorted(row)}")
        alphas = row.get("alpha_per_position")
        hist = histogram_from_alphas(alphas) if alphas else {1: 1.0}
        return cls(method_name(row), step_seconds, hist, **prefill)

    @property
    def mean_tokens_per_step(self) -> float:
        """tau of the profile (counts the bonus token: target-only = 1)."""
        return sum(n * p for n, p in self.tokens_per_step.items())

    def step_cost(self, rows: int) -> float:
        _check_batch(rows, "rows")
        return self._step(rows)

    def prefill_cost(self, prompt_tokens: int) -> float:
        return self.prefill_seconds_per_request + self.prefill_seconds_per_token * prompt_tokens

    def draw(self, u: float) -> int:
        """Tokens for one row in one step, from a uniform draw u in [0, 1)."""
        j = bisect.bisect_right(self._cumulative, u * self._cumulative[-1])
        return self._tokens[min(j, len(self._tokens) - 1)]


def batch1_step_seconds(row: Mapping) -> float:
    """Seconds per decoding step at batch 1 in a report row: (drafter + target seconds) per
    target call, from `drafter_seconds`, `target_seconds` and `target_calls`."""
    for key in ("target_seconds", "target_calls"):
        if key not in row:
            raise ValueError(f"report row {row.get('method')!r} has no {key!r}")
    calls = row["target_calls"]
    if not calls:
        raise ValueError(f"report row {row.get('method')!r} made no target calls")
    return (row.get("drafter_seconds", 0.0) + row["target_seconds"]) / calls


def check_items(items, cls: type, what: str) -> list:
    """`items` as a list, once it is known to hold at least one item, each a `cls`; else
    ValueError (empty) or TypeError (an item of another type), naming `what`."""
    items = list(items)
    if not items:
        raise ValueError(f"{what} is empty; expected at least one {cls.__name__}")
    for item in items:
        if not isinstance(item, cls):
            raise TypeError(f"{what} must hold {cls.__name__} objects, got {item!r}")
    return items


def _check_batch(value, what: str = "max_batch") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} = {value!r}; expected a batch size: an int >= 1")
