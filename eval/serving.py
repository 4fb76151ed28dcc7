"""Serving at scale, from measured numbers: a continuous-batching load simulator, the highest
load that meets a latency target, the batch size where speculation stops paying, and the cost
of an answer.

    from draftsmith.eval.serving import StepProfile, poisson_requests, simulate, sustainable_load
    # step_seconds: one engine step (draft + verify for every active row), measured per batch size
    eagle = StepProfile("eagle3", step_seconds={1: 0.021, 8: 0.026, 32: 0.048},
                        tokens_per_step={1: 0.3, 2: 0.2, 3: 0.5}, prefill_seconds_per_token=2e-5)
    base = StepProfile.target_only(step_seconds={1: 0.015, 8: 0.017, 32: 0.030}, prefill_seconds_per_token=2e-5)
    run = simulate(eagle, poisson_requests(4.0, 500, prompt_lengths=512, output_lengths=256, seed=0), max_batch=32)
    print(run.summary())
    print(sustainable_load(eagle, 10.0, 90, max_batch=32, prompt_lengths=512, output_lengths=256).describe())

The server model (what `simulate` assumes; nothing else is modelled):
- one engine with at most `max_batch` rows; every decision happens at a step boundary;
- at a boundary, requests that have arrived are admitted first in, first out into free slots;
  their prefill is added to that step's time (no chunked prefill: prefill and decode do not
  overlap);
- a step costs step_seconds(active rows) + the prefill of the requests admitted with it; every
  active row, the new ones included (draftsmith's decoder speculates from its first call on),
  gains n tokens, n drawn from the method's tokens-per-step histogram and capped at what the
  row still needs;
- a request's first token exists at the end of its first step, its answer at the end of the
  step that completes it; its slot is free from that boundary on; an idle engine waits for the
  next arrival.
Each request draws its tokens per step from its own random stream, seeded by (seed, request
index): two methods, or two loads, see the same luck per request, so their difference is not
scheduling noise.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from draftsmith.eval.stats import percentile as _percentile

Lengths = int | Sequence[int]  # a fixed length, or measured lengths to draw from (uniformly)


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
                f"{self.what}: the cost function returned {y!r} seconds at size {size}; expected a finite number {bound}"
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
    raise ValueError(f"{what}: expected measured points {{size: seconds}}, a number of seconds or a function, got {spec!r}")


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
            raise ValueError(f"alpha_per_position[{i}] = {a!r}; expected a probability in [0, 1] (or None: not reached)")
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
        raise ValueError(f"{name}: tokens_per_step must be a non-empty histogram {{tokens: probability or count}}, got {hist!r}")
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


def _check_batch(value, what: str = "max_batch") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} = {value!r}; expected a batch size: an int >= 1")


# ---------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self):
        if not _is_number(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request arrival_s = {self.arrival_s!r}; expected a finite time >= 0 seconds")
        for key in ("prompt_tokens", "output_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"request {key} = {value!r}; expected an int >= 1")


def _length_sampler(lengths: Lengths, what: str) -> Callable[[random.Random], int]:
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if lengths < 1:
            raise ValueError(f"{what} = {lengths}; expected a token count >= 1")
        return lambda rng: lengths
    if isinstance(lengths, Sequence) and not isinstance(lengths, str) and lengths:
        values = list(lengths)
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{what} holds {v!r}; expected token counts, ints >= 1")
        return lambda rng: values[rng.randrange(len(values))]
    raise ValueError(f"{what} = {lengths!r}; expected a token count or a non-empty list of measured counts")


def poisson_requests(qps: float, n: int, prompt_lengths: Lengths, output_lengths: Lengths, seed: int = 0) -> list[Request]:
    """`n` requests arriving as a Poisson process of rate `qps` (exponential gaps, the first
    one after a gap too); lengths fixed or drawn uniformly from measured lengths.

    The same seed gives the same uniforms at every rate: arrival times scale as 1 / qps and the
    lengths stay the same, so loads are compared on one request sequence."""
    if not _is_number(qps) or qps <= 0:
        raise ValueError(f"qps = {qps!r}; expected an arrival rate > 0 requests per second")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n = {n!r}; expected a number of requests >= 1")
    prompt, output = _length_sampler(prompt_lengths, "prompt_lengths"), _length_sampler(output_lengths, "output_lengths")
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(n):
        t += -math.log(1.0 - rng.random()) / qps  # Exp(qps) by inversion: one uniform per gap
        requests.append(Request(t, prompt(rng), output(rng)))
    return requests


# ---------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class RequestResult:
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int  # tokens produced for it
    steps: int  # engine steps the request was part of

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.admitted_s - self.arrival_s


@dataclass
class SimulationResult:
    """One simulated run. `requests` in the order they were given."""

    method: str
    max_batch: int
    requests: list[RequestResult]
    steps: int
    busy_seconds: float  # time the engine spent in steps
    row_seconds: float  # sum over steps of active rows x step time
    backlog_seconds: float  # time in steps that left requests waiting (every slot busy)
    backlog_tokens: int  # tokens produced in those steps
    max_waiting: int  # most requests waiting at a step boundary

    @property
    def makespan_s(self) -> float:
        """First arrival to last answer."""
        return max(r.finish_s for r in self.requests) - min(r.arrival_s for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.makespan_s

    @property
    def mean_batch(self) -> float:
        """Active rows, averaged over the engine's busy time."""
        return self.row_seconds / self.busy_seconds if self.busy_seconds else 0.0

    def latency(self, q: float = 50) -> float:
        return _percentile([r.latency_s for r in self.requests], q)

    def ttft(self, q: float = 50) -> float:
        return _percentile([r.ttft_s for r in self.requests], q)

    def queue(self, q: float = 50) -> float:
        return _percentile([r.queue_s for r in self.requests], q)

    def summary(self) -> dict:
        """The aggregates, JSON-ready."""
        out = {
            "method": self.method,
            "max_batch": self.max_batch,
            "requests": len(self.requests),
            "output_tokens": self.output_tokens,
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "mean_batch": self.mean_batch,
            "steps": self.steps,
        }
        for q in (50, 90, 99):
            out[f"latency_s_p{q}"] = self.latency(q)
        for q in (50, 90, 99):
            out[f"ttft_s_p{q}"] = self.ttft(q)
        for q in (50, 90, 99):
            out[f"queue_s_p{q}"] = self.queue(q)
        out["queue_s_mean"] = sum(r.queue_s for r in self.requests) / len(self.requests)
        out["max_waiting"] = self.max_waiting
        return out


