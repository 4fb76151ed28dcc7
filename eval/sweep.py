"""Serving-scale evaluation: the "three A" of a drafter at the batch sizes a server runs.

    draftsmith eval --target T --draft D --eagle E --prompts P.jsonl --out runs/eval \\
        --batch-sizes 1,2,4,8 --qps 1,2,4 --latency-target 5 --price-per-hour 2.5

- Acceptance: alpha per draft position and tau (counting the bonus token), per drafter and,
  when the prompt rows carry a "task" field, per task (from the batch-1 evaluation,
  `eval/evaluator.py`, which this module extends and never replaces).
- Acceleration: tokens/s of target-only decoding and of every drafter that has a batched form
  (`eval/batched.py`: draft models, Medusa and EAGLE chains) at each batch size, on the same
  prompts cycled to fill the batches; the speedup over target-only at the same batch size,
  and the batch size where speculation stops paying. Trees, prompt lookup and Medusa's typical
  acceptance exist at batch 1 only: they keep their batch-1 numbers and the report says so.
- Attendance: how much load one engine serves. Each batched method's measured step cost per
  number of active rows, its tokens-per-step histogram and its prefill cost make a
  `StepProfile`; `eval/serving.py` runs it as a continuous-batching server under Poisson
  arrivals (--qps), finds the highest load that keeps the latency percentile under
  --latency-target, and prices tokens and answers at --price-per-hour.

Measurement rules (as in the batch-1 evaluator): a warm-up per method excluded; within a timed
pass every method runs the same batches in turn (interleaved, so machine noise hits all alike);
speedups are per-pass ratios, medians over passes; every timer synchronises the device
(`generate_batch` and `measure_verify_curve` do).

Files: `OUT/serving.json` (everything measured), `OUT/serving.md` (tables + PNG links) and a
self-contained `OUT/serving.html`, with acceptance.png, throughput_vs_batch.png,
latency_cdf.png (with --qps) and speedup_vs_k.png (the autotuner's prediction per K for every
chain drafter, from the measured acceptance, draft cost and verify cost curve). Every file is
written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from draftsmith.eval.runtime import BatchResult, DecodeStats, Drafter, MedusaDrafter, generate, generate_batch
from draftsmith.eval.runtime.kv import model_cache
from draftsmith.eval.runtime.target import synchronize
from draftsmith.eval.evaluator import BASELINE, EvalSettings
from draftsmith.eval.report import method_name, write_atomic
from draftsmith.eval.serving import (
    StepProfile,
    cost_per_1k_tokens,
    cost_per_answer,
    crossover,
    poisson_requests,
    saturation_capacity,
    simulate,
    sustainable_load,
    tokens_histogram,
)
from draftsmith.eval.stats import percentile
from draftsmith.eval.tune import tune_chain
from tqdm.auto import tqdm

SIM_REQUESTS = 400  # requests per simulated stream: p99 rests on 4 of them; sustainable_load's default
VERIFY_REPEATS = 15  # timed forwards per size for v(n): the median of 15 shrugs off a few descheduled ones
WARMUP_NEW_TOKENS = 16  # the warm-up decode per method: long enough to touch every code path


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


# ---------------------------------------------------------------------- cost measurements
@torch.inference_mode()
def measure_verify_curve(
    target, context: torch.Tensor, sizes: Sequence[int], *, hidden_layers: tuple[int, ...] = (), repeats: int = VERIFY_REPEATS
) -> dict[int, float]:
    """v(n): seconds of one target forward over n tokens appended to a real context, median of
    `repeats` device-synchronised timings per n (sizes interleaved within each repeat, so load
    noise hits every size alike; one untimed warm-up per size). The context minus its last
    max(sizes) tokens is prefilled once; each timed forward feeds the next n real tokens,
    computes all n logits (as a verification does) and is cropped away again."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes {list(sizes)}; expected token counts >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats {repeats!r}; expected an int >= 1")
    context = context.flatten()
    widest = sizes[-1]
    if context.numel() < widest + 1:
        raise ValueError(f"the context holds {context.numel()} tokens; measuring v({widest}) needs at least {widest + 1}")
    device = target.device
    context = context.to(device)
    base = context.numel() - widest
    kv = model_cache(target, "target", 1, None)
    positions = torch.arange(context.numel(), device=device)[None]
    kv.forward(target, context[None, :base], positions[:, :base], logits_to_keep=1)
    kv.commit_spans(base)

    def once(n: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        kv.forward(target, context[None, base : base + n], positions[:, base : base + n], hidden_layers=hidden_layers)
        synchronize(device)
        seconds = time.perf_counter() - t0
        kv.commit_spans(n, None, [0])  # kept by no row: cut again
        return seconds

    for n in sizes:
        once(n)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            samples[n].append(once(n))
    return {n: percentile(v, 50) for n, v in samples.items()}


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
    """True when the drafter's cost is per step whatever K (Medusa: every head in one forward),
    False when it grows with every drafted token (a draft model, an EAGLE chain)."""
    return isinstance(drafter, MedusaDrafter)


def chain_draft_seconds(drafter: Drafter, drafter_seconds: float, target_calls: int, drafts: int):
    """The draft cost for `tune_chain`: seconds per drafted token, or for a per-step drafter a
    function of K that is the same for every K >= 1."""
    return chain_draft_seconds_from(draft_cost_per_step(drafter), drafter_seconds, target_calls, drafts,
                                    getattr(drafter, "name", "drafter"))  # fmt: skip


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
    per_step: bool  # the draft cost is per step (Medusa), not per drafted token
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


def measure_chain(
    target,
    drafter: Drafter,
    prompts: Sequence[torch.Tensor],
    k_max: int,
    settings: EvalSettings,
    *,
    verify_sizes: Sequence[int] = (),
    eos_token_id=None,
    progress: bool = True,
) -> ChainMeasurement:
    """Decode every prompt once at K = k_max (after an untimed warm-up) for the acceptance per
    position and the draft cost, then measure v(n) for n = 1..k_max + 1 (and `verify_sizes`)."""
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max {k_max!r}; expected an int >= 1")
    if not prompts:
        raise ValueError("prompts is empty; expected at least one prompt")
    eos = None if settings.ignore_eos else eos_token_id

    def decode(prompt, seed, max_new_tokens):
        return generate(
            target, drafter, prompt, max_new_tokens=max_new_tokens, num_draft_tokens=k_max,
            temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, seed=seed, eos_token_id=eos,
        ).stats  # fmt: skip

    decode(prompts[0], settings.seed, min(WARMUP_NEW_TOKENS, settings.max_new_tokens))
    pooled = None
    for i, prompt in enumerate(tqdm(prompts, desc=f"acceptance at K={k_max}", unit="prompt", disable=not progress)):
        stats = decode(prompt, settings.seed + i, settings.max_new_tokens)
        pooled = stats if pooled is None else pooled + stats
    sizes = sorted(set(range(1, k_max + 2)) | {int(n) for n in verify_sizes})
    context = typical_context(prompts, settings.max_new_tokens, sizes[-1] + 1)
    layers = tuple(getattr(drafter, "target_layers", ()))
    verify = measure_verify_curve(target, context, sizes, hidden_layers=layers)
    return ChainMeasurement(
        name=getattr(drafter, "name", "drafter"), k_max=k_max, alpha_per_position=pooled.alpha_per_position,
        tau=pooled.tau, target_calls=pooled.target_calls, drafts=sum(pooled.proposed),
        drafter_seconds=pooled.drafter_seconds, per_step=draft_cost_per_step(drafter), verify_seconds=verify,
    )  # fmt: skip


# ---------------------------------------------------------------------- the sweep
@dataclass
class _Cell:
    """One method at one batch size: what every pass measured."""

    batch_size: int
    rows: int = 0  # decoded rows per pass (prompts cycled)
    tokens_per_pass: list[int] = field(default_factory=list)
    seconds_per_pass: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # per row: batch start -> its last token
    ttfts: list[float] = field(default_factory=list)  # per row: batch start -> its first token
    stats: DecodeStats | None = None  # every row of every pass pooled
    steps: dict[int, list[float]] = field(default_factory=dict)  # active rows -> step seconds
    # per batch: (prompt tokens, prefill seconds, first step seconds, rows at the first step)
    admissions: list[tuple[int, float, float, int]] = field(default_factory=list)
    row_tokens: list[int] = field(default_factory=list)  # first pass: tokens per row, in plan order

    def add(self, result: BatchResult, prompt_tokens: int, first_pass: bool) -> None:
        self.latencies += result.finish_seconds
        self.ttfts += result.ttft_seconds
        stats = result.stats
        self.stats = stats if self.stats is None else self.stats + stats
        for rows, verify, draft in zip(result.call_rows, result.call_seconds, result.drafter_seconds):
            self.steps.setdefault(rows, []).append(verify + draft)
        first = result.call_seconds[0] + result.drafter_seconds[0]
        self.admissions.append((prompt_tokens, result.prefill_seconds, first, result.call_rows[0]))
        if first_pass:
            self.row_tokens += [len(t) for t in result.tokens]

    @property
    def tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens_per_pass, self.seconds_per_pass)]


