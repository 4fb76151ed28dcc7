"""Figures and the serving report: PNGs drawn with matplotlib's Agg renderer (files only, no
display), `serving.md` (tables + links to the PNGs) and a self-contained `serving.html` (the
PNGs embedded as base64: one file to mail or attach to a pull request).

    from draftsmith.eval.plots import Section, plot_latency_cdf, plot_throughput_vs_batch, write_serving_report
    png = plot_throughput_vs_batch({"KIND": {1: 95.0, 8: 610.0, 32: 1500.0}},
                                   {1: 60.0, 8: 450.0, 32: 1600.0}, "runs/serving/throughput.png")
    write_serving_report("runs/serving",
                         Section("Throughput", "tokens/s per batch size", rows=[...], images=[png]))

Every file is written to a temporary name beside its destination, then renamed: a failure
never leaves a half-written figure or report.
"""

from __future__ import annotations

import base64
import html
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.eval.report import table_markdown, write_atomic
from draftsmith.eval.serving.profile import check_items
from draftsmith.heads.artifacts import atomic_file

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGSIZE = (6, 4)  # inches at DPI: 600 x 400 px, readable inline in Markdown viewers
DPI = 100


# ---------------------------------------------------------------------- figures
def _figure():
    # A bare Figure (no pyplot): no global backend switch, no figure registry to leak into.
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE)
    return fig, fig.add_subplot()


def _save(fig, path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"figure path {str(path)!r}: expected a .png file")
    with atomic_file(path, suffix=".png") as tmp:
        fig.tight_layout()
        fig.savefig(tmp, dpi=DPI, format="png")
    return path


def _non_empty(mapping, what: str) -> None:
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"{what}: expected a non-empty mapping {{method: values}}, got {mapping!r}")


def acceptance_series(report: Mapping) -> dict[str, list[float | None]]:
    """{method: alpha_per_position} of a report.json's drafter rows (lossy rows marked)."""
    from draftsmith.eval.report import method_name

    if "methods" not in report:
        raise ValueError("report has no 'methods': expected the dict of report.json")
    return {method_name(row): row["alpha_per_position"] for row in report["methods"] if row.get("alpha_per_position")}


