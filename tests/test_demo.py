"""The demo target build (micro preset, seconds), its cache, `draftsmith demo --quick`, and
their answers to bad input."""

import json
import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.train import demo_target as dt
from draftsmith.train.lm import LMTrainConfig, bf16_is_fast, lr_at

# Even smaller than micro, for the tests that rebuild: the pipeline, not the model, is tested.
NANO = replace(dt.PRESETS["micro"], name="nano", target_steps=3, draft_steps=3, warmup_steps=1, num_train_prompts=8, num_heldout_prompts=4)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    logs = []
    built = dt.ensure_demo_target("micro", cache_dir=cache, progress=False, log=logs.append)
    return cache, built, logs


def test_micro_build_is_loadable_and_documented(micro):
    cache, built, _ = micro
    assert built.folder == cache / "demo-target-micro"
    tok = AutoTokenizer.from_pretrained(built.target)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    assert len(tok) == dt.PRESETS["micro"].vocab_size
    ids = tok("def f(x):\n    return x").input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "def f(x):\n    return x"
    for folder in (built.target, built.draft):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.model_type == "llama"
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()
    assert AutoTokenizer.from_pretrained(built.draft).get_vocab() == tok.get_vocab()

    manifest = json.loads((built.folder / dt.MANIFEST).read_text())
    for role in ("target", "draft"):
        r = manifest["models"][role]
        assert r["tokens_seen"] > 0 and math.isfinite(r["heldout_perplexity"]) and math.isfinite(r["final_train_loss"])
    # The sanity check of the whole stack: the target drafting for itself is always accepted.
    assert manifest["quality"]["self_draft_greedy"]["alpha"] == 1.0
    for key in ("small_draft_greedy", "small_draft_t1"):
        assert 0.0 <= manifest["quality"][key]["alpha"] <= 1.0
    rep = manifest["quality"]["repetition"]
    micro = dt.PRESETS["micro"]
    assert rep["n"] == 4 and rep["answers"] == micro.repetition_prompts and rep["new_tokens"] == micro.repetition_new_tokens
    assert 0.0 <= rep["pooled"] <= 1.0 and len(rep["per_answer"]) == rep["answers"]
    card = built.model_card.read_text()
    for text in ("standard library", "held-out perplexity", "tokens seen", "self-draft", "T = 1", "Greedy samples", "of their 4-grams"):
        assert text in card, text
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_prompts_come_from_their_split_and_end_at_a_line_end(micro):
    _, built, _ = micro
    heldout_files = set(built.manifest["corpus"]["heldout_file_list"])
    train = [json.loads(line) for line in built.train_prompts.read_text().splitlines()]
    heldout = [json.loads(line) for line in built.heldout_prompts.read_text().splitlines()]
    assert train and heldout
    assert all(r["file"] in heldout_files for r in heldout)
    assert not any(r["file"] in heldout_files for r in train)
    for r in train + heldout:
        assert r["prompt"] and r["prompt"] == r["prompt"].rstrip()
        assert r["kind"] in ("signature", "docstring", "first-line")
        assert "def " in r["prompt"]


def test_a_second_call_reuses_the_cache(micro, monkeypatch):
    cache, built, _ = micro
    monkeypatch.setattr(dt, "build_into", lambda *a, **k: pytest.fail("rebuilt a valid cache"))
    logs = []
    again = dt.ensure_demo_target("micro", cache_dir=cache, progress=False, log=logs.append)
    assert again.folder == built.folder and "using the cached demo target" in logs[0]


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
        (lambda f: (f / "draft" / "config.json").unlink(), "is missing"),
    ],
)
def test_damaged_cache_is_detected(tmp_path, damage, reason):
    logs = []
    built = dt.ensure_demo_target(NANO, cache_dir=tmp_path, progress=False, log=logs.append)
    key = built.manifest["build_key"]
    assert dt.check_cached(built.folder, key) is None
    assert "another preset" in dt.check_cached(built.folder, "0" * 64)
    damage(built.folder)
    assert reason in dt.check_cached(built.folder, key)
    # ... and rebuilt, never used.
    logs.clear()
    again = dt.ensure_demo_target(NANO, cache_dir=tmp_path, progress=False, log=logs.append)
    assert any(line.startswith("rebuilding the demo target:") and reason in line for line in logs)
    assert dt.check_cached(again.folder, key) is None
    assert [p.name for p in tmp_path.iterdir()] == ["demo-target-nano"]


def test_interrupted_build_leaves_nothing_loadable(tmp_path, monkeypatch, run_cli):
    import draftsmith.train.lm as lm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm, "train_lm", interrupted)
    code, _, err = run_cli(["build-target", "--preset", "micro", "--cache-dir", tmp_path, "--no-progress"])
    assert code == 130 and "interrupted" in err and "nothing was cached" in err
    assert list(tmp_path.iterdir()) == []  # the temporary build folder was removed


def test_unwritable_cache_dir(tmp_path, run_cli):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, _, err = run_cli(["build-target", "--preset", "micro", "--cache-dir", blocker / "cache", "--no-progress"])
    assert code == 2 and "is not writable" in err and "--cache-dir" in err


