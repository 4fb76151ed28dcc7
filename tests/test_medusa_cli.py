"""`draftsmith eval --medusa` and `draftsmith export` on heads trained by train/medusa.py."""

import json

import pytest
import torch
from lifecycle_helpers import toy_eval_args, toy_recipe

from draftsmith.heads.medusa import load_medusa
from draftsmith.heads.toy import tiny_model, tiny_tokenizer
from draftsmith.train.medusa import MedusaRecipe, train


@pytest.fixture(scope="module")
def heads_dir(toy_dir, toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa") / "run"
    values = toy_recipe(toy_dir, toy_data, out, num_heads=3, max_steps=8, eval_every=8, heldout_fraction=0.2, lr=1e-2)
    train(MedusaRecipe(**values | dict(warmup_steps=MedusaRecipe.warmup_steps)), progress=False)  # its 20-step warm-up
    return out / "heads"


def eval_args(toy_dir, heads_dir, out, *extra):
    return toy_eval_args("eval", toy_dir, "--medusa", heads_dir, limit=2, max_new_tokens=10, out=out, extra=extra)


def test_eval_medusa_chain_and_auto_tree(toy_dir, heads_dir, tmp_path, run_cli):
    code, stdout, err = run_cli(
        eval_args(toy_dir, heads_dir, tmp_path / "e", "--medusa-tree", "auto", "--tree-nodes", 6, "-k", 3)
    )
    assert code == 0, err
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert {"medusa-chain", "medusa-tree"} <= set(rows) and report["lossless"]
    assert rows["medusa-tree"]["tree"] and rows["medusa-tree"]["predicted_speedup"] is None
    assert 1.0 <= rows["medusa-tree"]["tau"] <= 4.0 and "medusa-tree" in stdout


def test_typical_acceptance_is_labelled_lossy(toy_dir, heads_dir, tmp_path, run_cli):
    code, stdout, err = run_cli(
        eval_args(toy_dir, heads_dir, tmp_path / "e", "--lossy", "typical", "--temperature", 1.0, "--no-distances")
    )
    assert code == 0, err
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["lossless"] is False and "(LOSSY typical)" in stdout
    row = next(r for r in report["methods"] if r["method"] == "medusa-chain")
    assert row["lossy"] and row["lossy_kl_per_token"] is not None


def test_bad_medusa_input(toy_dir, heads_dir, tmp_path, run_cli):
    code, _, err = run_cli(eval_args(toy_dir, heads_dir, tmp_path / "e", "--medusa-tree", "[[0,0,0,0]]"))
    assert code == 2 and "deeper than the number of heads" in err
    code, _, err = run_cli(eval_args(toy_dir, heads_dir, tmp_path / "e", "--medusa-tree", "zero"))
    assert code == 2 and "JSON list of paths" in err
    args = eval_args(toy_dir, heads_dir, tmp_path / "e")
    args[args.index("--medusa") : args.index("--medusa") + 2] = ["--prompt-lookup", "--medusa-tree", "auto"]
    code, _, err = run_cli(args)
    assert code == 2 and "give --drafter medusa=DIR" in err
    # heads trained on another target: a hidden-size mismatch is an error naming both sizes
    other = tmp_path / "other"
    tiny_model("llama", hidden=64).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    args = eval_args(toy_dir, heads_dir, tmp_path / "e")
    args[args.index("--target") + 1] = other
    code, _, err = run_cli(args)
    assert code == 2 and "48" in err and "64" in err


@pytest.mark.parametrize("fmt", ["medusa", "vllm"])
def test_export_round_trip(heads_dir, tmp_path, run_cli, fmt):
    out = tmp_path / fmt
    code, stdout, err = run_cli(["export", heads_dir, "--format", fmt, "--out", out])
    assert code == 0, err
    a, b = load_medusa(heads_dir), load_medusa(out)
    hidden = torch.randn(2, 5, a.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(a(hidden), b(hidden))
    code, _, err = run_cli(["export", heads_dir, "--format", fmt, "--out", out])
    assert code == 2 and str(out) in err  # refuses to overwrite
    code, _, err = run_cli(["export", heads_dir, "--format", "sglang", "--out", tmp_path / "x"])
    assert code == 2 and "expected one of vllm, medusa, hf" in err