def plot_acceptance(
    series: Mapping[str, Sequence[float | None]], path, *, title: str = "acceptance by draft position"
) -> Path:
    """Measured acceptance alpha_i at each draft position, one line per drafter (None: a
    position never reached, left as a gap). `acceptance_series(report)` reads a report."""
    _non_empty(series, "plot_acceptance")
    fig, ax = _figure()
    longest = 0
    for name, alphas in series.items():
        values = [math.nan if a is None else float(a) for a in alphas]
        if any(not (math.isnan(a) or 0.0 <= a <= 1.0) for a in values):
            raise ValueError(
                f"plot_acceptance: {name!r} holds {list(alphas)}; expected probabilities in [0, 1] or None"
            )
        longest = max(longest, len(values))
        ax.plot(range(1, len(values) + 1), values, marker="o", label=str(name))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("alpha_i (given position i reached)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, longest + 1))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_speedup_vs_k(tunings: Mapping, path, *, measured: Mapping[str, Mapping[int, float]] | None = None) -> Path:
    """Predicted speedup per setting (eval/tune.py Tunings of one kind), the chosen one starred,
    with measured speedups as crosses where given ({name: {K: speedup}}); the line at 1.0x is
    target-only decoding."""
    from draftsmith.eval.tune import TUNING_AXIS as _TUNING_AXIS

    _non_empty(tunings, "plot_speedup_vs_k")
    kinds = {t.kind for t in tunings.values()}
    if len(kinds) != 1 or not kinds <= set(_TUNING_AXIS):
        raise ValueError(
            f"plot_speedup_vs_k: tunings of kinds {sorted(kinds)}; expected one kind of {sorted(_TUNING_AXIS)}"
        )
    key, label = _TUNING_AXIS[kinds.pop()]
    unknown = sorted(set(measured or {}) - set(tunings))
    if unknown:
        raise ValueError(f"plot_speedup_vs_k: measured speedups for {unknown}, which have no tuning")
    fig, ax = _figure()
    for name, tuning in tunings.items():
        xs = [c.setting[key] for c in tuning.candidates]
        (line,) = ax.plot(xs, [c.speedup for c in tuning.candidates], marker="o", label=f"{name} (predicted)")
        best = tuning.best
        ax.plot(
            [best.setting[key]], [best.speedup], marker="*", markersize=14, color=line.get_color(), linestyle="none"
        )
        if measured and name in measured:
            points = sorted(measured[name].items())
            ax.plot(
                [k for k, _ in points],
                [s for _, s in points],
                marker="x",
                markersize=9,
                linestyle="none",
                color=line.get_color(),
                label=f"{name} (measured)",
            )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="target-only")
    ax.set_xlabel(label)
    ax.set_ylabel("speedup over target-only")
    ax.set_title("speedup vs setting (star: chosen)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _check_curve(points, what: str) -> list[tuple[float, float]]:
    if not isinstance(points, Mapping) or not points:
        raise ValueError(f"{what}: expected measured points {{batch size: tokens/s}}, got {points!r}")
    for b, tps in points.items():
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{what}: batch size {b!r}; expected an int >= 1")
        if not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps < 0:
            raise ValueError(f"{what}: tokens/s at batch {b} is {tps!r}; expected a finite number >= 0")
    return sorted(points.items())


def plot_throughput_vs_batch(
    methods: Mapping[str, Mapping[int, float]],
    baseline: Mapping[int, float],
    path,
    *,
    baseline_name: str = "target-only",
) -> Path:
    """Tokens/s against batch size, one line per method, and the target-only line (dashed,
    black): where a method's line drops under it, speculation stops paying."""
    _non_empty(methods, "plot_throughput_vs_batch")
    base = _check_curve(baseline, f"plot_throughput_vs_batch: {baseline_name}")
    fig, ax = _figure()
    ax.plot([b for b, _ in base], [t for _, t in base], color="black", linestyle="--", marker="s", label=baseline_name)
    sizes = {b for b, _ in base}
    for name, points in methods.items():
        curve = _check_curve(points, f"plot_throughput_vs_batch: {name}")
        sizes |= {b for b, _ in curve}
        ax.plot([b for b, _ in curve], [t for _, t in curve], marker="o", label=str(name))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(sizes), [str(b) for b in sorted(sizes)])
    ax.set_xlabel("batch size (active rows)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs batch size", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_latency_cdf(latencies: Mapping, path, *, title: str = "request latency") -> Path:
    """Empirical CDF of request latency per method: {name: [seconds]} or {name: SimulationResult}."""
    _non_empty(latencies, "plot_latency_cdf")
    fig, ax = _figure()
    for name, values in latencies.items():
        if hasattr(values, "requests"):  # a SimulationResult
            values = [r.latency_s for r in values.requests]
        values = sorted(values)
        if not values or any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"plot_latency_cdf: {name!r} needs a non-empty list of latencies >= 0 seconds")
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=f"{name} (n={n})")
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("share of requests answered")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ---------------------------------------------------------------------- tables
def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    if isinstance(value, (list, tuple)):
        return " ".join(_cell(v) for v in value)
    return str(value)


