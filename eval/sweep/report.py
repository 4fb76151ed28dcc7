"""Writing the serving analysis: the figures, `serving.json`, and the sections of `serving.md` and
`serving.html` in reading order; the sentences `draftsmith eval` also prints."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from draftsmith.eval.evaluator import BASELINE
from draftsmith.eval.report import method_name, write_atomic
from draftsmith.eval.sweep.settings import _is_number


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


def write_serving(
    serving: dict, out_dir, *, title: str = "draftsmith serving analysis", report: Mapping | None = None
) -> list[Path]:
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
        figures["acceptance"] = plot_acceptance(
            series, out_dir / "acceptance.png", title=f"acceptance by draft position (batch 1, {s['mode']})"
        )
    curves = {n: {r["batch_size"]: r["tokens_per_s"] for r in e["batches"]} for n, e in batched.items()}
    baseline = curves.pop(BASELINE)
    if curves:
        figures["throughput"] = plot_throughput_vs_batch(curves, baseline, out_dir / "throughput_vs_batch.png")
    if s["qps"]:
        top = s["qps"][-1]
        runs = {n: e["_runs"][top] for n, e in batched.items() if "_runs" in e}
        figures["latency"] = plot_latency_cdf(
            runs,
            out_dir / "latency_cdf.png",
            title=f"request latency, simulated at {top:g} req/s (max batch {s['max_batch']})",
        )
    tunings = serving.get("tuning") or {}
    if tunings:
        figures["speedup_vs_k"] = plot_speedup_vs_k(
            {n: t["tuning"] for n, t in tunings.items()},
            out_dir / "speedup_vs_k.png",
            measured={n: t["measured_speedup"] for n, t in tunings.items()},
        )
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


#: A latency table's columns: {label: key of a batch's or a simulation's record}.
_LATENCY = {
    "latency p50 s": "latency_s_p50",
    "p90 s": "latency_s_p90",
    "p99 s": "latency_s_p99",
    "TTFT p50 s": "ttft_s_p50",
}


def _priced_row(method: str, record: Mapping, columns: Mapping[str, str]) -> dict:
    """One table row of `record`: its method, the `columns` ({label: key}), then its cost per 1k
    tokens where the sweep was given a price."""
    row = {"method": method, **{label: record[key] for label, key in columns.items()}}
    if "usd_per_1k_tokens" in record:
        row["$/1k tokens"] = record["usd_per_1k_tokens"]
    return row


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
        f"Mode: {s['mode']} (lossless: every method emits the target's own distribution). "
        f"K = {s['num_draft_tokens']}, {s['num_prompts']} prompts x up to {s['max_new_tokens']} new tokens, "
        f"batch sizes {', '.join(map(str, sizes))} "
        f"(prompts cycled to fill each batch), {s['repeats']} timed passes. tau counts the bonus token "
        "(target-only = 1.00). Speedup: tokens/s over target-only tokens/s at the same batch size in the same pass, "
        "median over passes."
    )
    if s.get("path", "default") != "default":
        intro += (
            f" Decoding path: {s['path']} (a preallocated KV cache of fixed batch: finished rows stay as padding rows)"
            + (
                f"; compile time {serving.get('compile_seconds', 0.0):.1f} s, not in any timing."
                if s["path"] == "compiled"
                else "."
            )
        )
    three = (
        "Acceptance: alpha and tau of the batch-1 evaluation. Acceleration: speedup at each batch size. Attendance: "
        f"the highest Poisson load one engine (max batch {max(sizes)}) serves with the {p} request latency within "
        "the target, simulated from the measured step costs."
    )
    text = [intro, three]
    text += crossover_sentences(serving)
    text += load_sentences(serving)
    out.append(
        Section(
            "The three A: Acceptance, Acceleration, Attendance",
            "\n\n".join(text),
            rows=display_rows(serving["three_a"]),
        )
    )

    if report and report.get("methods"):
        rows = [
            {
                "method": method_name(r),
                **{f"alpha_{i + 1}": a for i, a in enumerate(r["alpha_per_position"])},
                "tau": r["tau"],
            }
            for r in report["methods"]
            if r.get("alpha_per_position")
        ]
        images = [figures["acceptance"]] if "acceptance" in figures else []
        if rows:
            out.append(
                Section(
                    "Acceptance by draft position",
                    "alpha_i: acceptance of draft i given drafts 1..i-1 were accepted (batch 1; trees: per depth).",
                    rows=rows,
                    images=images,
                )
            )
    if serving.get("tasks"):
        out.append(
            Section(
                "Per task",
                "Batch-1 counters per task of the prompt rows; a method's new_tokens and target_calls over "
                "its tasks sum to its totals. speedup: the task's tokens/s over target-only's on the same prompts.",
                rows=serving["tasks"],
                breakdown="tau",
            )
        )

    columns = {"batch": "batch_size", "tokens/s": "tokens_per_s", "speedup": "speedup", "tau": "tau", **_LATENCY}
    columns["step ms (full batch)"] = "step_ms_full_batch"
    rows = [_priced_row(name, r, columns) for name, e in batched.items() for r in e["batches"]]
    text = (
        "Static batches: every row of a batch starts together; latency and TTFT are per request from the batch's "
        "start.\n\n" + "\n\n".join(crossover_sentences(serving))
    )
    out.append(
        Section(
            "Acceleration: throughput vs batch size",
            text,
            rows=display_rows(rows),
            images=[figures["throughput"]] if "throughput" in figures else [],
        )
    )

    actives = sorted({int(r) for e in batched.values() for r in e["step_seconds"]})
    rows = []
    for name, e in batched.items():
        row = {
            "method": name,
            "tokens/step": _fmt_hist(e["tokens_per_step"]),
            "mean": e["mean_tokens_per_step"],
            "admission ms/request": 1000 * e["prefill_seconds_per_request"],
            "admission ms/prompt token": 1000 * e["prefill_seconds_per_token"],
        }
        for a in actives:
            row[f"{a} rows ms"] = 1000 * e["step_seconds"][str(a)] if str(a) in e["step_seconds"] else None
        rows.append(row)
    out.append(
        Section(
            "Engine step cost (the simulator's input)",
            "One engine step (drafting + verification) in ms per number of active rows, medians of every step measured at "
            "that many rows; tokens per step: the share of steps in which a row gained n tokens. Admission: what a new "
            "request adds to the step that admits it (the target's prefill, and what the first step costs beyond a usual "
            "one: a draft model or a head reading the prompt), fitted per request + per prompt token on the smallest "
            "batch size.",
            rows=rows,
        )
    )

    tunings = serving.get("tuning") or {}
    if tunings:
        rows = [{"method": n, **c} for n, t in tunings.items() for c in t["tuning"].rows()]
        verify = ", ".join(f"v({n}) {1000 * v:.2f}" for n, v in serving["verify_seconds"].items())
        out.append(
            Section(
                "Speedup vs K (autotuner)",
                "Predicted batch-1 speedup per K from the measured alpha per position, draft cost and verify cost curve "
                f"(ms: {verify}); cross: the measured speedup at K = {s['num_draft_tokens']}. `draftsmith tune` measures "
                "up to a larger K and records the choice.",
                rows=rows,
                images=[figures["speedup_vs_k"]] if "speedup_vs_k" in figures else [],
            )
        )

    columns = {"req/s": "qps", "stable": "stable", "tokens/s": "tokens_per_s", "mean batch": "mean_batch", **_LATENCY}
    columns["queue p90 s"] = "queue_s_p90"
    rows = [_priced_row(name, sim, columns) for name, e in batched.items() for sim in e.get("simulations", [])]
    capacity = "; ".join(
        f"{n} {e['capacity']['requests_per_s']:.3g} req/s ({e['capacity']['tokens_per_s']:.4g} tokens/s)"
        for n, e in batched.items()
    )
    text = (
        f"Continuous batching simulated from the measured step costs ({s['sim_requests']} Poisson requests per "
        f"rate, prompt and answer lengths drawn from the measured ones, max batch {max(sizes)}). Capacity (every "
        f"slot busy): {capacity}. A rate at or above capacity is not stable: its queue grows without "
        "bound."
    )
    loads = load_sentences(serving)
    if loads:
        text += "\n\n" + "\n\n".join(loads)
    if rows or loads:
        out.append(
            Section(
                "Attendance: simulated load",
                text,
                rows=display_rows(rows) or None,
                images=[figures["latency"]] if "latency" in figures else [],
            )
        )

    if s["price_per_hour"] is not None:
        rows = []
        for name, e in batched.items():
            c = e["cost"]
            rows.append(
                {
                    "method": name,
                    "$/1k tokens at capacity": c["at_capacity_usd_per_1k_tokens"],
                    "$/answer at capacity": c["at_capacity_usd_per_answer"],
                    "$/1k tokens at sustainable load": c.get("at_sustainable_load_usd_per_1k_tokens"),
                    "$/answer at sustainable load": c.get("at_sustainable_load_usd_per_answer"),
                }
            )
        out.append(
            Section(
                "Cost",
                f"At ${s['price_per_hour']:g} per hour for the engine; an answer is the mean measured answer "
                "length. At the sustainable load the engine idles part of the time, so its tokens cost more.",
                rows=display_rows(rows),
            )
        )
    return out
