"""The `draftsmith` command end to end on a toy pair, and its answers to bad input."""

import json
import math

import pytest
import torch
from lifecycle_helpers import toy_eval_args

from draftsmith.distill.sources import SourceError
from draftsmith.eval.evaluator import load_prompts
from draftsmith.heads.toy import tiny_model, tiny_tokenizer
from draftsmith.scripts.cli import main


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "pair"
    assert main(["make-toy", "--out", str(out)]) == 0
    return out


def eval_args(toy, out, *extra):
    return toy_eval_args(
        "eval",
        toy,
        *("--draft", toy / "draft", "--prompt-lookup"),
        limit=3,
        max_new_tokens=12,
        out=out,
        device=None,
        extra=extra,
    )


def test_make_toy_writes_a_loadable_pair(toy):
    assert (toy / "target" / "config.json").is_file()
    assert (toy / "draft" / "tokenizer.json").is_file()
    assert len(load_prompts(toy / "prompts.jsonl", tiny_tokenizer())) == 16
    assert not [p for p in toy.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_eval_end_to_end(toy, tmp_path, run_cli, temperature):
    out = tmp_path / "eval"
    code, stdout, _ = run_cli(eval_args(toy, out, "--temperature", temperature))
    assert code == 0
    assert "counting the bonus token" in stdout
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# draftsmith evaluation")
    assert [r["method"] for r in report["methods"]] == ["target-only", "draft", "prompt-lookup"]
    assert report["tau_counts_bonus_token"] is True
    base, draft, lookup = report["methods"]
    assert base["tau"] == 1.0 and base["speedup"] == 1.0
    for row in (draft, lookup):
        for key in ("alpha", "tau", "speedup", "tokens_per_second", "predicted_speedup", "ttft_ms_p50"):
            assert math.isfinite(row[key]), key
        assert 0.0 <= row["alpha"] <= 1.0
        assert 1.0 <= row["tau"] <= 5.0
    assert math.isfinite(draft["kl_mean"]) and draft["kl_mean"] >= 0
    assert lookup["kl_mean"] is None  # prompt lookup has no distribution
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # atomic writes left no temp file


@pytest.mark.parametrize(
    "extra, message",
    [
        (["-k", "0"], "--num-draft-tokens must be >= 1"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
    ],
)
def test_eval_rejects_bad_settings(toy, tmp_path, run_cli, extra, message):
    code, _, err = run_cli(eval_args(toy, tmp_path / "out", *extra))
    assert code == 2
    assert message in err
    assert not (tmp_path / "out").exists()


def test_eval_needs_a_drafter(toy, tmp_path, run_cli):
    args = ["eval", "--target", toy / "target", "--prompts", toy / "prompts.jsonl", "--out", tmp_path / "o"]
    code, _, err = run_cli(args)
    assert code == 2 and "give a drafter: --drafter KIND[:NAME]=DIR (kinds: draft, medusa, eagle" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("", "has no rows"),
        ('{"prompt": "def f():"}\n{"prompt": oops}\n', "prompts.jsonl line 2: malformed JSON"),
        ('{"body": "def f():"}\n', "prompts.jsonl: no usable column; found ['body'], expected 'messages'"),
        ('{"input_ids": []}\n', "prompts.jsonl line 1: 'input_ids' must be a non-empty list"),
    ],
)
def test_eval_rejects_bad_prompt_files(toy, tmp_path, run_cli, content, message):
    prompts = tmp_path / "prompts.jsonl"
    if content is not None:
        prompts.write_text(content)
    args = eval_args(toy, tmp_path / "out")
    args[args.index("--prompts") + 1] = prompts
    code, _, err = run_cli(args)
    assert code == 2
    assert message in err and str(prompts) in err


def test_eval_rejects_a_draft_with_another_vocabulary(toy, tmp_path, run_cli):
    other = tmp_path / "other-draft"
    tiny_model("llama").save_pretrained(other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra_token>"])  # same model shape, different token strings
    tok.save_pretrained(other)
    args = eval_args(toy, tmp_path / "out")
    args[args.index("--draft") + 1] = other
    code, _, err = run_cli(args)
    assert code == 2 and "draft vocabulary differs from the target's" in err


def test_eval_rejects_a_missing_target(tmp_path, toy, run_cli):
    args = eval_args(toy, tmp_path / "out")
    args[args.index("--target") + 1] = tmp_path / "nowhere"
    code, _, err = run_cli(args)
    assert code == 2 and "target folder" in err and "does not exist" in err


def test_load_prompts_accepts_token_ids_and_skips_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input_ids": [5, 6, 7]}\n\n{"input_ids": [8]}\n')
    prompts = load_prompts(path)  # token ids need no tokenizer
    assert prompts[0].tolist() == [5, 6, 7] and prompts[1].dtype == torch.long
    text = tmp_path / "t.jsonl"
    text.write_text('{"prompt": "x = 1"}\n')
    assert load_prompts(text, tiny_tokenizer())[0].numel() > 0
    with pytest.raises(SourceError, match="needs a tokenizer"):
        load_prompts(text, tokenizer=None)


@pytest.mark.slow
def test_check_lossless_passes_on_the_toy_pair(toy, run_cli):
    args = [
        "check-lossless",
        "--target",
        toy / "target",
        "--draft",
        toy / "draft",
        "--prompt-lookup",
        "--samples",
        400,
        "-k",
        2,
        "--no-progress",
    ]
    code, stdout, _ = run_cli(args)
    assert stdout.count("PASS") == 2, stdout
    assert code == 0


def test_check_lossless_rejects_greedy(toy, run_cli):
    args = ["check-lossless", "--target", toy / "target", "--draft", toy / "draft", "--temperature", "0"]
    code, _, err = run_cli(args)
    assert code == 2 and "--temperature must be > 0" in err
