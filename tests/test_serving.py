"""The serving-scale analysis: the continuous-batching simulator against hand-computed
schedules, its conservation and monotonicity, the sustainable load against a case solved on
paper, the crossover and cost arithmetic, and the figures / serving report on disk."""

from __future__ import annotations

import json
import math
import re
from itertools import pairwise

import pytest

from draftsmith.eval.serving import (
    CostCurve,
    Request,
    StepProfile,
    batch1_step_seconds,
    cost_per_1k_tokens,
    cost_per_answer,
    crossover,
    describe_crossover,
    histogram_from_alphas,
    poisson_requests,
    saturation_capacity,
    simulate,
    sustainable_load,
    tokens_histogram,
)

EXACT = {"abs": 1e-12}  # float sums of a few decimal step costs


# ---------------------------------------------------------------------- the simulator
def test_hand_computed_schedule_with_prefill_and_a_full_batch():
    """Step 1 s + 0.01 s per prompt token of the admitted requests, 2 tokens per row per step,
    max batch 2. On paper:
      t=0    admit A (10-token prompt), B (20): step = 1 + 0.1 + 0.2 = 1.3 -> t=1.3, A 4 left, B 2 left
      t=1.3  C (arrived 0.5) waits: no free slot; step 1 -> t=2.3: B done, A 2 left
      t=2.3  admit C (50-token prompt): step 1 + 0.5 -> t=3.8: A done, C done (needed 2)"""
    profile = StepProfile("fixed", 1.0, {2: 1.0}, prefill_seconds_per_token=0.01)
    requests = [Request(0.0, 10, 6), Request(0.0, 20, 4), Request(0.5, 50, 2)]
    # given in any order, requests are served by arrival time (ties: in the order given)
    c, a, b = simulate(profile, [requests[2], requests[0], requests[1]], max_batch=2).requests
    assert (a.admitted_s, a.first_token_s, a.finish_s) == pytest.approx((0.0, 1.3, 3.8), **EXACT)
    assert (b.admitted_s, b.first_token_s, b.finish_s) == pytest.approx((0.0, 1.3, 2.3), **EXACT)
    assert (c.admitted_s, c.first_token_s, c.finish_s) == pytest.approx((2.3, 3.8, 3.8), **EXACT)
    assert (a.ttft_s, b.ttft_s, c.ttft_s) == pytest.approx((1.3, 1.3, 3.3), **EXACT)
    assert (a.latency_s, b.latency_s, c.latency_s) == pytest.approx((3.8, 2.3, 3.3), **EXACT)
    assert c.queue_s == pytest.approx(1.8, **EXACT)
    assert (a.steps, b.steps, c.steps) == (3, 2, 1)


def test_hand_computed_idle_engine_and_capped_last_step():
    """An idle engine waits for the next arrival; a row needing 3 tokens at 2 per step gets 2
    then 1 (capped), never more than it asked for.
      A at 0.0 needs 3: steps 0-0.5, 0.5-1.0 -> done 1.0 (first token 0.5)
      B at 2.0 needs 1: engine idle from 1.0 to 2.0; step 2.0-2.5 -> done 2.5"""
    profile = StepProfile("fixed", 0.5, {2: 1.0})
    run = simulate(profile, [Request(0.0, 4, 3), Request(2.0, 4, 1)], max_batch=4)
    a, b = run.requests
    assert (a.first_token_s, a.finish_s, a.output_tokens) == pytest.approx((0.5, 1.0, 3), **EXACT)
    assert (b.admitted_s, b.first_token_s, b.finish_s, b.output_tokens) == pytest.approx((2.0, 2.5, 2.5, 1), **EXACT)
    assert run.steps == 3 and run.busy_seconds == pytest.approx(1.5, **EXACT)
    assert run.makespan_s == pytest.approx(2.5, **EXACT)
    assert run.tokens_per_s == pytest.approx(4 / 2.5)


