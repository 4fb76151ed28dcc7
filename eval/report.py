"""Evaluation reports: a compact table for the terminal, report.json and report.md on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

from draftsmith.heads.artifacts import atomic_file, write_text_atomic


def write_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: never a half-written file."""
    write_text_atomic(path, text)


def _num(value, digits=2, suffix=""):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _positions(values, digits=2):
    if not values:
        return "-"
    return " ".join(_num(v, digits) for v in values)


LOSSY_LABEL = " (LOSSY typical)"


def method_name(row: dict) -> str:
    """The method's name, marked when its acceptance rule is lossy (typical
    acceptance): such a row must never read as lossless speculative decoding."""
    return row["method"] + (LOSSY_LABEL if row.get("lossy") else "")


def _kl(row: dict):
    """KL column: for a lossy method, the estimated KL(emitted || target) per token, which is
    what matters there; otherwise the target-vs-draft KL on the draft's vocabulary (the full KL
    for a full-vocabulary draft; finite for a reduced one, whose full KL is inf)."""
    return row.get("lossy_kl_per_token") if row.get("lossy") else row.get("kl_draft_vocab_mean")


ACCEPTANCE_NOTE = (
    "alpha: Leviathan's conditional acceptance, P(draft i accepted | drafts 1..i-1 accepted), pooled "
    "over draft positions (accepted / reached). acc. rate: the share of drafted tokens accepted "
    "(accepted / proposed; drafts after a call's first rejection count as proposed, never reached; for a tree, "
    "proposed counts its nodes)."
)
KL_NOTE = (
    "OOV: target probability outside the tokens the draft can propose (0 for a full-vocabulary draft; "
    "a reduced vocabulary or a per-slot candidate set leaves some out). "
    "KL: KL(target || draft) on the draft's vocabulary (the target restricted to it and "
    "renormalised); report.json keeps the full KL as kl_mean (null when infinite)."
)


