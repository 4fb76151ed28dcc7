"""What one engine serves: its saturation capacity, the highest Poisson load that keeps a latency
percentile within a target (`sustainable_load`), and what a token and an answer cost there."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftsmith.eval.serving.profile import StepProfile, _check_batch, _is_number
from draftsmith.eval.serving.simulator import Lengths, Request, SimulationResult, poisson_requests, simulate


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
    capacity = saturation_capacity(
        profile, max_batch, prompt_lengths, output_lengths, num_requests=num_requests, seed=seed
    )
    p = f"p{percentile:g}"
    trials: list[dict] = []

    def trial(qps: float) -> tuple[bool, SimulationResult]:
        requests = poisson_requests(qps, num_requests, prompt_lengths, output_lengths, seed)
        run = simulate(profile, requests, max_batch, seed=seed)
        latency = run.latency(percentile)
        trials.append({"qps": qps, "latency_s": latency, "meets_target": latency <= latency_target_s})
        return latency <= latency_target_s, run

    def result(qps, reason, run, limit):
        return LoadResult(
            profile.name,
            qps,
            reason,
            latency_target_s,
            percentile,
            run.latency(percentile) if run else None,
            run.tokens_per_s if run else None,
            capacity,
            limit,
            trials,
        )

    high = capacity.requests_per_s  # unstable at and above
    low = high / 64 if min_qps is None else min_qps
    if low >= high:
        return result(
            None,
            f"unreachable: min_qps {low:.3g} req/s is at or above the capacity of {high:.3g} req/s "
            f"(max batch {max_batch}); the queue would grow without bound",
            None,
            "unreachable",
        )
    ok, run = trial(low)
    if not ok:
        return result(
            None,
            f"unreachable: even at {low:.3g} req/s ({low / high:.1%} of capacity) the {p} latency is "
            f"{run.latency(percentile):.4g} s, above the {latency_target_s:.4g} s target; lower loads "
            "will not help much (a request cannot finish faster than its own decode): raise the target, "
            "shorten the answers or use a faster method",
            None,
            "unreachable",
        )
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
