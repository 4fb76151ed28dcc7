"""Serving-scale evaluation: the "three A" of a drafter at the batch sizes a server runs.

    draftsmith eval --target T --draft D --drafter KIND=DIR --prompts P.jsonl --out runs/eval \\
        --batch-sizes 1,2,4,8 --qps 1,2,4 --latency-target 5 --price-per-hour 2.5

- Acceptance: alpha per draft position and tau (counting the bonus token), per drafter and,
  when the prompt rows carry a "task" field, per task (from the batch-1 evaluation,
  `eval/evaluator.py`, which this module extends and never replaces).
- Acceleration: tokens/s of target-only decoding and of every drafter (the decoding loop is
  batch-aware: chains, trees, prompt lookup and typical acceptance alike) at each batch size,
  on the same prompts cycled to fill the batches; the speedup over target-only at the same
  batch size, and the batch size where speculation stops paying.
- Attendance: how much load one engine serves. Each batched method's measured step cost per
  number of active rows, its tokens-per-step histogram and its prefill cost make a
  `StepProfile`; `eval/serving/` runs it as a continuous-batching server under Poisson
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

This module measures: v(n) (`measure_verify_curve`), one chain drafter for `draftsmith tune`
(`measure_chain`) and the batched sweep (`run_sweep`). The rest, in the order a sweep uses it:
- settings.py: `SweepSettings` (the flags) and `batch_plan` (the prompts cycled into batches);
- costs.py: a chain drafter's draft cost as `tune_chain` takes it, `typical_context`, and
  `ChainMeasurement`;
- analysis.py: the measured cells made tables, step profiles, simulated load and costs, and the
  three-A and per-task rows;
- report.py: `write_serving`, the figures, serving.json and the report's sections.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from draftsmith.decoding import BatchResult, DecodeStats, Drafter, generate, generate_batch
from draftsmith.decoding.kv import model_cache
from draftsmith.decoding.target import forward_seconds
from draftsmith.eval.evaluator import BASELINE, EvalSettings
from draftsmith.eval.sweep.analysis import _analyse, admission_cost, task_rows, three_a_rows
from draftsmith.eval.sweep.costs import (
    ChainMeasurement,
    chain_draft_seconds,
    chain_draft_seconds_from,
    draft_cost_per_step,
    typical_context,
)
from draftsmith.eval.sweep.report import crossover_sentences, display_rows, load_sentences, sections, write_serving
from draftsmith.eval.sweep.settings import SweepSettings, batch_plan
from draftsmith.eval.tune import tune_chain

VERIFY_REPEATS = 15  # timed forwards per size for v(n): the median of 15 shrugs off a few descheduled ones
WARMUP_NEW_TOKENS = 16  # the warm-up decode per method: long enough to touch every code path


# ---------------------------------------------------------------------- v(n) and one chain drafter
# measure_chain and run_sweep (through _tunings) find measure_verify_curve in this module, so
# replacing `draftsmith.eval.sweep.measure_verify_curve` (a fixed cost curve) reaches both.
@torch.inference_mode()
def measure_verify_curve(
    target,
    context: torch.Tensor,
    sizes: Sequence[int],
    *,
    hidden_layers: tuple[int, ...] = (),
    repeats: int = VERIFY_REPEATS,
    role: str = "target",
    capacity: int | None = None,
    compile: bool | str = False,
) -> dict[int, float]:
    """v(n): seconds of one target forward over n tokens appended to a real context, median of
    `repeats` device-synchronised timings per n (sizes interleaved within each repeat, so load
    noise hits every size alike; one untimed warm-up per size). The context minus its last
    max(sizes) tokens is prefilled once; each timed forward feeds the next n real tokens,
    computes all n logits (as a verification does) and is cropped away again.

    The forwards run on `model_cache(target, role, 1, capacity, compile)`: the growing cache by
    default, or the static cache the static / compiled decoding paths use (its compiled widths
    are those a decode or a `warm_up` made); `role` "draft" times a draft model's own cache."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes {list(sizes)}; expected token counts >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats {repeats!r}; expected an int >= 1")
    context = context.flatten()
    widest = sizes[-1]
    if context.numel() < widest + 1:
        raise ValueError(
            f"the context holds {context.numel()} tokens; measuring v({widest}) needs at least {widest + 1}"
        )
    device = target.device
    context = context.to(device)
    base = context.numel() - widest
    kv = model_cache(target, role, 1, capacity, compile)
    positions = torch.arange(context.numel(), device=device)[None]
    kv.forward(target, context[None, :base], positions[:, :base], logits_to_keep=1)
    kv.commit_spans(base)
    return forward_seconds(
        target, kv, context[None], positions, base, sizes, repeats=repeats, hidden_layers=hidden_layers
    )


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
            target,
            drafter,
            prompt,
            max_new_tokens=max_new_tokens,
            num_draft_tokens=k_max,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
            eos_token_id=eos,
        ).stats

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
        name=getattr(drafter, "name", "drafter"),
        k_max=k_max,
        alpha_per_position=pooled.alpha_per_position,
        tau=pooled.tau,
        target_calls=pooled.target_calls,
        drafts=sum(pooled.proposed),
        drafter_seconds=pooled.drafter_seconds,
        per_step=draft_cost_per_step(drafter),
        verify_seconds=verify,
    )


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
            target,
            [prompts[i] for i in indices],
            drafter,
            num_draft_tokens=settings.num_draft_tokens,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos,
            seed=seed,
            static_cache=settings.static_cache,
            compile=settings.compile,
        )
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
    chain = {
        name: d
        for name, d in drafters.items()
        if name in batched and name != BASELINE and getattr(d, "tree", None) is None
    }  # trees: tune_*_tree
    out["tuning"], out["verify_seconds"] = _tunings(target, chain, prompts, settings, report or {})
    return out


def _tunings(target, chain: Mapping[str, Drafter], prompts, settings: EvalSettings, report: Mapping):
    """The autotuner's prediction per K for every chain drafter of the batch-1 report: its
    measured alpha per position and draft cost, and a verify cost curve measured here."""
    by_name = {row["method"]: row for row in report.get("methods", [])}
    usable = {
        name: by_name[name]
        for name in chain
        if name in by_name
        and by_name[name].get("alpha_per_position")
        and not by_name[name].get("lossy")
        and by_name[name].get("target_calls")
    }
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


__all__ = [
    "ChainMeasurement",
    "SweepSettings",
    "admission_cost",
    "batch_plan",
    "chain_draft_seconds",
    "chain_draft_seconds_from",
    "crossover_sentences",
    "display_rows",
    "draft_cost_per_step",
    "load_sentences",
    "measure_chain",
    "measure_verify_curve",
    "run_sweep",
    "sections",
    "task_rows",
    "three_a_rows",
    "typical_context",
    "write_serving",
]
