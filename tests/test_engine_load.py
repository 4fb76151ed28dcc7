"""`draftsmith eval --endpoint`: the load test of a running server (`eval/serving/engine.py`) and
the Prometheus counters it reads (`eval/serving/prometheus.py`).

The parser and the arithmetic are tested on text written as vLLM's exporter writes it; the load
test runs against the session's `transformers serve` of the toy target (conftest.py)."""

import json
import math
from dataclasses import asdict

import pytest

from draftsmith.distill.endpoint import EndpointSettings
from draftsmith.distill.local_server import free_port
from draftsmith.eval.serving.engine import (
    LoadSettings,
    acceptance_rows,
    capacity_at_target,
    read_counters,
    sections,
    simulated_closed_loop,
)
from draftsmith.eval.serving.prometheus import (
    ExpositionError,
    parse_exposition,
    served_acceptance,
    spec_decode_counters,
)


def vllm_metrics(drafts, draft_tokens, accepted, per_position, engines=("0",)):
    """/metrics as vLLM writes it: HELP/TYPE lines, `_total` counters and their `_created`
    timestamps, per-position samples, a histogram and a gauge around them; counts split over engines."""
    n = len(engines)
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="org/m"} 3.0',
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="org/m"} 1.0',
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="org/m"} 4.0',
        'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="org/m"} 2.5e+00',
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts counter",
    ]
    for e in engines:
        labels = f'engine="{e}",model_name="org/m \\"quoted\\", {{braced}}"'
        lines += [
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts / n}",
            f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7331e+09",
        ]
    for family, value in (("num_draft_tokens", draft_tokens), ("num_accepted_tokens", accepted)):
        lines += [f"# HELP vllm:spec_decode_{family} Number of {family}.", f"# TYPE vllm:spec_decode_{family} counter"]
        lines += [f'vllm:spec_decode_{family}_total{{engine="{e}",model_name="org/m"}} {value / n}' for e in engines]
    lines += [
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
    ]
    for k, value in enumerate(per_position):
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="org/m",position="{k}"}} '
            f"{value / n} 1733100000000"
            for e in engines
        ]
    return "\n".join(lines) + "\n"


def test_exposition_parser_reads_labels_escapes_types_and_counters():
    m = parse_exposition(vllm_metrics(10, 30, 18, [9, 6, 3]))
    assert (
        m.types["vllm:spec_decode_num_drafts"] == "counter"
        and m.types["vllm:e2e_request_latency_seconds"] == "histogram"
    )
    [drafts] = m.find("vllm:spec_decode_num_drafts")
    assert drafts.name == "vllm:spec_decode_num_drafts_total" and drafts.value == 10.0  # not its _created sample
    assert drafts.label("model_name") == 'org/m "quoted", {braced}' and drafts.label("engine") == "0"
    [inf] = [s for s in m.samples if s.label("le") == "+Inf"]
    assert inf.value == 4.0 and m.total("vllm:e2e_request_latency_seconds_sum") == 2.5
    assert m.total("vllm:no_such_metric") is None
    odd = parse_exposition('a_total{x="1\\\\2\\n"} NaN\nb{} +Inf\nc -1.5e-3 1700000000\n')
    assert odd.samples[0].label("x") == "1\\2\n" and math.isnan(odd.samples[0].value)
    assert odd.total("b") == math.inf and odd.total("c") == -1.5e-3 and odd.total("a") is not None


@pytest.mark.parametrize("line", ['x{a="1"', "x{a=1} 2", "x 1 2 3", "x one", '{a="1"} 2'])
def test_a_malformed_line_is_named(line):
    with pytest.raises(ExpositionError, match=r"/metrics line 2: "):
        parse_exposition("ok 1\n" + line + "\n")


def test_served_acceptance_from_the_counters_before_and_after():
    before = spec_decode_counters(parse_exposition(vllm_metrics(10, 30, 18, [9, 6, 3], engines=("0", "1"))))
    after = spec_decode_counters(parse_exposition(vllm_metrics(110, 330, 168, [89, 56, 23], engines=("0", "1"))))
    delta = after - before
    assert (delta.drafts, delta.draft_tokens, delta.accepted_tokens) == (100, 300, 150)  # summed over both engines
    assert delta.accepted_per_position == {0: 80, 1: 50, 2: 20}
    served = served_acceptance(delta)
    assert served["mean_acceptance_length"] == pytest.approx(2.5) and served["acceptance_rate"] == pytest.approx(0.5)
    assert served["accepted_per_position"] == pytest.approx([0.8, 0.5, 0.2])
    assert served["alpha_per_position"] == pytest.approx([0.8, 50 / 80, 20 / 50])  # conditional, as draftsmith's
    assert spec_decode_counters(parse_exposition("vllm:num_requests_running 1\n")) is None
    with pytest.raises(ExpositionError, match="went down between the two reads"):
        before - after
    report = {
        "methods": [
            {"method": "target-only", "tau": 1.0},
            {
                "method": "eagle-chain",
                "tau": 2.9,
                "acceptance_rate": 0.6,
                "target_calls": 40,
                "alpha_per_position": [0.9, 0.7, 0.5],
            },
        ]
    }
    served_row, local_row = acceptance_rows(served, report, "org/m")
    assert served_row["tau"] == pytest.approx(2.5) and served_row["alpha_3"] == pytest.approx(0.4)
    assert local_row["source"] == "draftsmith: eagle-chain (batch 1)" and local_row["alpha_1"] == 0.9