def table_markdown(columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header of `columns`, then one line per row of cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def _cell(row: dict, value, digits: int, suffix: str) -> str:
    """One cell: `value` is a key of the row (a list for per-position values) or a function of it."""
    value = value(row) if callable(value) else row.get(value)
    return _positions(value, digits) if isinstance(value, list) else _num(value, digits, suffix)


def _method_table(report: dict, columns: tuple, needs: str | None = None) -> str:
    """A Markdown table of the report's methods (those with a `needs` key): the method's name,
    then a cell per (header, key or function of the row, digits, suffix) of `columns`."""
    rows = [
        [method_name(row)] + [_cell(row, value, digits, suffix) for _, value, digits, suffix in columns]
        for row in report["methods"]
        if needs is None or needs in row
    ]
    return table_markdown(["method"] + [column[0] for column in columns], rows)


# What a user compares first.
SUMMARY_COLUMNS = (
    ("alpha", "alpha", 2, ""),
    ("acc. rate", "acceptance_rate", 2, ""),
    ("tau", "tau", 2, ""),
    ("tok/s", "tokens_per_second", 1, ""),
    ("speedup", "speedup", 2, "x"),
    ("predicted", "predicted_speedup", 2, "x"),
    ("TTFT ms", "ttft_ms_p50", 1, ""),
    ("latency p50 s", "latency_s_p50", 3, ""),
    ("p90 s", "latency_s_p90", 3, ""),
    ("OOV", "oov_mass_mean", 3, ""),
    ("KL", _kl, 3, ""),
    ("TV", "tv_mean", 3, ""),
)
# Per draft position: measured alpha_i beside the theory sum_x min(p, q), KL, TV.
POSITION_COLUMNS = (
    ("measured alpha_i", "alpha_per_position", 2, ""),
    ("expected alpha_i = E[sum min(p,q)]", "expected_alpha_per_position", 2, ""),
    ("OOV_i", "oov_mass_per_position", 3, ""),
    ("KL(p||q) on draft vocab_i", "kl_draft_vocab_per_position", 3, ""),
    ("TV_i", "tv_per_position", 3, ""),
)
# Leviathan's predictions from the measured alpha and cost ratio, beside the measurements.
THEORY_COLUMNS = (
    ("alpha", "alpha", 2, ""),
    ("c (draft/target step)", "draft_cost_ratio_c", 3, ""),
    ("verify cost (x 1 step)", "verify_cost_ratio", 2, ""),
    ("tau measured", "tau", 2, ""),
    ("tau predicted", "predicted_tau", 2, ""),
    ("speedup measured", "speedup", 2, "x"),
    ("predicted (Leviathan)", "predicted_speedup", 2, "x"),
    ("predicted (measured costs)", "predicted_speedup_measured_costs", 2, "x"),
)


def summary_table(report: dict) -> str:
    """One Markdown row per method: `SUMMARY_COLUMNS`."""
    return _method_table(report, SUMMARY_COLUMNS)


def position_table(report: dict) -> str:
    """One Markdown row per method that drafts: `POSITION_COLUMNS`."""
    return _method_table(report, POSITION_COLUMNS, needs="alpha_per_position")


def theory_table(report: dict) -> str:
    """One Markdown row per method that drafts: `THEORY_COLUMNS`."""
    return _method_table(report, THEORY_COLUMNS, needs="alpha")


def task_table(report: dict) -> str:
    """Per drafter, one row per task of the prompt rows ("(no task)" for rows without one) and, for
    multi-turn prompts, per user turn: how acceptance differs by kind of prompt."""
    entries = [(row, t) for row in report["methods"] if "alpha" in row for t in row.get("tasks", [])]
    turns = any("turn" in t for _, t in entries)
    columns = ["method", "task"] + (["turn"] if turns else []) + ["prompts", "alpha", "acc. rate", "tau", "speedup"]
    rows = [
        [method_name(row), str(t["task"])]
        + ([str(t.get("turn", "-"))] if turns else [])
        + [
            str(t["prompts"]),
            _num(t.get("alpha")),
            _num(t.get("acceptance_rate")),
            _num(t["tau"]),
            _num(t["speedup"], 2, "x"),
        ]
        for row, t in entries
    ]
    return table_markdown(columns, rows)


def _turns(report: dict) -> str:
    source = report.get("prompts_source") or {}
    if source.get("turns", 1) < 2:
        return ""
    return f" ({source['rows']} rows, up to {source['turns']} turns each)"


def header(report: dict) -> str:
    s = report["settings"]
    lossy = [row["method"] for row in report["methods"] if row.get("lossy")]
    guarantee = (
        "lossless: output distributed exactly as the target's"
        if not lossy
        else f"NOT lossless for {', '.join(lossy)}: typical acceptance; the others are lossless"
    )
    return (
        f"mode: {report['mode']} ({guarantee})  |  "
        f"K = {s['num_draft_tokens']}  |  prompts: {report['num_prompts']}{_turns(report)}  |  "
        f"max new tokens: {s['max_new_tokens']}  |  timed passes: {s['repeats']}"
        + (
            f"  |  compiled ({s['compile']}): compile time {sum(r.get('compile_seconds', 0.0) for r in report['methods']):.1f} s, not in the timings"
            if s.get("compile")
            else ("  |  static KV cache" if s.get("static_cache") else "")
        )
        + "\n"
        "tau = mean tokens per target call, counting the bonus token (target-only = 1.00); "
        "speedup = tok/s / target-only tok/s in the same pass, median over passes."
    )


def render_markdown(report: dict) -> str:
    target = report.get("target", {})
    parts = [
        "# draftsmith evaluation",
        "",
        f"Target: `{target.get('path', '?')}` ({target.get('parameters', '?')} parameters, "
        f"{target.get('dtype', '?')} on {target.get('device', '?')}, linears {target.get('linears', 'F.linear')})",
        "",
        header(report),
        "",
        "## Summary",
        "",
        summary_table(report),
        "",
        ACCEPTANCE_NOTE,
        "",
        KL_NOTE + " OOV / KL / TV: target vs draft, "
        "raw (T=1) distributions on the decoded trajectories (- for drafters without a "
        "distribution, such as prompt lookup). Rows marked LOSSY use typical acceptance: "
        "their KL is the estimated KL(emitted || target) per token, sum of -log p(x) over the "
        "tokens the typical rule accepted.",
        "",
        "## Acceptance by draft position",
        "",
        position_table(report),
        "",
        "## Theory vs measurement",
        "",
        "Leviathan et al.: tau = (1 - alpha^(k+1)) / (1 - alpha) per call with k drafts (averaged "
        "over the calls made), speedup = tau / (k c + 1). The last column uses the measured tau, "
        "drafts per call and verify cost instead; its gap to the measured speedup is loop overhead.",
        "",
        theory_table(report),
        "",
    ]
    if any("tasks" in row for row in report["methods"]):
        parts += [
            "## Per task",
            "",
            "Each task's prompts pooled over every pass; speedup: its tokens/s over target-only's on the same "
            "prompts. turn: the user turn of a multi-turn prompt (turn 2 is asked after the target's own "
            "answer to turn 1).",
            "",
            task_table(report),
            "",
        ]
    return "\n".join(parts)


def strict_json(value):
    """`value` with every non-finite float (NaN, inf) replaced by None: JSON has no such numbers
    (`json.dumps` would write the non-standard `NaN` / `Infinity`), so they are written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps_strict(value) -> str:
    """Strict JSON text of `value` (non-finite numbers as null), indented, ending in a newline."""
    return json.dumps(strict_json(value), indent=2, allow_nan=False) + "\n"


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """report.json (strict JSON: a non-finite number is null) and report.md in `out_dir`."""
    out_dir = Path(out_dir)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    write_atomic(json_path, dumps_strict(report))
    write_atomic(md_path, render_markdown(report))
    return json_path, md_path


def compact_table(report: dict) -> str:
    """The demo's table: method, alpha, acceptance rate, tau, speedup, OOV, KL (Markdown)."""
    rows = [
        [
            method_name(row),
            _num(row.get("alpha")),
            _num(row.get("acceptance_rate")),
            _num(row["tau"]),
            _num(row["speedup"], 2, "x"),
            _num(row.get("oov_mass_mean"), 3),
            _num(_kl(row), 3),
        ]
        for row in report["methods"]
    ]
    return table_markdown(["method", "alpha", "acc. rate", "tau", "speedup", "OOV", "KL"], rows)


def plot_acceptance(report: dict, path: str | Path) -> Path:
    """PNG of the measured acceptance alpha_i at each draft position, one line per method
    (dashed: the analytic E[sum min(p, q)] where the drafter has a distribution)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in report["methods"]:
        measured = row.get("alpha_per_position")
        if not measured:
            continue
        xs = list(range(1, len(measured) + 1))
        (line,) = ax.plot(xs, measured, marker="o", label=f"{method_name(row)} (alpha {_num(row.get('alpha'))})")
        expected = row.get("expected_alpha_per_position")
        if expected:
            ax.plot(list(range(1, len(expected) + 1)), expected, linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance alpha_i (given position i reached)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, report["settings"]["num_draft_tokens"] + 1))
    ax.set_title(f"acceptance by draft position - {report['mode']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_file(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return path
