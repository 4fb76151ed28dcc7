"""The offline top-k teacher: `cache-hidden --topk-logits k` stores the top k logits and the
tail's log-sum-exp, and train/draft.py trains from them (`teacher_cache`) instead of a target
forward. The loss is defined over k + 1 buckets (the top k and the tail)."""

from __future__ import annotations

import json

import pytest
import torch
from lifecycle_helpers import cache_hidden_args, losses, toy_recipe, write_recipe

from draftsmith.distill.losses import DIVERGENCES, divergence, topk_buckets, topk_divergence, topk_teacher
from draftsmith.train.draft import main

K = 4


def test_with_k_equal_to_the_vocabulary_the_buckets_are_the_full_divergence():
    torch.manual_seed(0)
    student = torch.randn(3, 5, 11, requires_grad=True)
    teacher = torch.randn(3, 5, 11) * 2
    mask = torch.rand(3, 5) > 0.3
    for kind in DIVERGENCES:
        full = divergence(kind, student, teacher, mask)
        bucketed = topk_divergence(kind, student, *topk_teacher(teacher, 11), mask)
        torch.testing.assert_close(bucketed, full, atol=1e-5, rtol=1e-5, msg=kind)
        (grad,) = torch.autograd.grad(bucketed, student)
        (expected,) = torch.autograd.grad(full, student)
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=kind)


def test_the_tail_bucket_holds_the_rest_of_the_mass_and_bounds_the_kl():
    torch.manual_seed(1)
    student, teacher = torch.randn(6, 50), torch.randn(6, 50) * 3
    values, ids, tail = topk_teacher(teacher, K)
    p = torch.softmax(teacher, -1)
    top_mass = p.gather(-1, ids.long()).sum(-1)
    buckets = torch.softmax(torch.cat([values, tail[:, None]], -1), -1)
    torch.testing.assert_close(buckets[:, -1], 1 - top_mass)  # the tail bucket = the mass outside the top k
    q_buckets = torch.softmax(topk_buckets(student, ids), -1)
    q = torch.softmax(student, -1)
    torch.testing.assert_close(q_buckets[:, :K], q.gather(-1, ids.long()))
    # merging outcomes never raises a divergence (data processing), and k < V really truncates
    full, topk = divergence("forward_kl", student, teacher), topk_divergence("forward_kl", student, values, ids, tail)
    assert 0 < topk < full
    with pytest.raises(ValueError, match="temperature 1"):
        topk_divergence("forward_kl", student, values, ids, tail, temperature=0.5)


def _recipe(path, toy_dir, toy_data, out, **extra):
    values = toy_recipe(toy_dir, toy_data, out, max_steps=8, warmup_steps=1, log_every=1, eval_every=100, lr=1e-3)
    draft = dict(draft_init="checkpoint", draft_path=str(toy_dir / "draft"), num_draft_tokens=2, loss="forward_kl")
    return write_recipe(path, values | draft | extra)


@pytest.fixture(scope="module")
def topk_cache(toy_dir, toy_data, tmp_path_factory):
    from draftsmith.scripts.cli import main as cli

    out = tmp_path_factory.mktemp("topk") / "cache"
    args = cache_hidden_args(
        toy_dir, toy_data, out, "none", "--model-dtype", "float32", "--topk-logits", K, "--batch-size", 3
    )
    assert cli([str(a) for a in args]) == 0
    assert (
        json.loads((out / "manifest.json").read_text())["bytes_per_token"] == K * 8 + 4
    )  # no states: the teacher alone
    return out


def test_a_cache_of_nothing_is_refused(toy_dir, toy_data, tmp_path, run_cli):
    code, _, err = run_cli(cache_hidden_args(toy_dir, toy_data, tmp_path / "c", "none", dtype=None))
    assert code == 2 and "--layers none without --topk-logits" in err and not (tmp_path / "c").exists()


def test_offline_training_equals_online_with_the_same_truncation_and_lowers_the_loss(
    toy_dir, toy_data, topk_cache, tmp_path
):
    offline, online = tmp_path / "offline", tmp_path / "online"
    assert (
        main(
            [
                "--recipe",
                str(_recipe(tmp_path / "a.yaml", toy_dir, toy_data, offline, teacher_cache=str(topk_cache))),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            ["--recipe", str(_recipe(tmp_path / "b.yaml", toy_dir, toy_data, online, teacher_topk=K)), "--no-progress"]
        )
        == 0
    )
    a, b = losses(offline), losses(online)
    assert len(a) == len(b) == 8
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
    assert sum(a[-2:]) / 2 < a[0]  # the offline run learns
    summary = json.loads((offline / "training_summary.json").read_text())
    assert summary["teacher"] == f"cache:{topk_cache}"


def test_an_old_cache_without_the_tail_is_a_clear_error(toy_dir, toy_data, topk_cache, tmp_path, capsys):
    import shutil

    old = tmp_path / "old-cache"
    shutil.copytree(topk_cache, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["topk_tail"]  # what cache-hidden wrote before it stored the tail
    (old / "manifest.json").write_text(json.dumps(manifest))
    recipe = _recipe(tmp_path / "r.yaml", toy_dir, toy_data, tmp_path / "run", teacher_cache=str(old))
    assert main(["--recipe", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = next(x for x in err if "old-cache" in x)
    assert "without their tail" in line and "rerun draftsmith cache-hidden" in line and f"--topk-logits {K}" in line
    assert not (tmp_path / "run" / "draft").exists()


def test_a_top_k_teacher_needs_a_divergence_at_temperature_1(toy_dir, toy_data, tmp_path):
    from draftsmith.train.draft import DraftRecipe
    from draftsmith.train.recipe import RecipeError, load_recipe

    path = _recipe(tmp_path / "r.yaml", toy_dir, toy_data, tmp_path / "o", teacher_cache="c")
    with pytest.raises(RecipeError, match="temperature 1"):
        load_recipe(DraftRecipe, path, ["temperature=0.7"])
    with pytest.raises(RecipeError, match="loss = ce"):
        load_recipe(DraftRecipe, path, ["loss=ce"])
    with pytest.raises(RecipeError, match="on_policy_fraction = 0"):
        load_recipe(DraftRecipe, path, ["on_policy_fraction=0.5"])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_only_the_kept_rows_are_bucketed(reduction):
    """Rows outside the mask are never read (NaN there changes nothing), for every reduction."""
    torch.manual_seed(2)
    student, teacher = torch.randn(2, 6, 30), torch.randn(2, 6, 30) * 2
    mask = torch.rand(2, 6) > 0.4
    values, ids, tail = topk_teacher(teacher, K)
    expected = divergence(
        "forward_kl", topk_buckets(student, ids), torch.cat([values, tail[..., None]], -1), mask, reduction=reduction
    )
    poisoned = student.masked_fill(~mask[..., None], float("nan")).requires_grad_()
    got = topk_divergence("forward_kl", poisoned, values, ids, tail, mask, reduction=reduction)
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), poisoned)
    assert torch.isfinite(grad).all() and not grad[~mask].any()
