"""`draftsmith tune` end to end on the toy pair and tiny heads: it measures acceptance per position
(checked against a batch-1 decode), the draft cost and the verify cost curve, chooses with
eval/tune.py, checks the choice with a timed decode, and `--write` records a setting that the
loaders still read. Where the choice must be known in advance the verify cost curve is injected
(a flat 1 s per verification, so drafting is nearly free and the longest chain of a perfect
draft wins); everything else runs for real."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lifecycle_helpers import toy_eval_args

from draftsmith.decoding import generate
from draftsmith.decoding.drafters import DraftModelDrafter
from draftsmith.eval import sweep
from draftsmith.eval.evaluator import load_prompts
from draftsmith.eval.tune import write_setting
from draftsmith.heads.eagle import EagleHead, load_eagle
from draftsmith.heads.medusa import MedusaHeads, load_medusa
from draftsmith.heads.models import load_causal_lm, load_tokenizer
from draftsmith.heads.registry import METHODS

PNG = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")


def tune_args(toy_dir, flag, folder, out, *extra):
    return toy_eval_args("tune", toy_dir, flag, folder, limit=3, max_new_tokens=8, out=out, extra=extra)


@pytest.fixture
def flat_verify(monkeypatch):
    """v(n) = 1 s for every n: verification dwarfs drafting, so K is chosen by tau alone."""
    sizes_seen = []

    def fake(target, context, sizes, *, hidden_layers=(), repeats=sweep.VERIFY_REPEATS):
        sizes_seen.append(sorted(sizes))
        return {n: 1.0 for n in sorted(sizes)}

    monkeypatch.setattr(sweep, "measure_verify_curve", fake)
    return sizes_seen


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def test_self_draft_writes_the_longest_chain(toy_dir, tmp_path, run_cli, flat_verify):
    """A copy of the target as its own draft accepts every greedy draft (alpha = 1 at every
    position): with verification costing 1 s, K = k_max is fastest, is checked and recorded."""
    draft = tmp_path / "self-draft"
    shutil.copytree(toy_dir / "target", draft)
    before = _config(draft)
    code, out, err = run_cli(tune_args(toy_dir, "--draft", draft, tmp_path / "tune", "--k-max", 3, "--write"))
    assert code == 0, err
    assert flat_verify == [[1, 2, 3, 4]]  # v(n) for n = 1..k_max + 1
    assert "alpha per position 1.00 1.00 1.00" in out and "| K=3 (chosen) | 4.00 |" in out
    assert "chosen: chain K=3" in out and "check at K=3 (1 timed passes): measured" in out
    speculation = _config(draft)["draftsmith"]["speculation"]
    record = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert speculation == record["chosen"]
    assert speculation["num_speculative_tokens"] == 3 and speculation["kind"] == "chain"
    assert speculation["predicted_tau"] == pytest.approx(4.0)
    assert record["measurement"]["alpha_per_position"] == [1.0, 1.0, 1.0]
    assert record["measurement"]["verify_seconds"] == {"1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0}
    assert record["measured_speedup"] > 0 and record["measured_over_predicted"] == pytest.approx(
        record["measured_speedup"] / speculation["predicted_speedup"]
    )
    assert (tmp_path / "tune" / "speedup_vs_k.png").read_bytes().startswith(PNG)
    # nothing else in the config moved, and the draft still loads and decodes
    assert {k: v for k, v in _config(draft).items() if k != "draftsmith"} == before
    model = load_causal_lm(draft, device=CPU, dtype=torch.float32, role="draft")
    assert model.config.draftsmith["speculation"]["num_speculative_tokens"] == 3
    code, _, err = run_cli(
        toy_eval_args(
            "eval", toy_dir, "--draft", draft, limit=1, max_new_tokens=4, out=tmp_path / "e", extra=["--no-distances"]
        )
    )
    assert code == 0, err


def test_medusa_chain_or_tree_is_recorded_and_loads(toy_dir, tmp_path, run_cli, flat_verify):
    target = load_causal_lm(toy_dir / "target", device=CPU, dtype=torch.float32, role="target")
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, num_heads=3)
    heads.config.head_accuracies = [[0.9, 0.05], [0.8, 0.1], [0.7]]  # as train/medusa.py records them
    folder = tmp_path / "medusa"
    heads.save_pretrained(folder)
    code, out, err = run_cli(
        tune_args(toy_dir, "--medusa", folder, tmp_path / "tune", "--tree-budgets", "2,4", "--write")
    )
    assert code == 0, err
    assert "drafts at most 3 tokens per call: K is searched up to 3, not 8" in out
    assert flat_verify == [[1, 2, 3, 4, 5]]  # the chain's 1..4 and the trees' 2 + 1, 4 + 1
    record = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    chain, tree = record["tunings"]["chain"], record["tunings"]["medusa-tree"]
    assert [c["setting"] for c in tree["candidates"]] == ["N=2", "N=4"]
    # the tree's tau comes from the recorded accuracies: N=2 is the chain of top-1s of heads 0, 1
    assert tree["candidates"][0]["tau"] == pytest.approx(1 + 0.9 + 0.9 * 0.8)
    best = max([chain, tree], key=lambda t: t["chosen"]["predicted_speedup"])  # a tie keeps the chain (listed first)
    assert record["chosen"] == best["chosen"]
    loaded = load_medusa(folder, target=target)
    assert loaded.config.draftsmith["speculation"] == record["chosen"]
    assert loaded.config.num_heads == 3 and loaded.config.head_accuracies == heads.config.head_accuracies
    assert (tmp_path / "tune" / "speedup_vs_k.png").is_file() and (tmp_path / "tune" / "speedup_vs_nodes.png").is_file()
    label = record["chosen"]["kind"]
    assert f"chosen: {label}" in out and "check at" in out


def test_measured_costs_choose_consistently(toy_dir, tmp_path, run_cli):
    """Real timings: whatever K the machine's costs give, the table, tuning.json and the config
    agree, and the measured acceptance is the batch-1 decoder's on the same prompts."""
    draft = tmp_path / "draft"
    shutil.copytree(toy_dir / "draft", draft)
    before = _config(draft)
    code, out, err = run_cli(tune_args(toy_dir, "--draft", draft, tmp_path / "tune", "--k-max", 3, "--write"))
    record = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    candidates = record["tunings"]["chain"]["candidates"]
    best = max(candidates, key=lambda c: c["speedup"])
    k = int(best["setting"][2:])
    assert best["chosen"] and record["chosen"]["num_speculative_tokens"] == k and f"chosen: chain K={k}" in out
    if k:
        assert code == 0, err
        assert _config(draft)["draftsmith"]["speculation"] == record["chosen"]
    else:
        assert code == 1 and "--write: nothing recorded" in err and "no K beats target-only decoding" in err
        assert _config(draft) == before and record["measured_speedup"] is None
    tokenizer = load_tokenizer(toy_dir / "target")
    target = load_causal_lm(toy_dir / "target", device=CPU, dtype=torch.float32, role="target")
    drafter = DraftModelDrafter(load_causal_lm(toy_dir / "draft", device=CPU, dtype=torch.float32, role="draft"))
    pooled = None
    for i, prompt in enumerate(load_prompts(toy_dir / "prompts.jsonl", tokenizer, limit=3)):
        stats = generate(
            target, drafter, prompt, max_new_tokens=8, num_draft_tokens=3, seed=i, eos_token_id=tokenizer.eos_token_id
        ).stats
        pooled = stats if pooled is None else pooled + stats
    assert record["measurement"]["alpha_per_position"] == pooled.alpha_per_position
    assert record["measurement"]["target_calls"] == pooled.target_calls
    v = record["measurement"]["verify_seconds"]
    assert sorted(v, key=int) == ["1", "2", "3", "4"] and min(v.values()) > 0
    assert record["measurement"]["draft_ms_per_token"] > 0


