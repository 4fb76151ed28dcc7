"""The serving analysis of the measured cells: per method and batch size the throughput, speedup,
acceptance and latencies; the engine step costs and admission cost that make its `StepProfile`;
its simulated load, sustainable load and costs (`eval/serving`); the three-A and per-task rows."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict

from draftsmith.eval.evaluator import BASELINE, EvalSettings
from draftsmith.eval.report import method_name
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
from draftsmith.eval.sweep.settings import SweepSettings


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
        profile = StepProfile(
            name,
            step_seconds,
            tokens_histogram(pooled.accepted),
            prefill_seconds_per_token=per_token,
            prefill_seconds_per_request=per_request,
        )
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
            entry["crossover"] = {
                "batch_size": cross.batch_size,
                "crossing": cross.crossing,
                "sentence": cross.sentence,
            }
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
    step cost beyond a usual step at that many rows: a draft model or a drafter head reads the
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
    capacity = saturation_capacity(
        profile, sweep.max_batch, prompt_lengths, output_lengths, num_requests=sweep.sim_requests
    )
    out["capacity"] = asdict(capacity)
    runs = {}
    sims = []
    for qps in sweep.qps:
        requests = poisson_requests(qps, sweep.sim_requests, prompt_lengths, output_lengths)
        run = simulate(profile, requests, sweep.max_batch)
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
            profile,
            sweep.latency_target_s,
            sweep.percentile,
            max_batch=sweep.max_batch,
            prompt_lengths=prompt_lengths,
            output_lengths=output_lengths,
            num_requests=sweep.sim_requests,
        )
        out["sustainable"] = {
            "qps": load.qps,
            "reason": load.reason,
            "limit": load.limit,
            "latency_s": load.latency_s,
            "tokens_per_s": load.tokens_per_s,
            "latency_target_s": load.latency_target_s,
            "percentile": load.percentile,
        }
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
            row["$/1k tokens"] = (
                at_load if at_load is not None else (cost["at_capacity_usd_per_1k_tokens"] if cost else None)
            )
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
            task = t["task"] + (f" (turn {t['turn']})" if "turn" in t else "")  # multi-turn prompts: per turn
            rows.append(
                {
                    "method": method_name(row),
                    "task": task,
                    "prompts": t["prompts"],
                    "new_tokens": t["new_tokens"],
                    "target_calls": t["target_calls"],
                    "alpha": t["alpha"],
                    "tau": t["tau"],
                    "speedup": t["speedup"],
                }
            )
    return rows