def simulate(profile: StepProfile, requests: Sequence[Request], max_batch: int, *, seed: int = 0) -> SimulationResult:
    """Run the continuous-batching server of the module docstring over `requests`."""
    _check_batch(max_batch)
    requests = list(requests)
    if not requests:
        raise ValueError("requests is empty; expected at least one Request")
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"requests must hold Request objects, got {r!r}")
    n = len(requests)
    order = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
    streams = [random.Random(f"{seed}:{i}") for i in range(n)]  # one stream per request (docstring)
    remaining = [r.output_tokens for r in requests]
    admitted: list[float] = [math.nan] * n
    first: list[float] = [math.nan] * n
    finish: list[float] = [math.nan] * n
    steps_of = [0] * n
    produced_of = [0] * n
    waiting: deque[int] = deque()
    active: list[int] = []
    clock, arrived, done = requests[order[0]].arrival_s, 0, 0
    steps, busy, row_seconds, backlog_s, backlog_tokens, max_waiting = 0, 0.0, 0.0, 0.0, 0, 0

    while done < n:
        while arrived < n and requests[order[arrived]].arrival_s <= clock:
            waiting.append(order[arrived])
            arrived += 1
        if not active and not waiting:
            clock = requests[order[arrived]].arrival_s  # idle until the next arrival
            continue
        max_waiting = max(max_waiting, len(waiting))
        seconds = 0.0
        while waiting and len(active) < max_batch:
            i = waiting.popleft()
            admitted[i] = clock
            active.append(i)
            seconds += profile.prefill_cost(requests[i].prompt_tokens)
        seconds += profile.step_cost(len(active))
        clock += seconds
        steps += 1
        busy += seconds
        row_seconds += seconds * len(active)
        produced = 0
        still = []
        for i in active:
            gained = min(profile.draw(streams[i].random()), remaining[i])
            remaining[i] -= gained
            produced_of[i] += gained
            produced += gained
            steps_of[i] += 1
            if steps_of[i] == 1:
                first[i] = clock
            if remaining[i]:
                still.append(i)
            else:
                finish[i] = clock
                done += 1
        if waiting:
            backlog_s += seconds
            backlog_tokens += produced
        active = still

    results = [
        RequestResult(r.arrival_s, admitted[i], first[i], finish[i], r.prompt_tokens, produced_of[i], steps_of[i])
        for i, r in enumerate(requests)
    ]
    return SimulationResult(profile.name, max_batch, results, steps, busy, row_seconds, backlog_s, backlog_tokens, max_waiting)