def test_eagle_tune_and_a_recorded_setting_loads(toy_dir, tmp_path, run_cli, flat_verify):
    target = load_causal_lm(toy_dir / "target", device=CPU, dtype=torch.float32, role="target")
    torch.manual_seed(0)
    folder = tmp_path / "eagle"
    EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, 1, 2]).save_pretrained(folder)
    code, out, err = run_cli(
        tune_args(toy_dir, "--eagle", folder, tmp_path / "tune", "--k-max", 2, "--trees", "1,2,2", "2,2,4")
    )
    assert code == 0, err
    assert "== eagle-chain: K = 2 on 3 prompts" in out and "ms per drafted token" in out
    assert flat_verify == [[1, 2, 3, 5]]  # the chain's 1..3 and the trees' 2 + 1, 4 + 1
    assert "draftsmith" not in _config(folder)  # no --write: nothing recorded
    # each tree decoded beside target-only: its measured tau and drafting time, v(nodes + 1) modelled
    record = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    chain, tree = record["tunings"]["chain"], record["tunings"]["eagle-tree"]
    assert [c["setting"] for c in tree["candidates"]] == ["tree 1,2,2", "tree 2,2,4"]
    for c, depth in zip(tree["candidates"], (1, 2)):
        assert 1.0 <= c["tau"] <= depth + 2 and c["draft_ms"] > 0 and c["verify_ms"] == 1000.0
        assert c["speedup"] == pytest.approx(c["tau"] / (c["draft_ms"] / 1000 + 1.0))  # v(1) = 1 s
        assert f"tree {depth},2,{2 * depth}: tau {c['tau']:.2f} (counts the bonus token)" in out
    best = max([chain, tree], key=lambda t: t["chosen"]["predicted_speedup"])  # a tie keeps the chain
    assert record["chosen"] == best["chosen"]
    code, _, err = run_cli(tune_args(toy_dir, "--eagle", folder, tmp_path / "t2", "--trees", "2,2"))
    assert code == 2 and "--trees: tree '2,2': expected DEPTH,TOP_K,TOTAL_TOKENS, e.g. 4,4,16" in err, err
    write_setting(folder, {"num_speculative_tokens": 2, "kind": "chain"})
    head = load_eagle(folder, target=target)
    assert head.config.draftsmith == {"speculation": {"num_speculative_tokens": 2, "kind": "chain"}}