def run_sweep(
    target,
    drafters: Mapping[str, Drafter],
    prompts: Sequence[torch.Tensor],
    settings: EvalSettings,
    sweep: SweepSettings,
    *,
    report: Mapping | None = None,
    eos_token_id=None,
    progress: bool = True,
) -> dict:
    """Measure every method at every batch size, build the serving analysis, return it as a
    JSON-ready dict (`write_serving` writes it). `report`: the batch-1 report of the same
    methods (`evaluate`), for acceptance, per-task rows, the batch-1-only methods and the
    autotuner's draft costs."""
    if BASELINE in drafters:
        raise ValueError(f"{BASELINE!r} is the baseline's name; pick another method name")
    if not prompts:
        raise ValueError("prompts is empty; expected at least one prompt")
    eos = None if settings.ignore_eos else eos_token_id
    sampling = settings.sampling
    batched, batch1_only = {BASELINE: None}, {}
    for name, drafter in drafters.items():  # every drafter is batch-aware: chains, trees, lookup
        batched[name] = drafter

    compiling = [0.0]  # the fast path's compile time, outside every timing

    def decode(drafter, indices, seed, max_new_tokens):
        result = generate_batch(
            target, [prompts[i] for i in indices], drafter, num_draft_tokens=settings.num_draft_tokens,
            max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos, seed=seed,
            static_cache=settings.static_cache, compile=settings.compile,
        )  # fmt: skip
        compiling[0] += result.compile_seconds
        return result

    plans = {b: batch_plan(len(prompts), b) for b in sweep.batch_sizes}
    warm = plans[sweep.max_batch][0]
    for drafter in batched.values():  # warm-up: allocator, kernels, lazy init (excluded)
        decode(drafter, warm, settings.seed, min(WARMUP_NEW_TOKENS, settings.max_new_tokens))

    cells = {name: {b: _Cell(b) for b in sweep.batch_sizes} for name in batched}
    total = settings.repeats * len(batched) * sum(len(p) for p in plans.values())
    bar = tqdm(total=total, desc="sweep", unit="batch", disable=not progress)
    for rep in range(settings.repeats):
        for b in sweep.batch_sizes:
            tally = {name: [0, 0.0] for name in batched}
            for j, indices in enumerate(plans[b]):
                prompt_tokens = sum(prompts[i].numel() for i in indices)
                for name, drafter in batched.items():  # interleaved: the same batch, method after method
                    bar.set_postfix_str(f"pass {rep + 1}/{settings.repeats} batch {b} {name}")
                    result = decode(drafter, indices, settings.seed + 1000 * rep + j, settings.max_new_tokens)
                    cells[name][b].add(result, prompt_tokens, rep == 0)
                    tally[name][0] += result.new_tokens
                    tally[name][1] += result.total_seconds
                    bar.update()
            for name, (tokens, seconds) in tally.items():
                cell = cells[name][b]
                cell.rows = len(plans[b]) * b
                cell.tokens_per_pass.append(tokens)
                cell.seconds_per_pass.append(seconds)
    bar.close()

    out = _analyse(cells, batch1_only, prompts, plans, settings, sweep, report or {})
    out["compile_seconds"] = compiling[0]
    chain = {name: d for name, d in drafters.items() if name in batched and name != BASELINE}
    out["tuning"], out["verify_seconds"] = _tunings(target, chain, prompts, settings, report or {})
    return out


