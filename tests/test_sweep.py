"""The serving-scale evaluation (`eval/sweep.py`, `draftsmith eval --batch-sizes ...`) on the toy
pair and tiny in-process heads:

- end to end through the command: every section, figure and file; bookkeeping (tokens counted
  = tokens generated per batch size, per-task rows that add up to the whole, steps x rows =
  the rows' target calls, the step histogram's mean = tau); batched greedy acceptance equal to
  the batch-1 decoder's; simulations, sustainable load and costs consistent with each other;
  a self-contained HTML page;
- in-process: Medusa and EAGLE chains and a Medusa tree batched, sampling, an unreachable
  latency target answered in words;
- bad input: one clear error naming the flag (or file and line) and what was expected.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from fixtures import VOCAB
from lifecycle_helpers import toy_eval_args

from draftsmith.decoding.drafters import DraftModelDrafter
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.eval.evaluator import EvalSettings, evaluate, load_prompt_file
from draftsmith.eval.sweep import (
    SweepSettings,
    admission_cost,
    batch_plan,
    measure_verify_curve,
    run_sweep,
    write_serving,
)
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.medusa import MedusaHeads

PNG = b"\x89PNG\r\n\x1a\n"
NEW = 6  # new tokens per prompt (--ignore-eos: exactly this many)
TASKS = ["code", "prose", "code", None]  # the last row has no task


@pytest.fixture(scope="module")
def task_prompts(toy_dir, tmp_path_factory):
    rows = [json.loads(line) for line in (toy_dir / "prompts.jsonl").read_text().splitlines() if line.strip()][:4]
    path = tmp_path_factory.mktemp("prompts") / "tasks.jsonl"
    with path.open("w") as fh:
        for row, task in zip(rows, TASKS):
            fh.write(json.dumps({**row, **({"task": task} if task else {})}) + "\n")
    return path


def eval_args(toy_dir, prompts, out, *extra):
    return toy_eval_args(
        "eval",
        toy_dir,
        *("--draft", toy_dir / "draft", "--prompt-lookup"),
        prompts=prompts,
        max_new_tokens=NEW,
        repeats=2,
        k=3,
        out=out,
        extra=("--ignore-eos", *extra),
    )


@pytest.fixture(scope="module")
def served(toy_dir, task_prompts, tmp_path_factory):
    """One `draftsmith eval` with every serving flag: (out folder, stdout)."""
    from draftsmith.scripts.cli import main

    out = tmp_path_factory.mktemp("served") / "eval"
    args = eval_args(
        toy_dir,
        task_prompts,
        out,
        "--batch-sizes",
        "3,1,2",
        "--qps",
        "5,50",
        "--latency-target",
        10,
        "--price-per-hour",
        2.0,
    )
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([str(a) for a in args]) == 0
    return out, stdout.getvalue()


def _load(out):
    return json.loads((out / "report.json").read_text()), json.loads((out / "serving.json").read_text())


def test_every_file_and_section(served):
    out, stdout = served
    figures = ["acceptance.png", "throughput_vs_batch.png", "latency_cdf.png", "speedup_vs_k.png"]
    for name in figures:
        assert (out / name).read_bytes().startswith(PNG), name
    assert sorted(p.name for p in out.iterdir()) == sorted(
        figures + ["report.json", "report.md", "serving.json", "serving.md", "serving.html"]
    )  # nothing temporary left behind
    md = (out / "serving.md").read_text()
    for heading in (
        "The three A: Acceptance, Acceleration, Attendance",
        "Acceptance by draft position",
        "Per task",
        "Acceleration: throughput vs batch size",
        "Engine step cost",
        "Speedup vs K (autotuner)",
        "Attendance: simulated load",
        "Cost",
    ):
        assert f"## {heading}" in md, heading
    for name in figures:
        assert f"({name})" in md
    _, serving = _load(out)
    assert serving["settings"]["batch_sizes"] == [1, 2, 3] and serving["settings"]["qps"] == [5.0, 50.0]
    assert serving["figures"] == {
        "acceptance": figures[0],
        "throughput": figures[1],
        "latency": figures[2],
        "speedup_vs_k": figures[3],
    }
    assert "The three A (Acceptance, Acceleration, Attendance):" in stdout and "| target-only |" in stdout


def test_html_is_self_contained(served):
    out, _ = served
    page = (out / "serving.html").read_text()
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == 4 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"<link|<script|https?://|href=|url\(", page)


def test_tokens_counted_are_tokens_generated(served):
    out, _ = served
    report, serving = _load(out)
    for name in ("target-only", "draft"):
        assert next(r for r in report["methods"] if r["method"] == name)["new_tokens"] == 2 * 4 * NEW  # batch 1
        entry = serving["methods"][name]
        assert entry["batched"]
        for row in entry["batches"]:
            b = row["batch_size"]
            rows = len(batch_plan(4, b)) * b  # 4 prompts, cycled to fill the last batch: 4, 4, 6 rows
            assert row["rows_per_pass"] == rows == {1: 4, 2: 4, 3: 6}[b]
            assert row["new_tokens_per_pass"] == [rows * NEW] * 2
            assert row["new_tokens"] == 2 * rows * NEW
        pooled = entry["sweep_acceptance"]
        assert pooled["new_tokens"] == sum(r["new_tokens"] for r in entry["batches"])
        # each step advances every active row once: rows x steps = the rows' target calls
        assert sum(int(r) * n for r, n in entry["step_samples"].items()) == pooled["target_calls"]
        # the simulator's tokens per step are the decodes' own: mean = tau
        assert entry["mean_tokens_per_step"] == pytest.approx(pooled["tau"])
        assert sum(entry["tokens_per_step"].values()) == pytest.approx(1.0)
    assert serving["methods"]["target-only"]["tokens_per_step"] == {"1": 1.0}
    assert serving["output_lengths"] == [NEW] * 4 and len(serving["prompt_lengths"]) == 4


def test_batched_acceptance_equals_the_batch1_decoder(served):
    """Greedy and lossless: every row decodes what batch-1 decoding does, so at batch sizes that
    hold each prompt once (1 and 2 of 4 prompts) tau and alpha equal the batch-1 report's."""
    out, _ = served
    report, serving = _load(out)
    draft = next(r for r in report["methods"] if r["method"] == "draft")
    for row in serving["methods"]["draft"]["batches"][:2]:
        assert row["tau"] == pytest.approx(draft["tau"]) and row["alpha"] == pytest.approx(draft["alpha"])
    assert row["batch_size"] == 2


