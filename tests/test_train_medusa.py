"""train/medusa.py through its real entry point on a toy target: loss falls, resume is exact,
Medusa-2 trains and merges LoRA, offline caches are checked, recipes are validated."""

import json
from pathlib import Path

import pytest
import torch
from lifecycle_helpers import cache_hidden_args, launch_one_process, losses, toy_recipe, write_recipe

from draftsmith.distill.hidden_cache import CacheError
from draftsmith.train import medusa as medusa_train
from draftsmith.train.common import batch_rows, length_bytes, split_rows
from draftsmith.train.medusa import MedusaRecipe, main
from draftsmith.train.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]


def base(toy_dir, toy_data, out, **extra):
    values = toy_recipe(toy_dir, toy_data, out, num_heads=3, log_every=1, eval_every=6, heldout_fraction=0.2, lr=1e-2)
    return values | extra


def test_recipe_errors_name_the_key(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", target="t", data="d", out="o", num_heds=3)
    with pytest.raises(
        RecipeError, match="unknown key.*num_heds \\(did you mean num_heads\\?\\).*valid keys:.*num_heads"
    ):
        load_recipe(MedusaRecipe, path)
    with pytest.raises(RecipeError, match="command line: unknown key.*bogus"):
        load_recipe(MedusaRecipe, write_recipe(tmp_path / "ok.yaml", target="t", data="d", out="o"), ["bogus=1"])
    with pytest.raises(RecipeError, match="missing required key.*data"):
        load_recipe(MedusaRecipe, write_recipe(tmp_path / "m.yaml", target="t", out="o"))
    with pytest.raises(RecipeError, match="num_heads = 'four' should be int"):
        load_recipe(MedusaRecipe, path.with_name("ok.yaml"), ["num_heads=four"])
    with pytest.raises(RecipeError, match="loss = 'kl'.*forward_kl"):
        load_recipe(MedusaRecipe, path.with_name("ok.yaml"), ["loss=kl"])
    recipe = load_recipe(
        MedusaRecipe,
        path.with_name("ok.yaml"),
        ["lr=3e-4", "lora_target_modules=[q_proj,v_proj]", "share_lm_head=true"],
    )
    assert recipe.lr == 3e-4 and recipe.lora_target_modules == ["q_proj", "v_proj"] and recipe.share_lm_head is True


def test_every_shipped_recipe_loads():
    for path in sorted((REPO / "recipes").glob("*/medusa*.yaml")):
        recipe = load_recipe(MedusaRecipe, path)
        assert recipe.num_heads >= 1, path
        assert path.read_text().startswith("#") and "accelerate launch train/medusa.py --recipe" in path.read_text()


def test_batch_order_is_a_function_of_seed_and_step():
    rows = list(range(10))
    a = [batch_rows(rows, s, 0, 3, 1, seed=1) for s in range(8)]
    assert a == [batch_rows(rows, s, 0, 3, 1, seed=1) for s in range(8)]
    assert len(set(sum(a[:3], []))) == 9  # within an epoch no row repeats
    # two processes split a step's rows without overlap (inside one epoch)
    r0, r1 = batch_rows(rows, 1, 0, 2, 1, 0, rank=0, world=2), batch_rows(rows, 1, 0, 2, 1, 0, rank=1, world=2)
    assert not set(r0) & set(r1)
    train, held = split_rows(20, 0.2)
    assert held == [0, 5, 10, 15] and len(train) == 16


def test_batches_grouped_by_length_pad_less_and_keep_every_row_and_step():
    gen = torch.Generator().manual_seed(0)
    n, rows = 600, list(range(1000, 1600))
    sizes = torch.randint(20, 512, (n,), generator=gen)
    lengths = length_bytes(sizes.numpy(), max_length=400)
    steps = n // 8

    def batches(lengths, batch_size=8, world=1, accum=1):
        return [
            [
                batch_rows(rows, s, m, batch_size, accum, seed=3, rank=r, world=world, lengths=lengths)
                for m in range(accum)
                for r in range(world)
            ]
            for s in range(steps)
        ]

    grouped, plain = batches(lengths), batches(None)
    assert grouped == batches(lengths)  # a function of (seed, step): resume reads the same batches
    assert sorted(row for step in grouped for b in step for row in b) == rows  # one epoch, each row once

    def padding(steps_):
        cut = sizes.clamp(max=400)
        width = [max(cut[r - 1000] for r in b) * len(b) for step in steps_ for b in step]
        return 1 - float(cut.sum()) / float(sum(width))

    assert padding(grouped) < 0.1 < 0.3 < padding(plain)
    # a step holds the same rows however it is split into processes and micro-batches
    for split in ({"batch_size": 4, "world": 2}, {"batch_size": 2, "world": 2, "accum": 2}):
        assert [sorted(sum(step, [])) for step in batches(lengths, **split)] == [sorted(sum(s, [])) for s in grouped]


@pytest.mark.parametrize("loss", ["ce", "forward_kl"])
def test_medusa1_loss_falls_and_heads_are_saved(toy_dir, toy_data, tmp_path, loss):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", **base(toy_dir, toy_data, out, loss=loss))
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    values = losses(out)
    assert len(values) == 12 and sum(values[-3:]) / 3 < 0.8 * values[0]
    from draftsmith.heads.medusa import load_medusa

    heads = load_medusa(out / "heads")
    assert heads.config.num_heads == 3 and len(heads.config.head_accuracies) == 3
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["train_tokens_per_second"] > 0 and summary["target_forward_tokens_per_second"] > 0
    assert 1.0 <= summary["eval"]["tau_simulated"] <= 4.0
    assert json.loads((out / "recipe.json").read_text())["loss"] == loss
    info = json.loads((out / "run_info.json").read_text())
    assert info["recipe"]["loss"] == loss and info["versions"]["torch"] and info["versions"]["transformers"]
    assert info["python"] and "git_revision" in info


def test_resume_gives_the_same_heads(toy_dir, toy_data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    whole = tmp_path / "whole"
    main(
        [
            "--recipe",
            str(write_recipe(tmp_path / "a.yaml", **base(toy_dir, toy_data, whole, max_steps=6, save_every=3))),
            "--no-progress",
        ]
    )
    part = tmp_path / "part"
    recipe = write_recipe(tmp_path / "b.yaml", **base(toy_dir, toy_data, part, max_steps=6, save_every=3))
    import draftsmith.train.run as run_module

    real = run_module.save_checkpoint

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        main(["--recipe", str(recipe), "--no-progress"])
    monkeypatch.setattr(run_module, "save_checkpoint", real)
    assert main(["--recipe", str(recipe), "--no-progress"]) == 2  # checkpoints present: resume must be asked for
    assert main(["--recipe", str(recipe), "--no-progress", "resume=true"]) == 0
    a = load_file(next((whole / "heads").glob("*.safetensors")))
    b = load_file(next((part / "heads").glob("*.safetensors")))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_medusa2_trains_lora_saves_and_merges(toy_dir, toy_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "m2"
    recipe = write_recipe(
        tmp_path / "r.yaml", **base(toy_dir, toy_data, out, mode="medusa2", max_steps=6, lr=5e-3, lambda_warmup_steps=3)
    )
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["eval"]["kl_drift"] >= 0 and (out / "adapter" / "adapter_config.json").is_file()
    merged = medusa_train.merge_adapter(toy_dir / "target", out / "adapter", tmp_path / "merged")
    ids = torch.tensor([[5, 17, 40, 41, 90, 7]])
    base_model = AutoModelForCausalLM.from_pretrained(toy_dir / "target")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy_dir / "target"), str(out / "adapter"))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        original = base_model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(original, want)  # the adapter did train


def test_offline_cache_trains_and_mismatches_are_errors(toy_dir, toy_data, tmp_path, run_cli):
    good = tmp_path / "cache-last"
    assert run_cli(cache_hidden_args(toy_dir, toy_data, good, "last"))[0] == 0
    out = tmp_path / "offline"
    recipe = write_recipe(
        tmp_path / "r.yaml", **base(toy_dir, toy_data, out, hidden_cache=good, loss="forward_kl", max_steps=4)
    )
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    # a cache holding more layers than `last` (one cache for every head) trains the same heads
    more = tmp_path / "cache-more"
    assert run_cli(cache_hidden_args(toy_dir, toy_data, more, "0,last,1"))[0] == 0
    superset = base(toy_dir, toy_data, tmp_path / "superset", hidden_cache=more, loss="forward_kl", max_steps=4)
    recipe = write_recipe(tmp_path / "s.yaml", **superset)
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    assert losses(tmp_path / "superset") == pytest.approx(losses(out), abs=1e-6)
    wrong = tmp_path / "cache-1"
    assert run_cli(cache_hidden_args(toy_dir, toy_data, wrong, "1", dtype=None))[0] == 0
    recipe = write_recipe(tmp_path / "w.yaml", **base(toy_dir, toy_data, tmp_path / "o2", hidden_cache=wrong))
    with pytest.raises(CacheError, match="holds layers \\[1\\], the trainer needs \\[2\\]"):
        medusa_train.train(load_recipe(MedusaRecipe, recipe), progress=False)
    recipe = write_recipe(
        tmp_path / "x.yaml", **base(toy_dir, toy_data, tmp_path / "o3", hidden_cache=good, mode="medusa2")
    )
    with pytest.raises(RecipeError, match="medusa1"):
        load_recipe(MedusaRecipe, recipe)


@pytest.mark.slow
def test_accelerate_launch_entry_point(toy_dir, toy_data, tmp_path):
    """The command users run, in a subprocess: `accelerate launch train/medusa.py --recipe ...`."""
    out = tmp_path / "launched"
    stdout = launch_one_process("train/medusa.py", base(toy_dir, toy_data, out, max_steps=3, eval_every=3), tmp_path)
    assert (out / "heads" / "config.json").is_file() and "heads written to" in stdout