@pytest.mark.parametrize("command", ["build-target", "demo"])
def test_unknown_preset(tmp_path, run_cli, command):
    code, _, err = run_cli([command, "--preset", "huge", "--cache-dir", tmp_path, "--no-progress"])
    assert code == 2 and "unknown preset 'huge'" in err and "cpu, gpu, micro" in err
    assert list(tmp_path.iterdir()) == []


def test_sampled_temperature_must_not_be_negative(tmp_path, run_cli):
    code, _, err = run_cli(["demo", "--sampled-temperature", "-1", "--cache-dir", tmp_path, "--no-progress"])
    assert code == 2 and "--sampled-temperature must be >= 0 (0 = no second table), got -1" in err
    assert list(tmp_path.iterdir()) == []


def test_presets_are_validated():
    with pytest.raises(ValueError, match="invalid warmup_steps"):
        replace(NANO, warmup_steps=100)
    with pytest.raises(ValueError, match="must divide"):
        dt.ModelShape(hidden=30, layers=1, heads=4, kv_heads=2, intermediate=8)


@pytest.mark.parametrize("amx, avx512_bf16, fast", [(False, False, False), (True, False, True), (False, True, True)])
def test_bf16_autocast_only_where_the_cpu_has_bf16_units(monkeypatch, amx, avx512_bf16, fast):
    """The cpu preset asks for bf16; a CPU without bf16 units emulates it (15x slower), so the
    build trains in fp32 there."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert bf16_is_fast("cpu") is fast
    assert bf16_is_fast("meta") is False


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = LMTrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.01)
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 99))


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path, run_cli):
    out = tmp_path / "demo"
    code, stdout, _ = run_cli(["demo", "--quick", "--cache-dir", tmp_path / "cache", "--out", out, "--no-progress"])
    assert code == 0
    assert "| method | alpha | acc. rate | tau | speedup | OOV | KL |" in stdout and "counting the bonus token" in stdout
    assert "of their 4-grams" in stdout and "sampling" in stdout  # the loop share heads the greedy and T = 1 tables
    report = json.loads((out / "report.json").read_text())
    assert [r["method"] for r in report["methods"]] == [
        "target-only", "prompt-lookup", "small-draft", "distilled-draft", "medusa-chain", "medusa-tree", "eagle3-chain", "eagle3-tree",
        "dflash", "peagle",
    ]  # fmt: skip
    for row in report["methods"][1:]:
        for key in ("alpha", "tau", "speedup", "tokens_per_second"):
            assert math.isfinite(row[key]), (row["method"], key)
        assert 0 <= row["alpha"] <= 1 and len(row["alpha_per_position"]) == 3
    assert math.isfinite(report["methods"][2]["kl_mean"])
    sampled = report["demo"]["sampled"]
    assert [r["method"] for r in sampled["methods"]] == [r["method"] for r in report["methods"]] and sampled["repeats"] == 1
    assert 0.0 <= report["demo"]["target_repetition"]["pooled"] <= 1.0
    md = (out / "report.md").read_text()
    assert md.startswith("# draftsmith evaluation") and "## Demo target" in md and "acceptance.png" in md
    assert "## The same methods at sampling" in md
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert report["demo"]["demo_target"]["quality"]["self_draft_greedy"]["alpha"] == 1.0
    # Medusa heads were trained once on the target's own answers and cached beside the target
    heads = tmp_path / "cache" / "demo-heads-micro"
    assert (heads / "data" / "summary.json").is_file() and (heads / "medusa" / "heads" / "config.json").is_file()
    assert report["drafts"]["medusa"] == str(heads / "medusa" / "heads")
    assert report["methods"][5]["tree"] and report["methods"][5]["predicted_speedup"] is None
    assert report["drafts"]["distilled-draft"] == str(heads / "distilled-draft" / "draft")
    assert (heads / "distilled-draft" / "training_summary.json").is_file()
    assert report["drafts"]["eagle3"] == str(heads / "eagle3" / "head") and report["methods"][7]["tree"]
    assert report["drafts"]["dflash"] == str(heads / "dflash" / "head")
    assert report["drafts"]["peagle"] == str(heads / "peagle" / "head")


def test_train_lm_learns_a_repeating_stream_and_restores_threads():
    from draftsmith.heads.toy import tiny_config
    from draftsmith.train.lm import train_lm

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", hidden=32, layers=1))
    stream = torch.arange(40, dtype=torch.int32).repeat(50)  # 0..39 over and over: predictable
    cfg = LMTrainConfig(steps=40, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=4, bf16=False, eval_batches=2)
    threads = torch.get_num_threads()
    result = train_lm(model, stream, stream[:500], cfg, progress=False)
    assert torch.get_num_threads() == threads
    assert result.losses[0] == pytest.approx(math.log(model.config.vocab_size), abs=0.5)  # ~uniform at init
    assert result.heldout_loss < 0.5 * result.losses[0]
    assert result.tokens_seen == 40 * 4 * 32 and not model.training