def test_three_a_speedups_and_crossover(served):
    out, stdout = served
    report, serving = _load(out)
    rows = {r["method"]: r for r in serving["three_a"]}
    assert list(rows) == ["target-only", "draft", "prompt-lookup"]
    draft = serving["methods"]["draft"]
    for b, row in zip((1, 2, 3), draft["batches"]):
        assert rows["draft"][f"speedup b={b}"] == row["speedup"] == pytest.approx(sum(row["speedup_per_pass"]) / 2)
        assert rows["target-only"][f"speedup b={b}"] == 1.0
    by_name = {r["method"]: r for r in report["methods"]}
    assert rows["prompt-lookup"]["speedup b=1 (decoder)"] == by_name["prompt-lookup"]["speedup"]
    lookup = serving["methods"]["prompt-lookup"]  # prompt lookup decodes batched too
    assert lookup["batched"] and [r["batch_size"] for r in lookup["batches"]] == [1, 2, 3]
    for b, row in zip((1, 2, 3), lookup["batches"]):
        assert rows["prompt-lookup"][f"speedup b={b}"] == row["speedup"]
    assert rows["prompt-lookup"]["pays"] != "batch 1 only"
    assert lookup["crossover"]["sentence"].startswith("prompt-lookup ") and lookup["crossover"]["sentence"] in stdout
    sentence = draft["crossover"]["sentence"]
    speedups = [r["speedup"] for r in draft["batches"]]
    stop = next((b for b, s in zip((1, 2, 3), speedups) if s <= 1.0), None)
    assert draft["crossover"]["batch_size"] == stop
    assert sentence.startswith("draft ") and sentence in stdout and sentence in (out / "serving.md").read_text()
    assert "batch 1 only" not in stdout


