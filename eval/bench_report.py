"""The decoder benchmark's tables, goals and JSON (`eval/bench.py` measures, this reads).

Pure functions of the measured methods and cost curves: `analytic_speedup` (the speedup the
forwards alone allow), `spec_costs` (c and the analytic speedup of one speculative row) and
`report`, which prints the markdown tables and returns the JSON-ready summary.
"""

from __future__ import annotations

from draftsmith.eval.serving.profile import CostCurve

ROW_NAMES = {"eager": "draftsmith", "static": "draftsmith-static", "compiled": "draftsmith-compiled"}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (or where the shorter ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def analytic_speedup(tau: float, v1: float, draft_per_call: float, v_fed: float) -> float:
    """tau * v(1) / (drafting time per call + v(tokens fed per call)): the speedup over plain
    decoding (one v(1) per token) when a call costs only its drafting and its verify forward."""
    return tau * v1 / (draft_per_call + v_fed)


def spec_costs(stats, verify: dict[int, float]) -> dict | None:
    """c, the mean tokens fed per call and the analytic speedup of a speculative row, from its
    pooled `DecodeStats` and the verify curve {n: seconds} of its path; None for target-only."""
    if stats is None or not stats.num_draft_tokens or not stats.target_calls:
        return None
    v = CostCurve(verify, "the verify-cost curve v(n)")
    fed = 1 + sum(stats.proposed) / stats.target_calls  # last token + the proposal, per call
    draft_call = stats.drafter_seconds / stats.target_calls
    return {
        "c": stats.drafter_seconds / max(1, sum(stats.proposed)) / v(1),
        "draft_ms_per_call": 1000 * draft_call,
        "fed_per_call": fed,
        "verify_ratio": v(fed) / v(1),
        "analytic_speedup": analytic_speedup(stats.tau, v(1), draft_call, v(fed)),
    }


def _row_costs(m, costs: dict) -> dict | None:
    return None if m.path is None else spec_costs(m.stats, costs["verify"][m.path])


def _method_rows(methods, costs: dict, ref, eager) -> tuple[list[str], list[str], dict]:
    """The main table's rows, its WARNING rows, and every method's JSON entry."""
    by_key = {m.key: m for m in methods}
    rows, warnings, results = [], [], {}
    for m in methods:
        diffs = {i: first_difference(ref.outputs[i], out) for i, out in m.outputs.items()}
        diffs = {i: d for i, d in diffs.items() if d is not None}
        same = "ref" if m is ref else ("yes" if not diffs else f"NO ({len(diffs)}/{len(m.outputs)})")
        if diffs:
            i, d = min(diffs.items(), key=lambda kv: kv[1])
            warnings.append(
                f"| WARNING | {m.key} | greedy output differs from {ref.key} on {len(diffs)}/"
                f"{len(m.outputs)} prompts (first at new token {d} of prompt {i}) | | | | | | | | | |"
            )
        vs_hf = by_key[m.counterpart].median if m.counterpart in by_key else None
        vs_base = by_key[m.baseline].median if m.baseline else None
        vs_eager = eager.median if eager is not None and m.path is not None else None
        st, sc = m.stats, _row_costs(m, costs)
        measured = m.median / vs_base if vs_base and m.baseline != m.key else None
        cells = [
            m.name,
            m.draft,
            f"{m.median:.1f}",
            f"{m.median / vs_hf:.2f}x" if vs_hf else "",
            f"{measured:.2f}x" if measured else "",
            f"{m.median / vs_eager:.2f}x" if vs_eager and m is not eager else "",
            f"{st.alpha:.3f}" if st and st.num_draft_tokens else "",
            f"{st.tau:.2f}" if st else "",
            f"{sc['c']:.2f}" if sc else "",
            f"{sc['analytic_speedup']:.2f}x ({measured / sc['analytic_speedup']:.0%})" if sc and measured else "",
            str(m.target_forwards),
            same,
        ]
        rows.append("| " + " | ".join(cells) + " |")
        results[m.key] = {
            "path": m.path,
            "tok_per_s": m.tok_per_s,
            "median_tok_per_s": m.median,
            "seconds": m.seconds,
            "tokens": m.tokens,
            "ratio_vs_hf_counterpart": m.median / vs_hf if vs_hf else None,
            "ratio_vs_target_only": m.median / vs_base if vs_base else None,
            "ratio_vs_eager_target_only": m.median / vs_eager if vs_eager else None,
            "target_forwards_per_run": m.target_forwards,
            "compile_seconds": m.compile_seconds,
            "greedy_equal_to_reference": not diffs,
            "first_difference": diffs,
        }
        if st is not None:
            results[m.key].update(
                alpha=st.alpha,
                alpha_per_position=st.alpha_per_position,
                tau_counting_bonus=st.tau,
                target_calls=st.target_calls,
                drafter_seconds=st.drafter_seconds,
                target_seconds=st.target_seconds,
            )
        if sc is not None:
            results[m.key].update(sc)
    return rows, warnings, results


def _print_costs(cfg, methods, costs: dict) -> None:
    """The verify-cost curve and draft step per path, the per-call table, the compile times."""
    widths = cfg.curve_widths
    print("\nVerify-cost curve v(n) / v(1) (one target forward over n tokens; v(1) in ms):\n")
    print(
        "| path | v(1) ms | "
        + " | ".join(f"n={n}" for n in widths[1:])
        + " | draft d(1) ms | c_step = d(1)/v(1) | compile s |"
    )
    print("|---|---:|" + "---:|" * (len(widths) - 1) + "---:|---:|---:|")
    for path in cfg.path_list:
        v, d = costs["verify"][path], costs["draft_step"][path]
        print(
            f"| {path} | {1000 * v[1]:.2f} | "
            + " | ".join(f"{v[n] / v[1]:.2f}" for n in widths[1:])
            + f" | {1000 * d:.2f} | {d / v[1]:.2f} | {costs['compile_seconds'].get(path, 0.0):.0f} |"
        )
    by_key = {m.key: m for m in methods}
    spec_rows = [(m, _row_costs(m, costs)) for m in methods]
    spec_rows = [(m, sc) for m, sc in spec_rows if sc is not None]
    if spec_rows:
        print(
            "\nPer target call, in the runs: tokens fed, drafting time, target time (forward and "
            "acceptance), and the curve's v(fed) (ms):\n"
        )
        print("| method | draft | fed | drafting | target (in run) | v(fed) (curve) | c | analytic | measured |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for m, sc in spec_rows:
            st, v = m.stats, CostCurve(costs["verify"][m.path], "the verify-cost curve v(n)")
            print(
                f"| {m.name} | {m.draft} | {sc['fed_per_call']:.1f} | {sc['draft_ms_per_call']:.2f} | "
                f"{1000 * st.target_seconds / st.target_calls:.2f} | {1000 * v(sc['fed_per_call']):.2f} | "
                f"{sc['c']:.2f} | {sc['analytic_speedup']:.2f}x | {m.median / by_key[m.baseline].median:.2f}x |"
            )
    compile_total = {p: sum(m.compile_seconds for m in methods if m.path == p) for p in cfg.path_list}
    if any(compile_total.values()):
        print(
            "\nCompilation (warm-up, outside every timed run): "
            + ", ".join(f"{p} {s:.0f} s" for p, s in compile_total.items() if s)
            + f" for the decodes, plus the curve's widths above (mode {cfg.compile_mode})."
        )


def _goals(cfg, methods, costs: dict) -> dict:
    """Prints the goals (module docstring of scripts/bench_decoder.py) and returns the verdicts."""
    by_key = {m.key: m for m in methods}
    eager = by_key.get("draftsmith")
    verdicts = {}
    print("\nGoals:")

    def goal(name, value, target, met_if_ge=True, note=""):
        met = value >= target if met_if_ge else value <= target
        verdicts[name] = {"value": value, "goal": target, "met": met}
        sign = ">=" if met_if_ge else "<="
        print(f"- {name} = {value:.2f} (goal {sign} {target:.2f}): {'met' if met else 'NOT met'}{note}")

    if not cfg.no_hf and eager is not None:
        goal("draftsmith / hf-generate", eager.median / by_key["hf-generate"].median, 1.00)
        for m in methods:
            if m.path == "eager" and m.counterpart in by_key and m.draft != "-":
                note = " (overhead check: the issue's goal is on the draft pair)" if m.draft == "self" else ""
                goal(f"{m.key} / {m.counterpart}", m.median / by_key[m.counterpart].median, 1.25, note=note)
    if eager is not None:
        for path in ("static", "compiled"):
            if ROW_NAMES[path] in by_key:
                ratio = by_key[ROW_NAMES[path]].median / eager.median
                goal(f"{ROW_NAMES[path]} / draftsmith (target-only)", ratio, 1.5)
    if "compiled" in cfg.path_list:
        sc = _row_costs(by_key[f"draftsmith-compiled ({cfg.draft_label})"], costs)
        if sc is not None:
            goal("c of the draft model on the compiled path", sc["c"], 0.25, met_if_ge=False)
    spec = [m for m in methods if m.path is not None and m.draft not in ("-", "self") and m.stats is not None]
    if spec:
        best = max(spec, key=lambda m: m.median / by_key[m.baseline].median)
        measured = best.median / by_key[best.baseline].median
        goal(f"best drafter {best.key} / its path's target-only", measured, 1.5)
        sc = _row_costs(best, costs)
        if sc is not None:
            goal(f"{best.key}: measured / analytic speedup", measured / sc["analytic_speedup"], 0.9)
    for m in spec:
        alphas = [round(a, 3) if a is not None else None for a in m.stats.alpha_per_position]
        print(f"- {m.key}: alpha per position {alphas}")
    return verdicts


def report(cfg, methods, costs: dict, header: str, top1: float) -> dict:
    """Prints every table of the bench (`cfg`: a `BenchConfig`; `methods`: its timed `Method`s;
    `costs`: `CostCurves.result()`) and returns {"results", "costs", "goals"} for the JSON."""
    by_key = {m.key: m for m in methods}
    ref = by_key.get("hf-generate") or by_key[ROW_NAMES[cfg.path_list[0]]]
    rows, warnings, results = _method_rows(methods, costs, ref, by_key.get("draftsmith"))
    print(f"\n{header}\n")
    print(
        "| method | draft | tok/s | vs HF counterpart | vs target-only | vs eager target-only | alpha | tau "
        "| c | analytic (measured share) | target fwd/run | greedy = ref |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows + warnings))
    print(
        "\ntok/s: median over repeats. vs HF counterpart: over hf-generate / hf-assisted (same draft, "
        "same K). vs target-only: over the target-only row of the same path. alpha: conditional "
        "acceptance over reached positions; tau: tokens per target call, counting the bonus/correction "
        "token (plain decoding = 1.00). c: drafting time per drafted token / v(1) of the same path. "
        "analytic: tau * v(1) / (drafting time per call + v(tokens fed per call)), and the measured "
        "speedup as a share of it. target fwd/run: target forward calls in one warm-up run, prefill "
        f"included. greedy = ref: the tokens equal {ref.key}'s."
    )
    if cfg.target is None:
        print(
            f"Random weights: lm_head scaled x{cfg.head_scale:g} so distributions are peaked "
            f"(mean top-1 probability {top1:.2f} on the prompts); acceptance of a truncated random "
            "model says nothing about a trained draft."
        )
    _print_costs(cfg, methods, costs)
    verdicts = _goals(cfg, methods, costs)
    return {"results": results, "costs": costs, "goals": verdicts}