# ---------------------------------------------------------------------- analysis
def _median(values) -> float:
    return percentile(values, 50) if values else math.nan


def _analyse(cells, batch1_only, prompts, plans, settings: EvalSettings, sweep: SweepSettings, report) -> dict:
    sizes = list(sweep.batch_sizes)
    base = cells[BASELINE]
    methods: dict[str, dict] = {}
    prompt_lengths = [p.numel() for p in prompts]
    # The answers' lengths: target-only rows at the smallest batch size (each prompt once, in
    # plan order); lossless methods produce the same answers.
    smallest = base[sizes[0]]
    output_lengths = smallest.row_tokens[: len(prompts)]
    for name, by_size in cells.items():
        rows = []
        for b in sizes:
            cell, ref = by_size[b], base[b]
            speedups = [m / r for m, r in zip(cell.tokens_per_s, ref.tokens_per_s)]
            stats = cell.stats
            full = cell.steps.get(b, [])
            row = {
                "batch_size": b,
                "rows_per_pass": cell.rows,
                "new_tokens_per_pass": cell.tokens_per_pass,
                "new_tokens": stats.new_tokens,
                "target_calls": stats.target_calls,
                "tokens_per_s": _median(cell.tokens_per_s),
                "tokens_per_s_per_pass": cell.tokens_per_s,
                "speedup": _median(speedups),
                "speedup_per_pass": speedups,
                "tau": stats.tau,
                "alpha": stats.alpha if sum(stats.reached) else None,
                "latency_s_p50": percentile(cell.latencies, 50),
                "latency_s_p90": percentile(cell.latencies, 90),
                "latency_s_p99": percentile(cell.latencies, 99),
                "ttft_s_p50": percentile(cell.ttfts, 50),
                "ttft_s_p90": percentile(cell.ttfts, 90),
                "step_ms_full_batch": 1000 * _median(full) if full else None,
            }
            if sweep.price_per_hour is not None and row["tokens_per_s"] > 0:
                row["usd_per_1k_tokens"] = cost_per_1k_tokens(row["tokens_per_s"], sweep.price_per_hour)
            rows.append(row)
        pooled = None
        for b in sizes:
            pooled = by_size[b].stats if pooled is None else pooled + by_size[b].stats
        steps: dict[int, list[float]] = {}
        for b in sizes:
            for active, seconds in by_size[b].steps.items():
                steps.setdefault(active, []).extend(seconds)
        step_seconds = {r: _median(v) for r, v in sorted(steps.items())}
        per_request, per_token = admission_cost(by_size[sizes[0]].admissions, step_seconds)
        profile = StepProfile(name, step_seconds, tokens_histogram(pooled.accepted),
                              prefill_seconds_per_token=per_token, prefill_seconds_per_request=per_request)  # fmt: skip
        entry = {
            "batched": True,
            "batches": rows,
            "step_seconds": {str(r): s for r, s in step_seconds.items()},
            "step_samples": {str(r): len(v) for r, v in sorted(steps.items())},
            "tokens_per_step": {str(n): p for n, p in profile.tokens_per_step.items()},
            "mean_tokens_per_step": profile.mean_tokens_per_step,
            "prefill_seconds_per_request": per_request,
            "prefill_seconds_per_token": per_token,
            "sweep_acceptance": {
                "new_tokens": pooled.new_tokens,
                "target_calls": pooled.target_calls,
                "tau": pooled.tau,
                "alpha": pooled.alpha if sum(pooled.reached) else None,
                "alpha_per_position": pooled.alpha_per_position,
            },
        }
        if name != BASELINE:
            # On the table's own speedups (medians of per-pass ratios), so sentence and table agree.
            cross = crossover(sizes, [1.0] * len(sizes), [r["speedup"] for r in rows], method=name)
            entry["crossover"] = {"batch_size": cross.batch_size, "crossing": cross.crossing, "sentence": cross.sentence}
        entry.update(_attendance(profile, prompt_lengths, output_lengths, sweep))
        entry["_profile"] = profile  # dropped before writing; the latency CDF reads the runs
        methods[name] = entry
    for name, reason in batch1_only.items():
        methods[name] = {"batched": False, "reason": f"batch 1 only: {reason}"}

    return {
        "settings": {
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(sweep).items()},
            "max_batch": sweep.max_batch,
            "num_draft_tokens": settings.num_draft_tokens,
            "max_new_tokens": settings.max_new_tokens,
            "mode": settings.sampling.describe(),
            "ignore_eos": settings.ignore_eos,
            "repeats": settings.repeats,
            "path": "compiled" if settings.compile else ("static cache" if settings.static_cache else "default"),
            "num_prompts": len(prompts),
            "batches_per_size": {str(b): len(plans[b]) for b in sizes},
        },
        "prompt_lengths": prompt_lengths,
        "output_lengths": output_lengths,
        "methods": methods,
        "three_a": three_a_rows(methods, report, sweep),
        "tasks": task_rows(report),
    }