def test_load_capacity_and_cost_agree(served):
    out, _ = served
    _, serving = _load(out)
    for name in ("target-only", "draft"):
        entry = serving["methods"][name]
        capacity = entry["capacity"]
        assert [s["qps"] for s in entry["simulations"]] == [5.0, 50.0]
        for sim in entry["simulations"]:
            assert sim["requests"] == 400 and sim["stable"] == (sim["qps"] < capacity["requests_per_s"])
            assert sim["usd_per_1k_tokens"] == pytest.approx(2.0 / 3600 / sim["tokens_per_s"] * 1000)
        load = entry["sustainable"]
        assert load["qps"] is not None and load["qps"] < capacity["requests_per_s"], load["reason"]
        assert load["latency_s"] <= 10 and load["reason"].startswith("sustains")
        cost = entry["cost"]
        assert cost["at_capacity_usd_per_1k_tokens"] == pytest.approx(2.0 / 3600 / capacity["tokens_per_s"] * 1000)
        assert cost["at_capacity_usd_per_answer"] == pytest.approx(
            2.0 / 3600 / capacity["tokens_per_s"] * capacity["mean_output_tokens"]
        )
        assert cost["at_sustainable_load_usd_per_1k_tokens"] == pytest.approx(2.0 / 3600 / load["tokens_per_s"] * 1000)
        row = next(r for r in serving["three_a"] if r["method"] == name)
        assert row["req/s at p90 <= 10 s"] == load["qps"]
        assert row["$/1k tokens"] == cost["at_sustainable_load_usd_per_1k_tokens"]


def test_per_task_rows_sum_to_the_whole(served):
    out, _ = served
    report, serving = _load(out)
    for method in report["methods"]:
        tasks = method["tasks"]
        assert [t["task"] for t in tasks] == ["code", "prose", "(no task)"]
        assert [t["prompts"] for t in tasks] == [2, 1, 1]
        for key in ("new_tokens", "target_calls"):
            assert sum(t[key] for t in tasks) == method[key]
        assert sum(t["new_tokens"] for t in tasks) == 2 * 4 * NEW  # 2 passes x 4 prompts
    rows = [r for r in serving["tasks"] if r["method"] == "draft"]
    assert [r["task"] for r in rows] == ["code", "prose", "(no task)"]
    assert "| task | target-only | draft | prompt-lookup |" in (out / "serving.md").read_text()


def test_autotuner_curve_from_the_measured_costs(served):
    out, _ = served
    report, serving = _load(out)
    tuning = serving["tuning"]
    assert list(tuning) == ["draft", "prompt-lookup"]  # every chain drafter
    draft = next(r for r in report["methods"] if r["method"] == "draft")
    # K = 0 .. the last draft position the decodes reached (at most K = 3)
    reached = next((i for i, a in enumerate(draft["alpha_per_position"]) if a is None), 3)
    assert [c["setting"] for c in tuning["draft"]["candidates"]] == [f"K={k}" for k in range(reached + 1)]
    assert tuning["draft"]["measured_speedup"] == {"3": draft["speedup"]}
    assert sorted(serving["verify_seconds"]) == ["1", "2", "3", "4"] and min(serving["verify_seconds"].values()) > 0
    chosen = max(tuning["draft"]["candidates"], key=lambda c: c["speedup"])
    assert chosen["chosen"] and tuning["draft"]["chosen"]["num_speculative_tokens"] == int(chosen["setting"][2:])