@pytest.mark.parametrize(
    "args, message",
    [
        ([], f"one of the arguments --drafter {' '.join('--' + m.kind for m in METHODS.values())} is required"),
        (["--draft", "D", "--eagle", "E"], "argument --eagle: not allowed with argument --draft"),
        (["--draft", "D", "--k-max", "0"], "--k-max must be >= 1, got 0"),
        (["--draft", "D", "--tree-budgets", "4,0"], "--tree-budgets '4,0': '0' is not a number of tree nodes"),
        (
            ["--draft", "{draft}", "--tree-budgets", "4"],
            "--tree-budgets applies to heads whose trees are built from measured accuracies, not draft",
        ),
        (
            ["--draft", "{draft}", "--trees", "2,4,8"],
            "--trees applies to heads whose trees are decoded per setting (EAGLE head), not draft",
        ),
        (["--medusa", "{missing}"], "does not exist or is not a directory"),
    ],
)
def test_bad_tune_input(toy_dir, tmp_path, run_cli, args, message):
    args = [str(a).format(draft=toy_dir / "draft", missing=tmp_path / "missing") for a in args]
    code, _, err = run_cli(
        ["tune", "--target", toy_dir / "target", "--prompts", toy_dir / "prompts.jsonl", "--device", "cpu", *args]
    )
    assert code == 2 and message in err, err


def test_a_chosen_eagle_tree_is_checked_with_that_tree(toy_dir, monkeypatch):
    """When a tree wins, the timed check decodes the very row that was measured (the chosen depth,
    top_k, total_tokens) at K = depth + 1, and compares its speedup with the prediction."""
    from draftsmith.decoding.eagle import EagleDrafter
    from draftsmith.eval import evaluator
    from draftsmith.eval.evaluator import EvalSettings
    from draftsmith.eval.jobs import TuneJob, _check_choice
    from draftsmith.eval.tune import tune_measured_trees

    target = load_causal_lm(toy_dir / "target", device=CPU, dtype=torch.float32, role="target")
    torch.manual_seed(0)
    head = EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, 1, 2])
    trees = {"2,3,5": EagleDrafter(head, tree={"depth": 2, "top_k": 3, "total_tokens": 5})}
    setting = {"num_speculative_tokens": 3, **trees["2,3,5"].tree}
    point = {"label": "tree 2,3,5", "setting": setting, "num_nodes": 5, "tau": 2.0, "draft_seconds": 0.0}
    tuning = tune_measured_trees([point], {1: 1.0, 6: 1.0})  # predicted 2.0x
    seen = {}

    def fake_evaluate(target, drafters, prompts, settings, **kwargs):
        seen.update(drafters=drafters, k=settings.num_draft_tokens)
        return {"methods": [{"speedup": 1.0}, {"speedup": 1.8}]}

    monkeypatch.setattr(evaluator, "evaluate", fake_evaluate)
    job = TuneJob(target="t", prompts="p", settings=EvalSettings(num_draft_tokens=6, max_new_tokens=8))
    check, speedup = _check_choice(
        job, target, EagleDrafter(head), METHODS["eagle"], [], None, tuning, tuning.setting(), trees
    )
    (row,) = seen["drafters"].values()
    assert row is trees["2,3,5"] and row.tree == {"depth": 2, "top_k": 3, "total_tokens": 5} and seen["k"] == 3
    assert speedup == 1.8 and check.ratio == pytest.approx(0.9)
