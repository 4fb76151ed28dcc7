"""The continuous-batching load simulator: Poisson request streams and `simulate`.

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

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from draftsmith.eval.serving.profile import StepProfile, _check_batch, _is_number, check_items
from draftsmith.eval.stats import percentile as _percentile

Lengths = int | Sequence[int]  # a fixed length, or measured lengths to draw from (uniformly)


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


def poisson_requests(
    qps: float, n: int, prompt_lengths: Lengths, output_lengths: Lengths, seed: int = 0
) -> list[Request]:
    """`n` requests arriving as a Poisson process of rate `qps` (exponential gaps, the first
    one after a gap too); lengths fixed or drawn uniformly from measured lengths.

    The same seed gives the same uniforms at every rate: arrival times scale as 1 / qps and the
    lengths stay the same, so loads are compared on one request sequence."""
    if not _is_number(qps) or qps <= 0:
        raise ValueError(f"qps = {qps!r}; expected an arrival rate > 0 requests per second")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n = {n!r}; expected a number of requests >= 1")
    prompt = _length_sampler(prompt_lengths, "prompt_lengths")
    output = _length_sampler(output_lengths, "output_lengths")
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
    requests = check_items(requests, Request, "requests")
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
    return SimulationResult(
        profile.name, max_batch, results, steps, busy, row_seconds, backlog_s, backlog_tokens, max_waiting
    )