def test_without_batch_sizes_nothing_changes(toy_dir, task_prompts, tmp_path, run_cli):
    out = tmp_path / "eval"
    code, _, err = run_cli(eval_args(toy_dir, task_prompts, out, "--no-distances"))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def test_the_sweep_on_the_static_path(toy_dir, task_prompts, served, tmp_path, run_cli):
    """`--static-cache` with `--batch-sizes`: the batched decoder over its static ragged caches
    decodes the same tokens (greedy), so every batched row's counts and tau are the default's."""
    out = tmp_path / "eval"
    code, _, err = run_cli(eval_args(toy_dir, task_prompts, out, "--batch-sizes", "3,1,2", "--static-cache"))
    assert code == 0, err
    (_, default), (_, static) = _load(served[0]), _load(out)
    assert static["settings"]["path"] == "static cache" and default["settings"]["path"] == "default"
    batched = [name for name, entry in default["methods"].items() if entry["batched"]]
    assert len(batched) >= 2
    for name in batched:
        for a, b in zip(default["methods"][name]["batches"], static["methods"][name]["batches"], strict=True):
            assert (a["batch_size"], a["new_tokens"], a["tau"]) == (b["batch_size"], b["new_tokens"], b["tau"]), name
    assert "Decoding path: static cache" in (out / "serving.md").read_text()


# ---------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def heads(pairs):
    target, _ = pairs("llama")
    torch.manual_seed(0)
    medusa = MedusaHeads.for_target(target, num_heads=3).eval()
    eagle = EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, 1, 2]).eval()
    return medusa, eagle


def test_each_method_at_its_own_k_against_one_baseline(pairs):
    """`num_draft_tokens` gives each named method its own K; the others keep the settings' K."""
    target, draft = pairs("llama")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 8)]
    drafters = {"k1": DraftModelDrafter(draft), "k3": DraftModelDrafter(draft), "default": DraftModelDrafter(draft)}
    settings = EvalSettings(num_draft_tokens=2, max_new_tokens=12, repeats=1, ignore_eos=True, measure_distances=False)
    report = evaluate(target, drafters, prompts, settings, progress=False, num_draft_tokens={"k1": 1, "k3": 3})
    rows = {row["method"]: row for row in report["methods"]}
    assert list(rows) == ["target-only", "k1", "k3", "default"]
    assert 0.5 < rows["k1"]["mean_drafts_per_call"] <= 1.0  # the last call of a decode may propose fewer
    assert 2.0 < rows["k3"]["mean_drafts_per_call"] <= 3.0
    assert 1.0 < rows["default"]["mean_drafts_per_call"] <= 2.0
    assert all(rows[name]["identical_to_target_only"] for name in drafters)
    with pytest.raises(ValueError, match=r"\['nope'\], which are not methods"):
        evaluate(target, drafters, prompts, settings, progress=False, num_draft_tokens={"nope": 2})