def admission_cost(admissions, step_seconds: Mapping[int, float]) -> tuple[float, float]:
    """(seconds per request, seconds per prompt token) of admitting a request, fitted by least
    squares over batches of one size. A batch's admission cost is its prefill plus what its first
    step cost beyond a usual step at that many rows: a draft model or an EAGLE head reads the
    prompt in its first proposal, which the median step cost leaves out. Batches of B requests
    share the fitted per-batch intercept (per request = intercept / B). Both are floored at 0;
    with one distinct prompt length the cost is all per token."""
    if not admissions:
        raise ValueError("no batches measured: no admission cost to fit")
    xs = [float(tokens) for tokens, _, _, _ in admissions]
    ys = [prefill + max(0.0, first - step_seconds[rows]) for _, prefill, first, rows in admissions]
    rows = admissions[0][3]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        return 0.0, my / mx
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope <= 0:  # noise swamps the prompt length: a fixed cost per batch
        return my / rows, 0.0
    intercept = my - slope * mx
    if intercept < 0:  # all of it proportional to the prompt
        return 0.0, sum(ys) / sum(xs)
    return intercept / rows, slope


def _attendance(profile: StepProfile, prompt_lengths, output_lengths, sweep: SweepSettings) -> dict:
    """Capacity, the simulated streams, the sustainable load and the costs of one method."""
    out: dict = {}
    capacity = saturation_capacity(profile, sweep.max_batch, prompt_lengths, output_lengths, num_requests=sweep.sim_requests)
    out["capacity"] = asdict(capacity)
    runs = {}
    sims = []
    for qps in sweep.qps:
        run = simulate(profile, poisson_requests(qps, sweep.sim_requests, prompt_lengths, output_lengths), sweep.max_batch)
        runs[qps] = run
        summary = {"qps": qps, **run.summary(), "stable": qps < capacity.requests_per_s}
        summary.pop("method", None)
        if sweep.price_per_hour is not None:
            summary["usd_per_1k_tokens"] = cost_per_1k_tokens(run.tokens_per_s, sweep.price_per_hour)
        sims.append(summary)
    out["simulations"] = sims
    out["_runs"] = runs
    if sweep.latency_target_s is not None:
        load = sustainable_load(
            profile, sweep.latency_target_s, sweep.percentile, max_batch=sweep.max_batch,
            prompt_lengths=prompt_lengths, output_lengths=output_lengths, num_requests=sweep.sim_requests,
        )  # fmt: skip
        out["sustainable"] = {
            "qps": load.qps, "reason": load.reason, "limit": load.limit, "latency_s": load.latency_s,
            "tokens_per_s": load.tokens_per_s, "latency_target_s": load.latency_target_s, "percentile": load.percentile,
        }  # fmt: skip
    if sweep.price_per_hour is not None:
        price, mean_out = sweep.price_per_hour, capacity.mean_output_tokens
        cost = {
            "at_capacity_usd_per_1k_tokens": cost_per_1k_tokens(capacity.tokens_per_s, price),
            "at_capacity_usd_per_answer": cost_per_answer(capacity.tokens_per_s, price, mean_out),
        }
        sustained = out.get("sustainable")
        if sustained and sustained["qps"] is not None:
            cost["at_sustainable_load_usd_per_1k_tokens"] = cost_per_1k_tokens(sustained["tokens_per_s"], price)
            cost["at_sustainable_load_usd_per_answer"] = cost_per_answer(sustained["tokens_per_s"], price, mean_out)
        out["cost"] = cost
    return out