# ---------------------------------------------------------------------- capacity and load
@dataclass(frozen=True)
class Capacity:
    """The server's rate with a queue that never empties (every slot always busy)."""

    tokens_per_s: float
    requests_per_s: float
    mean_output_tokens: float


def saturation_capacity(
    profile: StepProfile,
    max_batch: int,
    prompt_lengths: Lengths,
    output_lengths: Lengths,
    *,
    num_requests: int = 400,
    seed: int = 0,
) -> Capacity:
    """Tokens/s and requests/s the server sustains at full load: every request arrives at once
    (at least 4 x max_batch of them), and only the steps that still left a queue behind count,
    so the final drain with a half-empty batch does not dilute the rate.
    requests/s = tokens/s / mean output length (prefill included in the steps' time)."""
    _check_batch(max_batch)
    n = max(num_requests, 4 * max_batch)
    lengths = poisson_requests(1.0, n, prompt_lengths, output_lengths, seed)
    requests = [Request(0.0, r.prompt_tokens, r.output_tokens) for r in lengths]
    run = simulate(profile, requests, max_batch, seed=seed)
    mean_output = run.output_tokens / n
    tokens_per_s = run.backlog_tokens / run.backlog_seconds
    return Capacity(tokens_per_s, tokens_per_s / mean_output, mean_output)


@dataclass
class LoadResult:
    """The answer of `sustainable_load`. `qps` is None when even the lowest rate tried misses the
    target; `reason` says why in one sentence either way."""

    method: str
    qps: float | None
    reason: str
    latency_target_s: float
    percentile: float
    latency_s: float | None  # the latency percentile at `qps`
    tokens_per_s: float | None  # throughput at `qps`
    capacity: Capacity
    limit: str  # "capacity" (the queue would grow without bound), "latency", or "unreachable"
    trials: list[dict] = field(default_factory=list)  # every rate simulated: qps, latency_s, meets_target

    @property
    def reached(self) -> bool:
        return self.qps is not None

    def describe(self) -> str:
        return f"{self.method}: {self.reason}"