def _columns(rows: Sequence[Mapping]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns


BREAKDOWN_DEFAULTS = ("speedup", "tau", "tokens_per_s", "tokens_per_second")  # the first present is pivoted


def task_breakdown(rows: Sequence[Mapping], value: str) -> list[dict]:
    """Per task, the mean of `value` for each method (one column per method, in first-seen
    order; a single `value` column when rows have no "method"), then an "all tasks" row: the
    unweighted mean of the task means, so a task with many prompts does not hide the others."""
    tasks: dict[str, dict[str, list[float]]] = {}
    methods: list[str] = []
    for row in rows:
        if "task" not in row:
            raise ValueError(f"task_breakdown: row {dict(row)!r} has no 'task' field")
        method = str(row.get("method", value))
        if method not in methods:
            methods.append(method)
        v = row.get(value)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            tasks.setdefault(str(row["task"]), {}).setdefault(method, []).append(float(v))
        else:
            tasks.setdefault(str(row["task"]), {})

    def mean(values):
        return sum(values) / len(values) if values else None

    out = []
    for task, by_method in tasks.items():
        out.append({"task": task, **{m: mean(by_method.get(m, [])) for m in methods}})
    overall = {"task": "all tasks (mean of tasks)"}
    for m in methods:
        overall[m] = mean([r[m] for r in out if r[m] is not None])
    return out + [overall]


def markdown_table(rows: Sequence[Mapping]) -> str:
    columns = _columns(rows)
    return table_markdown(columns, [[_cell(row.get(c)).replace("|", "\\|") for c in columns] for row in rows])


def html_table(rows: Sequence[Mapping]) -> str:
    columns = _columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---------------------------------------------------------------------- the report
@dataclass
class Section:
    """One part of the serving report: a heading, prose, a table (one dict per row; columns in
    first-seen order) and figures (PNG paths). Rows that carry a "task" field also get a
    task x method breakdown of `breakdown` (default: the first of BREAKDOWN_DEFAULTS present)."""

    title: str
    text: str = ""
    rows: Sequence[Mapping] | None = None
    images: Sequence[str | os.PathLike] = field(default_factory=list)
    breakdown: str | None = None

    def __post_init__(self):
        if not isinstance(self.title, str) or not self.title.strip():
            raise ValueError(f"Section title = {self.title!r}; expected a non-empty string")
        if self.rows is not None and (
            isinstance(self.rows, Mapping) or not self.rows or not all(isinstance(r, Mapping) for r in self.rows)
        ):
            raise ValueError(f"Section {self.title!r}: rows must be a non-empty list of dicts (one per table row)")
        if self.breakdown is not None and (not self.rows or not any(self.breakdown in r for r in self.rows)):
            raise ValueError(f"Section {self.title!r}: breakdown column {self.breakdown!r} is in no row")

    def task_breakdown(self) -> tuple[str, list[dict]] | None:
        """(the pivoted column, the task x method rows), or None: no row carries a "task" field
        (or no column to pivot)."""
        if not self.rows or not any("task" in r for r in self.rows):
            return None
        value = self.breakdown or next((k for k in BREAKDOWN_DEFAULTS if any(k in r for r in self.rows)), None)
        return (value, task_breakdown(self.rows, value)) if value else None


def _read_png(path: Path, section: str) -> bytes:
    if not path.is_file():
        raise ValueError(f"Section {section!r}: image {str(path)!r} does not exist")
    data = path.read_bytes()
    if not data.startswith(PNG_MAGIC):
        raise ValueError(f"Section {section!r}: image {str(path)!r} is not a PNG file")
    return data


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
    "table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:right}"
    "th:first-child,td:first-child{text-align:left}img{max-width:100%}"
)


def write_serving_report(
    out_dir, *sections: Section, title: str = "draftsmith serving analysis", name: str = "serving"
) -> tuple[Path, Path]:
    """Write `NAME.md` (tables, links to the PNGs relative to out_dir) and `NAME.html` (the
    same, PNGs embedded as base64, no external resource) into out_dir; NAME is "serving" or,
    for the engine load test, "engine". Every image is read and checked before anything is
    written; each file is written atomically."""
    sections = check_items(sections, Section, "write_serving_report: sections")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{str(out_dir)!r} exists and is not a directory")
    images = [[(Path(p), _read_png(Path(p), s.title)) for p in s.images] for s in sections]

    md = [f"# {title}", ""]
    page = [f"<h1>{html.escape(title)}</h1>"]
    for s, section_images in zip(sections, images):
        md += [f"## {s.title}", ""]
        page.append(f"<h2>{html.escape(s.title)}</h2>")
        for p in _paragraphs(s.text):
            md += [p, ""]
            page.append(f"<p>{html.escape(p)}</p>")
        if s.rows:
            md += [markdown_table(s.rows), ""]
            page.append(html_table(s.rows))
        breakdown = s.task_breakdown()
        if breakdown:
            value, rows = breakdown
            caption = f"Per task: mean {value} per method."
            md += [caption, "", markdown_table(rows), ""]
            page += [f"<p>{html.escape(caption)}</p>", html_table(rows)]
        for path, data in section_images:
            link = Path(os.path.relpath(path.resolve(), out_dir.resolve())).as_posix()
            md += [f"![{path.stem}]({link})", ""]
            encoded = base64.b64encode(data).decode("ascii")
            page.append(f'<p><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{encoded}"></p>')
    document = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{HTML_STYLE}</style></head>\n<body>\n"
        + "\n".join(page)
        + "\n</body></html>\n"
    )
    md_path, html_path = out_dir / f"{name}.md", out_dir / f"{name}.html"
    write_atomic(md_path, "\n".join(md))
    write_atomic(html_path, document)
    return md_path, html_path


__all__ = [
    "Section",
    "acceptance_series",
    "html_table",
    "markdown_table",
    "plot_acceptance",
    "plot_latency_cdf",
    "plot_speedup_vs_k",
    "plot_throughput_vs_batch",
    "task_breakdown",
    "write_serving_report",
]