def _pays(entry: dict, sizes: list[int]) -> str:
    cross = entry.get("crossover")
    if not cross:
        return "-"
    if cross["batch_size"] is None:
        return f"at every batch size ({sizes[0]}-{sizes[-1]})"
    if cross["batch_size"] == sizes[0]:
        return "never"
    below = max(b for b in sizes if b < cross["batch_size"])
    return f"up to batch {below} (1.00x near {cross['crossing']:.3g})"


def three_a_rows(methods: Mapping[str, dict], report: Mapping, sweep: SweepSettings) -> list[dict]:
    """One row per method: Acceptance (alpha, tau at batch 1), Acceleration (speedup at batch 1
    from the decoder, then at each batch size, and where it stops paying), Attendance (the load
    one engine sustains within the latency target, and its capacity) and cost."""
    by_name = {row["method"]: row for row in report.get("methods", [])}
    sizes = list(sweep.batch_sizes)
    p = f"p{sweep.percentile:g}"
    rows = []
    for name in [BASELINE] + [n for n in methods if n != BASELINE]:
        entry, b1 = methods[name], by_name.get(name, {})
        label = method_name(b1) if b1 else name
        row = {"method": label, "alpha": b1.get("alpha"), "tau": b1.get("tau", 1.0 if name == BASELINE else None)}
        row["speedup b=1 (decoder)"] = b1.get("speedup")
        by_size = {r["batch_size"]: r for r in entry.get("batches", [])}
        for b in sizes:
            row[f"speedup b={b}"] = by_size[b]["speedup"] if b in by_size else None
        row["pays"] = _pays(entry, sizes) if entry["batched"] else "batch 1 only"
        if sweep.latency_target_s is not None:
            sustained = entry.get("sustainable")
            key = f"req/s at {p} <= {sweep.latency_target_s:g} s"
            row[key] = (sustained["qps"] if sustained["qps"] is not None else "unreachable") if sustained else None
        capacity = entry.get("capacity")
        row[f"capacity req/s (batch {sweep.max_batch})"] = capacity["requests_per_s"] if capacity else None
        cost = entry.get("cost")
        if sweep.price_per_hour is not None:
            at_load = cost and cost.get("at_sustainable_load_usd_per_1k_tokens")
            row["$/1k tokens"] = at_load if at_load is not None else (cost["at_capacity_usd_per_1k_tokens"] if cost else None)
            row["$/answer"] = (
                cost.get("at_sustainable_load_usd_per_answer", cost["at_capacity_usd_per_answer"]) if cost else None
            )
        rows.append(row)
    return rows