def test_conservation_and_order_of_events():
    profile = StepProfile(
        "eagle", {1: 0.02, 8: 0.03, 16: 0.05}, {1: 0.3, 2: 0.2, 3: 0.5}, prefill_seconds_per_token=1e-4
    )
    requests = poisson_requests(20.0, 300, prompt_lengths=[30, 200, 700], output_lengths=[1, 17, 64, 300], seed=3)
    run = simulate(profile, requests, max_batch=8, seed=3)
    assert len(run.requests) == len(requests)  # every request answered exactly once, in input order
    for req, res in zip(requests, run.requests):
        assert res.output_tokens == req.output_tokens  # produced = requested, nothing more
        assert res.arrival_s == req.arrival_s and res.prompt_tokens == req.prompt_tokens
        assert res.arrival_s <= res.admitted_s < res.first_token_s <= res.finish_s
        assert 1 <= res.steps <= req.output_tokens
    assert run.output_tokens == sum(r.output_tokens for r in requests)
    assert 1 <= run.mean_batch <= 8
    # FIFO: among requests that had to wait, admission follows arrival
    admitted = sorted(run.requests, key=lambda r: r.arrival_s)
    assert all(x.admitted_s <= y.admitted_s for x, y in pairwise(admitted))
    # a rerun with the same seed is identical; another seed draws other tokens per step
    assert simulate(profile, requests, max_batch=8, seed=3).requests == run.requests
    assert simulate(profile, requests, max_batch=8, seed=4).requests != run.requests


def test_tokens_per_step_follow_the_histogram():
    """Long single-row requests: steps per request ~ output / mean tokens per step."""
    profile = StepProfile("m", 0.01, {1: 0.3, 2: 0.2, 3: 0.5})
    assert profile.mean_tokens_per_step == pytest.approx(2.2)
    run = simulate(profile, [Request(float(i * 100), 1, 2000) for i in range(5)], max_batch=1)
    steps = sum(r.steps for r in run.requests)
    assert 10_000 / steps == pytest.approx(2.2, rel=0.03)


def test_higher_load_never_lowers_p90_latency_on_one_seed_sequence():
    profile = StepProfile("m", {1: 0.02, 8: 0.025, 32: 0.05}, {1: 0.3, 2: 0.2, 3: 0.5})
    capacity = saturation_capacity(profile, 8, 100, [50, 100, 200]).requests_per_s
    p90 = [
        simulate(profile, poisson_requests(f * capacity, 300, 100, [50, 100, 200], seed=0), max_batch=8).latency(90)
        for f in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.3)
    ]
    assert all(x <= y for x, y in pairwise(p90)), p90
    assert p90[-1] > 2 * p90[0]  # past capacity the queue shows


def test_poisson_requests_scale_with_qps():
    slow = poisson_requests(1.0, 2000, 8, [5, 9], seed=11)
    fast = poisson_requests(4.0, 2000, 8, [5, 9], seed=11)
    assert [r.arrival_s / 4 for r in slow] == pytest.approx([r.arrival_s for r in fast])
    assert [r.output_tokens for r in slow] == [r.output_tokens for r in fast]
    assert slow[-1].arrival_s / 2000 == pytest.approx(1.0, rel=0.1)  # mean gap 1 / qps
    assert {r.output_tokens for r in slow} == {5, 9}


# ---------------------------------------------------------------------- capacity and load
def test_sustainable_load_is_the_capacity_solved_on_paper():
    """Constant step c = 10 ms, 1 token per step, 20-token answers, 4 rows: at full load 4 rows
    finish every 20 steps, so capacity = 4 / (20 x 0.01 s) = 20 req/s. With a target nobody
    misses, the answer is the highest rate below it."""
    profile = StepProfile.target_only(0.01)
    cap = saturation_capacity(profile, 4, 1, 20)
    assert cap.requests_per_s == pytest.approx(20.0) and cap.tokens_per_s == pytest.approx(400.0)
    result = sustainable_load(profile, 1e6, 90, max_batch=4, prompt_lengths=1, output_lengths=20, rel_tol=0.01)
    assert result.reached and result.limit == "capacity"
    assert 20.0 / 1.011 <= result.qps < 20.0
    assert "capacity" in result.reason and "grows without bound" in result.reason
    assert all(t["qps"] < 20.0 for t in result.trials)


def test_capacity_leaves_out_the_final_drain():
    """Mixed lengths: while a queue waits every one of the 4 slots makes 1 token per 10 ms step,
    so the capacity is 400 tokens/s exactly; the drain at the end (a half-empty batch) would
    lower it if it were counted."""
    profile = StepProfile.target_only(0.01)
    cap = saturation_capacity(profile, 4, 1, [10, 30], num_requests=64)
    assert cap.tokens_per_s == pytest.approx(400.0)
    assert cap.requests_per_s == pytest.approx(400.0 / cap.mean_output_tokens)
    assert 10 < cap.mean_output_tokens < 30