def sustainable_load(
    profile: StepProfile,
    latency_target_s: float,
    percentile: float = 90,
    *,
    max_batch: int,
    prompt_lengths: Lengths,
    output_lengths: Lengths,
    num_requests: int = 400,
    seed: int = 0,
    min_qps: float | None = None,
    rel_tol: float = 0.01,
) -> LoadResult:
    """The highest Poisson arrival rate whose latency percentile stays within the target and
    whose queue does not grow without bound.

    Stability: a rate at or above the saturation capacity (`saturation_capacity`) grows the
    queue without bound, however short a finite run makes it look, so the search stays below
    it. Below it, a rate meets the target when the simulated percentile latency of
    `num_requests` requests (fixed seed) is <= the target. The search bisects on a log scale
    between `min_qps` (default capacity / 64) and the capacity until the bracket is within
    `rel_tol`; it assumes the latency grows with the load, which holds up to the noise of one
    request sequence.
    An unreachable target is an answer, not an error: qps None and a reason.
    """
    if not _is_number(latency_target_s) or latency_target_s <= 0:
        raise ValueError(f"latency_target_s = {latency_target_s!r}; expected seconds > 0")
    if not _is_number(percentile) or not 0 < percentile <= 100:
        raise ValueError(f"percentile = {percentile!r}; expected a number in (0, 100]")
    if not _is_number(rel_tol) or not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol = {rel_tol!r}; expected a number in (0, 1)")
    if min_qps is not None and (not _is_number(min_qps) or min_qps <= 0):
        raise ValueError(f"min_qps = {min_qps!r}; expected an arrival rate > 0 requests per second")
    capacity = saturation_capacity(profile, max_batch, prompt_lengths, output_lengths, num_requests=num_requests, seed=seed)
    p = f"p{percentile:g}"
    trials: list[dict] = []

    def trial(qps: float) -> tuple[bool, SimulationResult]:
        run = simulate(profile, poisson_requests(qps, num_requests, prompt_lengths, output_lengths, seed), max_batch, seed=seed)
        latency = run.latency(percentile)
        trials.append({"qps": qps, "latency_s": latency, "meets_target": latency <= latency_target_s})
        return latency <= latency_target_s, run

    def result(qps, reason, run, limit):
        return LoadResult(
            profile.name, qps, reason, latency_target_s, percentile,
            run.latency(percentile) if run else None, run.tokens_per_s if run else None, capacity, limit, trials,
        )  # fmt: skip

    high = capacity.requests_per_s  # unstable at and above
    low = high / 64 if min_qps is None else min_qps
    if low >= high:
        return result(
            None,
            f"unreachable: min_qps {low:.3g} req/s is at or above the capacity of {high:.3g} req/s "
            f"(max batch {max_batch}); the queue would grow without bound",
            None, "unreachable",
        )  # fmt: skip
    ok, run = trial(low)
    if not ok:
        return result(
            None,
            f"unreachable: even at {low:.3g} req/s ({low / high:.1%} of capacity) the {p} latency is "
            f"{run.latency(percentile):.4g} s, above the {latency_target_s:.4g} s target; lower loads "
            "will not help much (a request cannot finish faster than its own decode): raise the target, "
            "shorten the answers or use a faster method",
            None, "unreachable",
        )  # fmt: skip
    best_run, failed = run, None
    while high / low > 1 + rel_tol:
        mid = math.sqrt(low * high)
        ok, run = trial(mid)
        if ok:
            low, best_run = mid, run
        else:
            high, failed = mid, run
    if failed is None:
        reason = (
            f"sustains {low:.3g} req/s ({best_run.tokens_per_s:.4g} tokens/s) with {p} latency "
            f"{best_run.latency(percentile):.4g} s <= {latency_target_s:.4g} s; the limit is capacity: "
            f"at {capacity.requests_per_s:.3g} req/s and above the queue grows without bound"
        )
        return result(low, reason, best_run, "capacity")
    reason = (
        f"sustains {low:.3g} req/s ({best_run.tokens_per_s:.4g} tokens/s) with {p} latency "
        f"{best_run.latency(percentile):.4g} s <= {latency_target_s:.4g} s; the limit is latency: at "
        f"{high:.3g} req/s the {p} latency is {failed.latency(percentile):.4g} s "
        f"(capacity {capacity.requests_per_s:.3g} req/s)"
    )
    return result(low, reason, best_run, "latency")


# ---------------------------------------------------------------------- crossover
@dataclass(frozen=True)
class Crossover:
    """Where speculation stops paying. `batch_size`: the first measured point with speedup
    <= 1 (None: it pays at every point); `crossing`: where the speedup line, linear between
    the measured points around it, crosses 1 (None when there is no such pair)."""

    batch_size: float | None
    crossing: float | None
    points: list[float]
    speedups: list[float]
    x_name: str
    method: str

    @property
    def sentence(self) -> str:
        return describe_crossover(self)


