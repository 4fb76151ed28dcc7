"""What a serving-scale sweep is asked to measure (`SweepSettings`, from the `draftsmith eval`
flags) and how the prompts fill its batches (`batch_plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SIM_REQUESTS = 400  # requests per simulated stream: p99 rests on 4 of them; sustainable_load's default


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SweepSettings:
    """What `--batch-sizes`, `--qps`, `--latency-target`, `--percentile` and `--price-per-hour` ask."""

    batch_sizes: tuple[int, ...]
    qps: tuple[float, ...] = ()  # Poisson arrival rates to simulate (requests/s); () = none
    latency_target_s: float | None = None  # None: no sustainable-load search
    percentile: float = 90.0  # the latency percentile the target applies to
    price_per_hour: float | None = None  # None: no cost columns
    sim_requests: int = SIM_REQUESTS

    def __post_init__(self):
        sizes = list(self.batch_sizes)
        if not sizes:
            raise ValueError("batch_sizes is empty; expected batch sizes, e.g. 1,2,4,8")
        for b in sizes:
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise ValueError(f"batch size {b!r}; expected integers >= 1, e.g. 1,2,4,8")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"batch sizes {sizes} repeat a value; give each once")
        self.batch_sizes = tuple(sorted(sizes))
        for q in self.qps:
            if not _is_number(q) or q <= 0:
                raise ValueError(f"QPS {q!r}; expected arrival rates > 0 requests per second")
        if len(set(self.qps)) != len(self.qps):
            raise ValueError(f"QPS values {list(self.qps)} repeat a value; give each once")
        self.qps = tuple(sorted(float(q) for q in self.qps))
        if self.latency_target_s is not None and (not _is_number(self.latency_target_s) or self.latency_target_s <= 0):
            raise ValueError(f"latency target {self.latency_target_s!r}; expected seconds > 0")
        if not _is_number(self.percentile) or not 0 < self.percentile <= 100:
            raise ValueError(f"percentile {self.percentile!r}; expected a number in (0, 100]")
        if self.price_per_hour is not None and (not _is_number(self.price_per_hour) or self.price_per_hour < 0):
            raise ValueError(f"price per hour {self.price_per_hour!r}; expected a price >= 0")
        if not isinstance(self.sim_requests, int) or self.sim_requests < 1:
            raise ValueError(f"sim_requests {self.sim_requests!r}; expected an int >= 1")

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]


def batch_plan(num_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices of each batch at `batch_size`: every prompt once, the list cycled to fill
    the last batch (and the only one when batch_size > num_prompts)."""
    if num_prompts < 1 or batch_size < 1:
        raise ValueError(f"batch_plan({num_prompts}, {batch_size}): expected counts >= 1")
    batches = -(-num_prompts // batch_size)
    order = [i % num_prompts for i in range(batches * batch_size)]
    return [order[j * batch_size : (j + 1) * batch_size] for j in range(batches)]