class MetricsOnly:
    """Stands in for EndpointClient where only /metrics is read: a (status, text) per endpoint."""

    def __init__(self, pages):
        self.settings = EndpointSettings(urls=tuple(pages))
        self.pages = pages

    def get_text(self, url, path):
        assert path == "/metrics"
        return self.pages[url]


def test_counters_are_summed_over_endpoints_and_reported_beside_draftsmith():
    a, b, c = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    counters, note = read_counters(MetricsOnly({a: (200, vllm_metrics(10, 30, 18, [9, 6, 3])), b: (404, "")}))
    assert counters.drafts == 10 and note == f"{b}/metrics answered HTTP 404"
    both, _ = read_counters(
        MetricsOnly({a: (200, vllm_metrics(10, 30, 18, [9, 6, 3])), c: (200, vllm_metrics(30, 90, 42, [20, 14, 8]))})
    )
    assert (both.drafts, both.accepted_tokens, both.accepted_per_position) == (40, 60, {0: 29, 1: 20, 2: 11})
    none, note = read_counters(MetricsOnly({a: (200, "vllm:num_requests_running 0\n")}))
    assert none is None and note == f"{a}/metrics has no vllm:spec_decode_* counters"
    engine = {
        "settings": asdict(LoadSettings(concurrency=(1,), requests=2)),
        "served_model": "org/m",
        "endpoints": [a],
        "num_prompts": 2,
        "prompts_sent_as": "ids",
        "levels": [
            {
                "concurrency": 1,
                "requests": 2,
                "errors": 0,
                "tokens_per_s": 10.0,
                "requests_per_s": 1.0,
                "latency_s_p50": 1.0,
                "latency_s_p90": 1.0,
                "latency_s_p99": 1.0,
                "ttft_s_p50": 0.1,
                "ttft_s_p90": 0.1,
            }
        ],
        "speculation": {"served": served_acceptance(both - counters), "note": "served"},
    }
    report = {"methods": [{"method": "eagle-chain", "tau": 2.9, "target_calls": 9, "alpha_per_position": [0.9, 0.7]}]}
    *_, spec = sections(engine, report)
    assert [r["source"] for r in spec.rows] == ["served: org/m (/metrics)", "draftsmith: eagle-chain (batch 1)"]
    assert spec.rows[0]["tau"] == pytest.approx(1 + 42 / 30) and spec.rows[0]["alpha_1"] == pytest.approx(20 / 30)


def test_simulated_closed_loop_and_capacity_at_a_target():
    # One token per 10 ms step at any batch size, no prefill: c clients make c x 100 tokens/s.
    serving = {
        "prompt_lengths": [5, 7],
        "output_lengths": [10, 10],
        "methods": {
            "target-only": {
                "batched": True,
                "step_seconds": {"1": 0.01, "8": 0.01},
                "tokens_per_step": {"1": 1.0},
                "prefill_seconds_per_token": 0.0,
                "prefill_seconds_per_request": 0.0,
            },
            "tree": {"batched": False, "reason": "batch 1 only"},
        },
    }
    [(name, rows)] = simulated_closed_loop(serving, [1, 2, 4], requests=8).items()
    assert name == "target-only" and [r["concurrency"] for r in rows] == [1, 2, 4]
    for r, c in zip(rows, (1, 2, 4)):
        assert r["tokens_per_s"] == pytest.approx(100 * c) and r["latency_s_p90"] == pytest.approx(0.1)
        assert r["ttft_s_p50"] == pytest.approx(0.01)
    best = capacity_at_target(rows, 0.2, 90, "sim")
    assert best["concurrency"] == 4 and "every measured level meets it" in best["reason"]
    slow = [dict(r, latency_s_p90=r["latency_s_p90"] * r["concurrency"]) for r in rows]  # 0.1, 0.2, 0.4 s
    capped = capacity_at_target(slow, 0.25, 90, "sim")
    assert capped["concurrency"] == 2 and "at concurrency 4 the p90 latency is 0.4 s" in capped["reason"]
    assert capacity_at_target(slow, 0.05, 90, "sim")["concurrency"] is None


