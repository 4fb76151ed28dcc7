"""Where speculation stops paying: the first batch size (or load) at which a method's throughput
is no longer above target-only decoding's, and one sentence that says so."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draftsmith.eval.serving.profile import _check_batch, _is_number


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