def test_medusa_and_eagle_chains_and_a_tree_batched_and_sampling(pairs, heads, tmp_path):
    target, draft = pairs("llama")
    medusa, eagle = heads
    layers = target.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 9, 3)]
    drafters = {
        "draft": DraftModelDrafter(draft),
        "medusa-chain": MedusaDrafter(medusa, layers),
        "medusa-tree": MedusaDrafter(medusa, layers, tree=[(0,), (1,), (0, 0)]),
        "eagle-chain": EagleDrafter(eagle),
    }
    settings = EvalSettings(
        num_draft_tokens=2, max_new_tokens=5, temperature=1.0, repeats=1, ignore_eos=True, measure_distances=False
    )
    report = evaluate(target, drafters, prompts, settings, progress=False)
    sweep = SweepSettings(batch_sizes=(2, 1), latency_target_s=1e-9, price_per_hour=0.0)
    serving = run_sweep(target, drafters, prompts, settings, sweep, report=report, progress=False)
    methods = serving["methods"]
    assert (
        [n for n, e in methods.items() if e["batched"]]
        == list(methods)
        == ["target-only", "draft", "medusa-chain", "medusa-tree", "eagle-chain"]
    )
    for name in ("target-only", "draft", "medusa-chain", "medusa-tree", "eagle-chain"):
        rows = {r["batch_size"]: r for r in methods[name]["batches"]}
        assert rows[1]["new_tokens"] == 3 * 5 and rows[2]["new_tokens"] == 4 * 5  # 3 prompts; batch 2 cycles one
        load = methods[name]["sustainable"]
        assert load["qps"] is None and load["reason"].startswith("unreachable"), load
        assert methods[name]["cost"]["at_capacity_usd_per_1k_tokens"] == 0.0  # a free engine
    row = next(r for r in serving["three_a"] if r["method"] == "eagle-chain")
    assert row["req/s at p90 <= 1e-09 s"] == "unreachable"
    assert set(serving["tuning"]) == {"draft", "medusa-chain", "eagle-chain"}  # chains: the tree has a tuner of its own
    paths = write_serving(serving, tmp_path / "out", report=report)
    assert sorted(p.name for p in paths) == sorted(
        ["acceptance.png", "throughput_vs_batch.png", "speedup_vs_k.png", "serving.json", "serving.md", "serving.html"]
    )
    md = (tmp_path / "out" / "serving.md").read_text()
    assert "batch 1 only" not in md
    assert "## Attendance: simulated load" in md and "unreachable" in md and "$0" in md
    saved = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert not any(k.startswith("_") for e in saved["methods"].values() for k in e)
    with pytest.raises(ValueError, match="baseline's name"):
        run_sweep(target, {"target-only": drafters["draft"]}, prompts, settings, sweep, progress=False)


def test_verify_curve(pairs):
    target, _ = pairs("llama")
    context = torch.arange(3, 23)
    curve = measure_verify_curve(target, context, [3, 1, 2], repeats=2)
    assert list(curve) == [1, 2, 3] and all(v > 0 for v in curve.values())
    with pytest.raises(ValueError, match="needs at least 21"):
        measure_verify_curve(target, context, [20])


def test_admission_cost_is_fitted_per_request_and_per_token():
    steps = {1: 0.010, 2: 0.012}
    # prefill 1 ms + 0.1 ms per prompt token, and a first step 5 ms dearer than usual (the draft reads the prompt)
    one = [(t, 0.001 + 0.0001 * t, 0.010 + 0.005, 1) for t in (10, 20, 40)]
    assert admission_cost(one, steps) == pytest.approx((0.006, 0.0001))
    # batches of two requests share the intercept
    two = [(t, 0.002 + 0.0001 * t, 0.012, 2) for t in (10, 30)]
    assert admission_cost(two, steps) == pytest.approx((0.001, 0.0001))
    # a first step cheaper than usual adds nothing; one prompt length: all of it per token
    assert admission_cost([(10, 0.001, 0.005, 1)], steps) == pytest.approx((0.0, 0.0001))
    with pytest.raises(ValueError, match="no batches measured"):
        admission_cost([], steps)