def test_sustainable_load_limited_by_latency():
    profile = StepProfile("m", {1: 0.02, 8: 0.025}, {1: 0.3, 2: 0.2, 3: 0.5})
    result = sustainable_load(
        profile, 2.0, 90, max_batch=8, prompt_lengths=100, output_lengths=[50, 100, 200], num_requests=200
    )
    assert result.reached and result.limit == "latency"
    assert result.latency_s <= 2.0
    assert result.qps < result.capacity.requests_per_s
    # the rate just above the answer was tried and missed the target
    above = [t for t in result.trials if t["qps"] > result.qps]
    assert above and not min(above, key=lambda t: t["qps"])["meets_target"]
    assert min(t["qps"] for t in above) <= result.qps * 1.011


def test_unreachable_latency_target_is_a_plain_answer():
    """20 tokens at 10 ms each take 0.2 s alone: a 0.1 s target cannot be met at any load."""
    profile = StepProfile.target_only(0.01)
    result = sustainable_load(profile, 0.1, 90, max_batch=4, prompt_lengths=1, output_lengths=20)
    assert not result.reached and result.qps is None and result.limit == "unreachable"
    assert result.reason.startswith("unreachable: even at")
    assert "0.1 s target" in result.reason and "target-only" in result.describe()
    too_high = sustainable_load(profile, 10.0, max_batch=4, prompt_lengths=1, output_lengths=20, min_qps=50.0)
    assert not too_high.reached and "capacity" in too_high.reason


# ---------------------------------------------------------------------- profiles and curves
def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve({1: 1.0, 4: 2.5, 8: 3.0})
    assert curve(1) == 1.0 and curve(2) == pytest.approx(1.5) and curve(6) == pytest.approx(2.75)
    assert curve(16) == pytest.approx(4.0)  # last two points: slope 0.125 per row
    assert curve(0.5) == 1.0  # below the smallest point: its cost
    assert CostCurve({1: 2.0, 2: 1.0})(10) == 1.0  # a falling tail is not extrapolated below the last point
    assert CostCurve({3: 0.7})(50) == 0.7


def test_histograms_from_decoder_counts_and_from_alphas():
    assert tokens_histogram([0, 2, 2, 1]) == {1: 0.25, 2: 0.25, 3: 0.5}
    hist = histogram_from_alphas([0.5, 0.5, None, 0.9])
    assert hist == pytest.approx({1: 0.5, 2: 0.25, 3: 0.25})
    assert sum(n * p for n, p in histogram_from_alphas([0.8, 0.6]).items()) == pytest.approx(1 + 0.8 + 0.48)
    assert histogram_from_alphas([1.0, 1.0]) == {3: 1.0}


def test_profile_from_a_report_row():
    row = {
        "method": "medusa",
        "lossy": True,
        "alpha_per_position": [0.5, 0.5],
        "target_calls": 10,
        "drafter_seconds": 0.05,
        "target_seconds": 0.15,
    }
    profile = StepProfile.from_report_row(row, {1: 0.02, 8: 0.04})
    assert profile.name == "medusa (LOSSY typical)"
    assert profile.mean_tokens_per_step == pytest.approx(1.75)
    assert profile.step_cost(4) == pytest.approx(0.02 + 0.02 * 3 / 7)
    assert batch1_step_seconds(row) == pytest.approx(0.02)
    base = StepProfile.from_report_row({"method": "target-only", "tau": 1.0}, 0.01)
    assert base.tokens_per_step == {1: 1.0}


# ---------------------------------------------------------------------- crossover and cost
def test_crossover_finds_where_speculation_stops_paying():
    result = crossover([1, 8, 32, 64], [100, 600, 1500, 2000], [180, 900, 1400, 1700], method="eagle3")
    assert result.batch_size == 32
    assert result.speedups == pytest.approx([1.8, 1.5, 1400 / 1500, 0.85])
    # linear between (8, 1.5) and (32, 0.933): 1.0 at 8 + 24 x 0.5 / 0.5667
    assert result.crossing == pytest.approx(8 + 24 * 0.5 / (1.5 - 1400 / 1500))
    assert describe_crossover(result).startswith("eagle3 stops paying at batch size 32")
    assert result.sentence == describe_crossover(result)

    never = crossover([1, 4], [10, 40], [20, 60])
    assert never.batch_size is None and never.crossing is None
    assert "pays at every measured batch size" in never.sentence
    loses = crossover([4, 1], [40, 10], [30, 9], method="draft")  # unsorted input is sorted
    assert loses.batch_size == 1 and "does not pay at any measured batch size" in loses.sentence
    load = crossover([0.5, 2.0], [10, 40], [20, 30], x_name="load (req/s)")
    assert load.batch_size == 2.0