def crossover(
    batch_sizes: Sequence[float],
    baseline_tokens_per_s: Sequence[float],
    method_tokens_per_s: Sequence[float],
    *,
    method: str = "speculation",
    x_name: str = "batch size",
) -> Crossover:
    """The smallest batch size (or load: pass x_name="load (req/s)") at which the method's
    throughput is no longer above target-only decoding's (speedup <= 1).

    Batch sizes must be ints >= 1; other x values (loads) numbers > 0. Points are sorted."""
    xs, base, spec = list(batch_sizes), list(baseline_tokens_per_s), list(method_tokens_per_s)
    if not xs:
        raise ValueError("batch_sizes is empty; expected at least one measured point")
    if not len(xs) == len(base) == len(spec):
        raise ValueError(
            f"batch_sizes ({len(xs)}), baseline_tokens_per_s ({len(base)}) and method_tokens_per_s "
            f"({len(spec)}) must have the same length"
        )
    for x in xs:
        if x_name == "batch size":
            _check_batch(x, "batch size")
        elif not _is_number(x) or x <= 0:
            raise ValueError(f"{x_name} = {x!r}; expected a number > 0")
    if len(set(xs)) != len(xs):
        raise ValueError(f"{x_name} values repeat: {xs}")
    for name, values in (("baseline_tokens_per_s", base), ("method_tokens_per_s", spec)):
        for v in values:
            if not _is_number(v) or v <= 0:
                raise ValueError(f"{name} holds {v!r}; expected throughputs > 0 tokens/s")
    order = sorted(range(len(xs)), key=xs.__getitem__)
    xs = [xs[i] for i in order]
    speedups = [spec[i] / base[i] for i in order]
    stop = next((j for j, s in enumerate(speedups) if s <= 1.0), None)
    crossing = None
    if stop is not None and stop > 0:
        x0, x1, s0, s1 = xs[stop - 1], xs[stop], speedups[stop - 1], speedups[stop]
        crossing = x0 + (x1 - x0) * (s0 - 1.0) / (s0 - s1)
    return Crossover(xs[stop] if stop is not None else None, crossing, xs, speedups, x_name, method)


def describe_crossover(result: Crossover) -> str:
    """One plain sentence about a Crossover."""
    xs, s, name, m = result.points, result.speedups, result.x_name, result.method
    if result.batch_size is None:
        return (
            f"{m} pays at every measured {name} ({xs[0]:g} to {xs[-1]:g}): speedup {s[0]:.2f}x down to "
            f"{s[-1]:.2f}x; no crossover within the measured range."
        )
    j = xs.index(result.batch_size)
    if j == 0:
        return f"{m} does not pay at any measured {name}: speedup {s[0]:.2f}x already at {name} {xs[0]:g}."
    return (
        f"{m} stops paying at {name} {xs[j]:g} (speedup {s[j]:.2f}x there, {s[j - 1]:.2f}x at {xs[j - 1]:g}); "
        f"the speedup crosses 1.00x near {name} {result.crossing:.3g}."
    )


# ---------------------------------------------------------------------- cost
def cost_per_1k_tokens(tokens_per_s: float, price_per_hour: float) -> float:
    """Price of 1,000 output tokens on hardware rented at `price_per_hour` that serves
    `tokens_per_s` (use the throughput at the load you run at, e.g. `sustainable_load`'s)."""
    _check_rate_and_price(tokens_per_s, price_per_hour)
    return price_per_hour / 3600.0 / tokens_per_s * 1000.0


def cost_per_answer(tokens_per_s: float, price_per_hour: float, mean_output_tokens: float) -> float:
    """Price of one answer of `mean_output_tokens` tokens (prefill time is inside tokens_per_s
    when that comes from the simulator)."""
    _check_rate_and_price(tokens_per_s, price_per_hour)
    if not _is_number(mean_output_tokens) or mean_output_tokens <= 0:
        raise ValueError(f"mean_output_tokens = {mean_output_tokens!r}; expected a number of tokens > 0")
    return price_per_hour / 3600.0 / tokens_per_s * mean_output_tokens


def _check_rate_and_price(tokens_per_s, price_per_hour) -> None:
    if not _is_number(tokens_per_s) or tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s = {tokens_per_s!r}; expected a throughput > 0")
    if not _is_number(price_per_hour) or price_per_hour < 0:
        raise ValueError(f"price_per_hour = {price_per_hour!r}; expected a price >= 0")


__all__ = [
    "Capacity",
    "CostCurve",
    "Crossover",
    "LoadResult",
    "Request",
    "RequestResult",
    "SimulationResult",
    "StepProfile",
    "as_cost_curve",
    "batch1_step_seconds",
    "cost_per_1k_tokens",
    "cost_per_answer",
    "crossover",
    "describe_crossover",
    "histogram_from_alphas",
    "poisson_requests",
    "saturation_capacity",
    "simulate",
    "sustainable_load",
    "tokens_histogram",
]