def task_rows(report: Mapping) -> list[dict]:
    """Per (method, task) rows of the batch-1 report (empty when the prompts carry no task)."""
    rows = []
    for row in report.get("methods", []):
        for t in row.get("tasks", []):
            rows.append({
                "method": method_name(row), "task": t["task"], "prompts": t["prompts"], "new_tokens": t["new_tokens"],
                "target_calls": t["target_calls"], "alpha": t["alpha"], "tau": t["tau"], "speedup": t["speedup"],
            })  # fmt: skip
    return rows


def _tunings(target, chain: Mapping[str, Drafter], prompts, settings: EvalSettings, report: Mapping):
    """The autotuner's prediction per K for every chain drafter of the batch-1 report: its
    measured alpha per position and draft cost, and a verify cost curve measured here."""
    by_name = {row["method"]: row for row in report.get("methods", [])}
    usable = {
        name: by_name[name] for name in chain
        if name in by_name and by_name[name].get("alpha_per_position") and not by_name[name].get("lossy")
        and by_name[name].get("target_calls")
    }  # fmt: skip
    if not usable:
        return {}, {}
    k = settings.num_draft_tokens
    layers = tuple(sorted({i for name in usable for i in getattr(chain[name], "target_layers", ())}))
    context = typical_context(prompts, settings.max_new_tokens, k + 2)
    verify = measure_verify_curve(target, context, range(1, k + 2), hidden_layers=layers)
    tunings = {}
    for name, row in usable.items():
        drafts = round(row["mean_drafts_per_call"] * row["target_calls"])
        draft = chain_draft_seconds(chain[name], row["drafter_seconds"], row["target_calls"], drafts)
        tuning = tune_chain(row, draft, verify)
        tunings[name] = {"tuning": tuning, "measured_speedup": {k: row["speedup"]}}
    return tunings, {str(n): s for n, s in verify.items()}


# ---------------------------------------------------------------------- writing
def _json_ready(serving: dict) -> dict:
    out = dict(serving)
    out["methods"] = {
        name: {k: v for k, v in entry.items() if not k.startswith("_")} for name, entry in serving["methods"].items()
    }
    out["tuning"] = {
        name: {
            "chosen": t["tuning"].setting(),
            "candidates": t["tuning"].rows(),
            "model": t["tuning"].model,
            "notes": t["tuning"].notes,
            "measured_speedup": {str(k): v for k, v in t["measured_speedup"].items()},
        }
        for name, t in serving.get("tuning", {}).items()
    }
    return out


def crossover_sentences(serving: Mapping) -> list[str]:
    """One plain sentence per drafter: where speculation stops paying, or why it was not measured."""
    out = []
    for name, entry in serving["methods"].items():
        if name == BASELINE:
            continue
        out.append(entry["crossover"]["sentence"] if entry["batched"] else f"{name}: {entry['reason']}.")
    return out


def load_sentences(serving: Mapping) -> list[str]:
    return [f"{name}: {e['sustainable']['reason']}" for name, e in serving["methods"].items() if e.get("sustainable")]


def write_serving(serving: dict, out_dir, *, title: str = "draftsmith serving analysis", report: Mapping | None = None) -> list[Path]:
    """Figures, serving.json, serving.md and serving.html into out_dir; returns the paths."""
    from draftsmith.eval.plots import (
        acceptance_series,
        plot_acceptance,
        plot_latency_cdf,
        plot_speedup_vs_k,
        plot_throughput_vs_batch,
        write_serving_report,
    )

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{str(out_dir)!r} exists and is not a folder")
    s = serving["settings"]
    methods = serving["methods"]
    batched = {n: e for n, e in methods.items() if e["batched"]}
    written: list[Path] = []
    figures: dict[str, Path] = {}

    series = acceptance_series(report) if report and report.get("methods") else {}
    if series:
        figures["acceptance"] = plot_acceptance(series, out_dir / "acceptance.png",
                                                title=f"acceptance by draft position (batch 1, {s['mode']})")  # fmt: skip
    curves = {n: {r["batch_size"]: r["tokens_per_s"] for r in e["batches"]} for n, e in batched.items()}
    baseline = curves.pop(BASELINE)
    if curves:
        figures["throughput"] = plot_throughput_vs_batch(curves, baseline, out_dir / "throughput_vs_batch.png")
    if s["qps"]:
        top = s["qps"][-1]
        runs = {n: e["_runs"][top] for n, e in batched.items() if "_runs" in e}
        figures["latency"] = plot_latency_cdf(runs, out_dir / "latency_cdf.png",
                                              title=f"request latency, simulated at {top:g} req/s (max batch {s['max_batch']})")  # fmt: skip
    tunings = serving.get("tuning") or {}
    if tunings:
        figures["speedup_vs_k"] = plot_speedup_vs_k(
            {n: t["tuning"] for n, t in tunings.items()}, out_dir / "speedup_vs_k.png",
            measured={n: t["measured_speedup"] for n, t in tunings.items()},
        )  # fmt: skip
    written += list(figures.values())
    serving["figures"] = {k: p.name for k, p in figures.items()}

    json_path = out_dir / "serving.json"
    write_atomic(json_path, json.dumps(_json_ready(serving), indent=2, allow_nan=True) + "\n")
    md, page = write_serving_report(out_dir, *sections(serving, figures, report), title=title)
    return written + [json_path, md, page]