def test_batch_plan_and_settings():
    assert batch_plan(5, 2) == [[0, 1], [2, 3], [4, 0]]
    assert batch_plan(2, 4) == [[0, 1, 0, 1]]
    assert SweepSettings(batch_sizes=(8, 1, 2), qps=(2, 0.5)).batch_sizes == (1, 2, 8)
    for kwargs, message in [
        ({"batch_sizes": ()}, "batch_sizes is empty"),
        ({"batch_sizes": (1, 0)}, "batch size 0; expected integers >= 1"),
        ({"batch_sizes": (2, 2)}, "repeat a value"),
        ({"batch_sizes": (1,), "qps": (0.0,)}, "QPS 0.0; expected arrival rates > 0"),
        ({"batch_sizes": (1,), "qps": (math.inf,)}, "QPS inf"),
        ({"batch_sizes": (1,), "latency_target_s": 0}, "latency target 0; expected seconds > 0"),
        ({"batch_sizes": (1,), "percentile": 0}, r"percentile 0; expected a number in \(0, 100\]"),
        ({"batch_sizes": (1,), "price_per_hour": -1.0}, "price per hour -1.0; expected a price >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            SweepSettings(**kwargs)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--batch-sizes", "0,2"],
            "argument --batch-sizes: --batch-sizes '0,2': '0' is not a batch size (an integer >= 1)",
        ),
        (["--batch-sizes", "1,two"], "'two' is not a batch size"),
        (["--batch-sizes", "2,2"], "--batch-sizes '2,2' repeats a value"),
        (["--batch-sizes", "1", "--qps", "0"], "--qps '0': '0' is not an arrival rate (requests per second > 0)"),
        (["--batch-sizes", "1", "--qps", "1,-2"], "'-2' is not an arrival rate"),
        (["--batch-sizes", "1", "--latency-target", "0"], "--latency-target must be > 0 seconds, got 0"),
        (["--batch-sizes", "1", "--latency-target", "-3"], "--latency-target must be > 0 seconds, got -3"),
        (["--batch-sizes", "1", "--percentile", "101"], "--percentile must be in (0, 100], got 101"),
        (["--batch-sizes", "1", "--price-per-hour", "-1"], "--price-per-hour must be >= 0 dollars per hour, got -1"),
        (["--qps", "1", "--latency-target", "2"], "--qps, --latency-target need --batch-sizes"),
    ],
)
def test_bad_serving_flags(toy_dir, task_prompts, tmp_path, run_cli, extra, message):
    code, _, err = run_cli(eval_args(toy_dir, task_prompts, tmp_path / "e", *extra))
    assert code == 2 and message in err, err
    assert not (tmp_path / "e").exists()


def test_bad_task_field(toy_dir, tmp_path, run_cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():", "task": "code"}\n{"prompt": "x = 1", "task": 3}\n')
    code, _, err = run_cli(eval_args(toy_dir, bad, tmp_path / "e", "--batch-sizes", "1"))
    assert code == 2 and f'{bad} line 2: "task" (the task) must be a non-empty string' in err, err
    assert not (tmp_path / "e").exists()
    kinds = tmp_path / "kinds.jsonl"
    kinds.write_text('{"input_ids": [5, 6], "kind": "body"}\n{"input_ids": [7], "kind": "signature"}\n')
    assert load_prompt_file(kinds, task_key="kind")[1] == ["body", "signature"]
    assert load_prompt_file(kinds)[1] == [None, None]


def test_several_drafters_are_named_apart(tmp_path):
    from draftsmith.eval.drafter_specs import SpecError, parse_drafters

    def names(*values):
        return {d.name: d.folder for d in parse_drafters(values)}

    (tmp_path / "a" / "draft").mkdir(parents=True)
    (tmp_path / "b" / "draft").mkdir(parents=True)
    a, b = str(tmp_path / "a" / "draft"), str(tmp_path / "b" / "draft")
    assert names(f"draft={a}") == {"draft": a}
    assert names(f"draft={a}", f"draft={b}") == {"a/draft": a, "b/draft": b}
    assert names(f"draft:small={a}", f"draft={b}") == {"small": a, "draft": b}
    assert names(f"eagle={a}", f"eagle:mine={b}") == {"draft": a, "mine": b}  # one of several: its folder
    assert names(f"eagle:mine={b}") == {"mine": b}
    with pytest.raises(SpecError, match="the row 'x' is draft"):
        names(f"draft:x={a}", f"draft:x={b}")
    with pytest.raises(SpecError, match="the row 'x-chain' is"):
        names(f"medusa:x={a}", f"eagle:x={b}")
    with pytest.raises(SpecError, match="the row 'target-only' is another method's"):
        names(f"draft:target-only={a}")
    with pytest.raises(SpecError, match="unknown drafter kind 'hydra': expected one of draft, medusa"):
        names(f"hydra={a}")
    with pytest.raises(SpecError, match="expected KIND"):
        names(a)