def test_a_down_endpoint_is_one_line_naming_it(run_cli, toy_dir, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    base = ["eval", "--target", toy_dir / "target", "--prompts", toy_dir / "prompts.jsonl", "--no-progress"]
    code, _, err = run_cli(base + ["--out", tmp_path / "a", "--endpoint", down])
    assert code == 2 and f"endpoint {down} is down or unreachable" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(base + ["--out", tmp_path / "b", "--endpoint", down, "--batch-sizes", "1,2"])
    assert code == 2 and "--batch-sizes measure the local decoder, not --endpoint" in err
    code, _, err = run_cli(base + ["--out", tmp_path / "c", "--prompt-lookup", "--concurrency", "1,2"])
    assert code == 2 and "--concurrency apply to a served model: give --endpoint URL" in err
    code, _, err = run_cli(base + ["--out", tmp_path / "d", "--endpoint", down, "--concurrency", "0,2"])
    assert code == 2 and "'0' is not a number of clients" in err
    (tmp_path / "other.json").write_text(json.dumps({"methods": {}}))
    for serving, expected in (
        (tmp_path / "missing.json", "not a readable serving.json"),
        (tmp_path / "other.json", "has no 'prompt_lengths': expected the serving.json"),
    ):
        code, _, err = run_cli(base + ["--out", tmp_path / "e", "--endpoint", down, "--compare-serving", serving])
        assert code == 2 and f"--compare-serving {str(serving)!r}" in err and expected in err, err
    assert not any((tmp_path / d).exists() for d in "abcde")


# --- against `transformers serve` ----------------------------------------------------------------

SWEEP_COLUMNS = ("method", "tokens/s", "latency p50 s", "p90 s", "p99 s", "TTFT p50 s")  # eval/sweep/report.py


def table_header(md: str, start: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.slow
def test_load_at_three_levels_beside_the_simulated_sweep(served_toy, run_cli, tmp_path):
    paths, server = served_toy
    common = [
        "--target",
        paths["target"],
        "--prompts",
        paths["prompts"],
        "--limit",
        4,
        "--max-new-tokens",
        6,
        "--no-progress",
        "--device",
        "cpu",
    ]
    code, _, err = run_cli(["eval", *common, "--endpoint", server.url, "--ignore-eos", "--out", tmp_path / "x"])
    assert code == 2 and f"endpoint {server.url} refuses `ignore_eos` (--ignore-eos)" in err  # transformers serve does
    assert not (tmp_path / "x").exists()
    sweep = tmp_path / "sweep"
    code, _, err = run_cli(
        ["eval", *common, "--prompt-lookup", "--batch-sizes", "1,2", "--repeats", 1, "--no-distances", "--out", sweep]
    )
    assert code == 0, err
    out = tmp_path / "engine"
    code, stdout, err = run_cli(
        [
            "eval",
            *common,
            "--endpoint",
            server.url,
            "--prompt-lookup",
            "--no-distances",
            "--repeats",
            1,
            "--concurrency",
            "4,1,2",
            "--requests",
            4,
            "--latency-target",
            30,
            "--compare-serving",
            sweep / "serving.json",
            "--out",
            out,
        ]
    )
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "engine.json", "engine.md", "engine.html"}
    engine = json.loads((out / "engine.json").read_text())
    levels = engine["levels"]
    assert [r["concurrency"] for r in levels] == [1, 2, 4] and engine["prompts_sent_as"] == "text"
    for r in levels:
        assert r["requests"] == 4 and r["errors"] == 0 and r["tokens_from"] == ["usage"]
        assert 0 < r["ttft_s_p50"] <= r["latency_s_p50"] <= r["latency_s_p90"] <= r["latency_s_p99"]
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"]) and 4 <= r["output_tokens"] <= 24
    assert engine["capacity"]["concurrency"] in (1, 2, 4) and "sustains" in engine["capacity"]["reason"]
    assert engine["speculation"]["served"] is None
    assert f"no speculative-decoding counters ({server.url}/metrics answered HTTP 404): load only" in stdout
    assert set(engine["simulated"]) == {"target-only", "prompt-lookup"}
    md = (out / "engine.md").read_text()
    header = table_header(md, "| method | concurrency |")
    simulated_sweep = table_header((sweep / "serving.md").read_text(), "| method | batch |")
    assert all(c in header and c in simulated_sweep for c in SWEEP_COLUMNS)
    for row in ("served: " + engine["served_model"], "simulated: target-only", "simulated: prompt-lookup"):
        assert md.count(f"| {row} |") == 3
    assert "| draftsmith: prompt-lookup (batch 1) |" in md  # the local measurement beside the served one