def test_cost_per_tokens_and_per_answer():
    # $3.60 / hour = $0.001 / s; at 1,000 tokens/s a token costs $1e-6
    assert cost_per_1k_tokens(1000.0, 3.6) == pytest.approx(0.001)
    assert cost_per_answer(1000.0, 3.6, 250) == pytest.approx(0.00025)
    assert cost_per_1k_tokens(2000.0, 3.6) == pytest.approx(cost_per_1k_tokens(1000.0, 3.6) / 2)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: simulate(StepProfile("m", 1.0), [Request(0.0, 1, 1)], max_batch=0), "max_batch = 0"),
        (lambda: simulate(StepProfile("m", 1.0), [], max_batch=1), "requests is empty"),
        (lambda: StepProfile("m", 1.0).step_cost(0), "rows = 0"),
        (lambda: poisson_requests(0, 10, 1, 1), "qps = 0"),
        (lambda: poisson_requests(-2.0, 10, 1, 1), "qps = -2.0"),
        (lambda: poisson_requests(1.0, 10, 1, [3, 0]), "output_lengths holds 0"),
        (lambda: StepProfile("m", {}), "expected measured points"),
        (lambda: StepProfile("m", {1: 0.1}, {}), "non-empty histogram"),
        (lambda: StepProfile("m", {1: 0.1}, {0: 1.0}), "tokens_per_step key 0"),
        (lambda: StepProfile("m", {1: 0.1, 8: -0.2}), "-0.2 seconds"),
        (lambda: StepProfile("m", {0: 0.1}), "size 0"),
        (lambda: StepProfile("m", 0.1, prefill_seconds_per_token=-1.0), "prefill_seconds_per_token = -1.0"),
        (lambda: StepProfile("m", lambda b: -1.0).step_cost(2), "returned -1.0 seconds"),
        (lambda: Request(-1.0, 1, 1), "arrival_s = -1.0"),
        (
            lambda: sustainable_load(StepProfile("m", 1.0), 0, max_batch=1, prompt_lengths=1, output_lengths=1),
            "latency_target_s = 0",
        ),
        (
            lambda: sustainable_load(StepProfile("m", 1.0), 1.0, max_batch=0, prompt_lengths=1, output_lengths=1),
            "max_batch = 0",
        ),
        (lambda: crossover([0, 4], [1, 1], [1, 1]), "batch size = 0"),
        (lambda: crossover([1, 4], [1, 1], [1]), "same length"),
        (lambda: crossover([1, 4], [1, -1], [1, 1]), "holds -1"),
        (lambda: cost_per_1k_tokens(100.0, -1.0), "price_per_hour = -1.0"),
        (lambda: cost_per_answer(0.0, 1.0, 10), "tokens_per_s = 0.0"),
        (lambda: histogram_from_alphas([0.5, 1.5]), "alpha_per_position[1] = 1.5"),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ---------------------------------------------------------------------- figures and the report
def _figures(tmp_path):
    from draftsmith.eval.plots import plot_acceptance, plot_latency_cdf, plot_throughput_vs_batch

    eagle = StepProfile("eagle3", {1: 0.02, 8: 0.03}, {1: 0.3, 2: 0.2, 3: 0.5})
    base = StepProfile.target_only({1: 0.015, 8: 0.02})
    requests = poisson_requests(10.0, 60, 50, 40, seed=0)
    runs = {p.name: simulate(p, requests, max_batch=8) for p in (eagle, base)}
    return [
        plot_acceptance({"eagle3": [0.8, 0.7, None], "draft": [0.6, 0.5, 0.4]}, tmp_path / "acceptance.png"),
        plot_throughput_vs_batch({"eagle3": {1: 95.0, 8: 610.0}}, {1: 60.0, 8: 450.0}, tmp_path / "throughput.png"),
        plot_latency_cdf(runs, tmp_path / "figs" / "latency.png"),
    ]