def display_rows(rows: list[dict]) -> list[dict]:
    """Rows for the Markdown/HTML tables: prices (keys with "$") as dollars to 3 significant
    digits, since a cent per thousand tokens would print as 0.000."""
    return [{k: (f"${v:.3g}" if "$" in k and _is_number(v) else v) for k, v in row.items()} for row in rows]


def _fmt_hist(hist: Mapping[str, float]) -> str:
    return ", ".join(f"{n}: {p:.2f}" for n, p in hist.items())


def sections(serving: Mapping, figures: Mapping[str, Path], report: Mapping | None):
    """The serving report's sections, in reading order."""
    from draftsmith.eval.plots import Section

    s = serving["settings"]
    methods = serving["methods"]
    batched = {n: e for n, e in methods.items() if e["batched"]}
    sizes = s["batch_sizes"]
    p = f"p{s['percentile']:g}"
    out = []
    intro = (
        f"Mode: {s['mode']} (lossless: every method emits the target's own distribution). K = {s['num_draft_tokens']}, "
        f"{s['num_prompts']} prompts x up to {s['max_new_tokens']} new tokens, batch sizes {', '.join(map(str, sizes))} "
        f"(prompts cycled to fill each batch), {s['repeats']} timed passes. tau counts the bonus token "
        "(target-only = 1.00). Speedup: tokens/s over target-only tokens/s at the same batch size in the same pass, "
        "median over passes."
    )
    if s.get("path", "default") != "default":
        intro += (
            f" Decoding path: {s['path']} (a preallocated KV cache of fixed batch: finished rows stay as padding rows)"
            + (f"; compile time {serving.get('compile_seconds', 0.0):.1f} s, not in any timing." if s["path"] == "compiled" else ".")
        )
    three = (
        "Acceptance: alpha and tau of the batch-1 evaluation. Acceleration: speedup at each batch size. Attendance: "
        f"the highest Poisson load one engine (max batch {max(sizes)}) serves with the {p} request latency within "
        "the target, simulated from the measured step costs."
    )
    text = [intro, three]
    text += crossover_sentences(serving)
    text += load_sentences(serving)
    out.append(Section("The three A: Acceptance, Acceleration, Attendance", "\n\n".join(text), rows=display_rows(serving["three_a"])))

    if report and report.get("methods"):
        rows = [
            {"method": method_name(r), **{f"alpha_{i + 1}": a for i, a in enumerate(r["alpha_per_position"])}, "tau": r["tau"]}
            for r in report["methods"] if r.get("alpha_per_position")
        ]  # fmt: skip
        images = [figures["acceptance"]] if "acceptance" in figures else []
        if rows:
            out.append(Section("Acceptance by draft position", "alpha_i: acceptance of draft i given drafts 1..i-1 "
                               "were accepted (batch 1; trees: per depth).", rows=rows, images=images))  # fmt: skip
    if serving.get("tasks"):
        out.append(Section(
            "Per task", "Batch-1 counters per task of the prompt rows; a method's new_tokens and target_calls over its "
            "tasks sum to its totals. speedup: the task's tokens/s over target-only's on the same prompts.",
            rows=serving["tasks"], breakdown="tau",
        ))  # fmt: skip

    rows = []
    for name, e in batched.items():
        for r in e["batches"]:
            row = {"method": name, "batch": r["batch_size"], "tokens/s": r["tokens_per_s"], "speedup": r["speedup"],
                   "tau": r["tau"], "latency p50 s": r["latency_s_p50"], "p90 s": r["latency_s_p90"],
                   "p99 s": r["latency_s_p99"], "TTFT p50 s": r["ttft_s_p50"], "step ms (full batch)": r["step_ms_full_batch"]}  # fmt: skip
            if "usd_per_1k_tokens" in r:
                row["$/1k tokens"] = r["usd_per_1k_tokens"]
            rows.append(row)
    text = ("Static batches: every row of a batch starts together; latency and TTFT are per request from the batch's "
            "start.\n\n" + "\n\n".join(crossover_sentences(serving)))  # fmt: skip
    out.append(Section("Acceleration: throughput vs batch size", text, rows=display_rows(rows),
                       images=[figures["throughput"]] if "throughput" in figures else []))  # fmt: skip

    actives = sorted({int(r) for e in batched.values() for r in e["step_seconds"]})
    rows = []
    for name, e in batched.items():
        row = {"method": name, "tokens/step": _fmt_hist(e["tokens_per_step"]), "mean": e["mean_tokens_per_step"],
               "admission ms/request": 1000 * e["prefill_seconds_per_request"],
               "admission ms/prompt token": 1000 * e["prefill_seconds_per_token"]}  # fmt: skip
        for a in actives:
            row[f"{a} rows ms"] = 1000 * e["step_seconds"][str(a)] if str(a) in e["step_seconds"] else None
        rows.append(row)
    out.append(Section(
        "Engine step cost (the simulator's input)",
        "One engine step (drafting + verification) in ms per number of active rows, medians of every step measured at "
        "that many rows; tokens per step: the share of steps in which a row gained n tokens. Admission: what a new "
        "request adds to the step that admits it (the target's prefill, and what the first step costs beyond a usual "
        "one: a draft model or EAGLE head reading the prompt), fitted per request + per prompt token on the smallest "
        "batch size.", rows=rows,
    ))  # fmt: skip

    tunings = serving.get("tuning") or {}
    if tunings:
        rows = [{"method": n, **c} for n, t in tunings.items() for c in t["tuning"].rows()]
        verify = ", ".join(f"v({n}) {1000 * v:.2f}" for n, v in serving["verify_seconds"].items())
        out.append(Section(
            "Speedup vs K (autotuner)",
            "Predicted batch-1 speedup per K from the measured alpha per position, draft cost and verify cost curve "
            f"(ms: {verify}); cross: the measured speedup at K = {s['num_draft_tokens']}. `draftsmith tune` measures "
            "up to a larger K and records the choice.", rows=rows, images=[figures["speedup_vs_k"]] if "speedup_vs_k" in figures else [],
        ))  # fmt: skip

    rows = []
    for name, e in batched.items():
        for sim in e.get("simulations", []):
            row = {"method": name, "req/s": sim["qps"], "stable": sim["stable"], "tokens/s": sim["tokens_per_s"],
                   "mean batch": sim["mean_batch"], "latency p50 s": sim["latency_s_p50"], "p90 s": sim["latency_s_p90"],
                   "p99 s": sim["latency_s_p99"], "TTFT p50 s": sim["ttft_s_p50"], "queue p90 s": sim["queue_s_p90"]}  # fmt: skip
            if "usd_per_1k_tokens" in sim:
                row["$/1k tokens"] = sim["usd_per_1k_tokens"]
            rows.append(row)
    capacity = "; ".join(f"{n} {e['capacity']['requests_per_s']:.3g} req/s ({e['capacity']['tokens_per_s']:.4g} tokens/s)"
                         for n, e in batched.items())  # fmt: skip
    text = (f"Continuous batching simulated from the measured step costs ({s['sim_requests']} Poisson requests per "
            f"rate, prompt and answer lengths drawn from the measured ones, max batch {max(sizes)}). Capacity (every "
            f"slot busy): {capacity}. A rate at or above capacity is not stable: its queue grows without bound.")  # fmt: skip
    loads = load_sentences(serving)
    if loads:
        text += "\n\n" + "\n\n".join(loads)
    if rows or loads:
        out.append(Section("Attendance: simulated load", text, rows=display_rows(rows) or None,
                           images=[figures["latency"]] if "latency" in figures else []))  # fmt: skip

    if s["price_per_hour"] is not None:
        rows = []
        for name, e in batched.items():
            c = e["cost"]
            rows.append({"method": name, "$/1k tokens at capacity": c["at_capacity_usd_per_1k_tokens"],
                         "$/answer at capacity": c["at_capacity_usd_per_answer"],
                         "$/1k tokens at sustainable load": c.get("at_sustainable_load_usd_per_1k_tokens"),
                         "$/answer at sustainable load": c.get("at_sustainable_load_usd_per_answer")})  # fmt: skip
        out.append(Section(
            "Cost", f"At ${s['price_per_hour']:g} per hour for the engine; an answer is the mean measured answer "
            "length. At the sustainable load the engine idles part of the time, so its tokens cost more.", rows=display_rows(rows),
        ))  # fmt: skip
    return out


__all__ = [
    "ChainMeasurement",
    "SweepSettings",
    "admission_cost",
    "batch_plan",
    "chain_draft_seconds",
    "crossover_sentences",
    "display_rows",
    "draft_cost_per_step",
    "load_sentences",
    "measure_chain",
    "measure_verify_curve",
    "run_sweep",
    "three_a_rows",
    "typical_context",
    "write_serving",
]