def test_figures_and_self_contained_report(tmp_path):
    from draftsmith.eval.plots import Section, write_serving_report

    pngs = _figures(tmp_path)
    for png in pngs:
        assert png.is_file() and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    rows = [
        {"method": "eagle3", "task": "math", "speedup": 2.0, "tau": 3.1},
        {"method": "eagle3", "task": "math", "speedup": 1.0, "tau": 2.9},
        {"method": "eagle3", "task": "qa", "speedup": 1.5, "tau": 2.5},
        {"method": "draft", "task": "qa", "speedup": 1.2, "tau": 2.0},
    ]
    md_path, html_path = write_serving_report(
        tmp_path / "report",
        Section("Acceptance", "Per position.\n\nSecond <paragraph>.", images=pngs[:1]),
        Section("Throughput", rows=rows, images=pngs[1:]),
    )
    md = md_path.read_text()
    assert "![acceptance](../acceptance.png)" in md and "![latency](../figs/latency.png)" in md
    assert "| method | task | speedup | tau |" in md
    # the per-task breakdown: eagle3 math = mean(2.0, 1.0); draft has no math row; the last row
    # is the unweighted mean of the task means
    assert "| task | eagle3 | draft |" in md
    assert "| math | 1.500 | - |" in md and "| qa | 1.500 | 1.200 |" in md
    assert "| all tasks (mean of tasks) | 1.500 | 1.200 |" in md
    page = html_path.read_text()
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == 3 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"<link|<script|https?://|href=", page)
    assert "Second &lt;paragraph&gt;." in page
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["serving.html", "serving.md"]


def test_report_is_written_atomically(tmp_path, monkeypatch):
    from draftsmith.eval.plots import Section, plot_acceptance, write_serving_report

    out = tmp_path / "report"
    out.mkdir()
    (out / "serving.md").write_text("previous")
    # a missing figure is found before anything is written
    with pytest.raises(ValueError, match="does not exist"):
        write_serving_report(out, Section("A", "text"), Section("B", images=[tmp_path / "missing.png"]))
    assert (out / "serving.md").read_text() == "previous" and not (out / "serving.html").exists()
    (tmp_path / "fake.png").write_text("not a png")
    with pytest.raises(ValueError, match="is not a PNG"):
        write_serving_report(out, Section("B", images=[tmp_path / "fake.png"]))

    # a failure while renaming into place leaves the old file and no temporary behind
    def broken_replace(src, dst):
        raise OSError("disk full")

    import draftsmith.heads.artifacts as artifacts_module

    monkeypatch.setattr(artifacts_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_serving_report(out, Section("A", "text"))
    with pytest.raises(OSError, match="disk full"):
        plot_acceptance({"x": [0.5]}, out / "acceptance.png")
    assert sorted(p.name for p in out.iterdir()) == ["serving.md"]
    assert (out / "serving.md").read_text() == "previous"


def test_plot_bad_input(tmp_path):
    from draftsmith.eval.plots import Section, plot_acceptance, plot_latency_cdf, plot_throughput_vs_batch

    with pytest.raises(ValueError, match="expected probabilities"):
        plot_acceptance({"x": [1.5]}, tmp_path / "a.png")
    with pytest.raises(ValueError, match="expected a .png file"):
        plot_acceptance({"x": [0.5]}, tmp_path / "a.jpg")
    with pytest.raises(ValueError, match="batch size 0"):
        plot_throughput_vs_batch({"m": {0: 1.0}}, {1: 1.0}, tmp_path / "t.png")
    with pytest.raises(ValueError, match="non-empty list of latencies"):
        plot_latency_cdf({"m": []}, tmp_path / "l.png")
    with pytest.raises(ValueError, match="breakdown column 'nope'"):
        Section("x", rows=[{"task": "a", "speedup": 1.0}], breakdown="nope")
    assert not list(tmp_path.iterdir())


def test_summary_is_json_ready():
    run = simulate(StepProfile("m", 0.01, {1: 0.5, 2: 0.5}), poisson_requests(5.0, 50, 10, 20, seed=1), max_batch=4)
    summary = json.loads(json.dumps(run.summary()))
    for key in (
        "tokens_per_s",
        "requests_per_s",
        "latency_s_p50",
        "latency_s_p90",
        "latency_s_p99",
        "ttft_s_p90",
        "queue_s_p99",
    ):
        assert math.isfinite(summary[key]) and summary[key] >= 0
    assert summary["latency_s_p50"] <= summary["latency_s_p90"] <= summary["latency_s_p99"]
    assert summary["output_tokens"] == 50 * 20
