"""The training lifecycle every trainer shares (train/run.py): checkpoints kept, resume from a
given checkpoint, warm start, a resumed recipe that differs, the NaN stop, output folders that
cannot be written, DeepSpeed configs that contradict the recipe, trackers, trust_remote_code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lifecycle_helpers import METHODS, losses, main_of, recipe_values, weights, write_recipe

from draftsmith.train.checkpoints import recipe_differences
from draftsmith.train.recipe import RecipeError, RunRecipe
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import checkpoints

REQUIRED = {"target": "t", "data": "d", "out": "o"}  # the keys RunRecipe has no default for


def run(method, toy_dir, toy_data, tmp_path, name, *args, **extra) -> tuple[int, Path]:
    out = Path(extra.pop("out", tmp_path / name))
    recipe = write_recipe(tmp_path / f"{name}.yaml", recipe_values(method, toy_dir, toy_data, out, **extra))
    return main_of(method)(["--recipe", str(recipe), "--no-progress", *args]), out


@pytest.mark.parametrize("method", METHODS)
def test_keeps_the_newest_checkpoints_and_resumes_from_a_given_one(method, toy_dir, toy_data, tmp_path):
    code, whole = run(method, toy_dir, toy_data, tmp_path, "whole", max_steps=8, save_every=2, keep_checkpoints=2)
    assert code == 0
    assert [p.name for p in checkpoints(whole)] == ["step-0000004", "step-0000006"]  # 2 and the final step are not kept
    assert not list((whole / "checkpoints").glob(".*tmp"))
    # Resume an older checkpoint of another run into a new folder: the same final weights.
    code, again = run(
        method,
        toy_dir,
        toy_data,
        tmp_path,
        "again",
        "--resume",
        str(whole / "checkpoints" / "step-0000004"),
        max_steps=8,
        save_every=2,
        keep_checkpoints=2,
    )
    assert code == 0
    assert losses(again) == losses(whole)[4:]
    a, b = weights(whole, method), weights(again, method)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", METHODS)
def test_resume_refuses_a_different_recipe_naming_the_keys(method, toy_dir, toy_data, tmp_path, capsys):
    code, out = run(method, toy_dir, toy_data, tmp_path, "r", max_steps=4, save_every=2)
    assert code == 0
    recipe = write_recipe(
        tmp_path / "changed.yaml",
        recipe_values(method, toy_dir, toy_data, out, max_steps=4, save_every=2, lr=0.5, batch_size=3),
    )
    capsys.readouterr()
    assert main_of(method)(["--recipe", str(recipe), "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "batch_size: 2 -> 3" in err and "lr:" in err and "step-0000002" in err
    # keys that only steer the run may change
    recipe = write_recipe(
        tmp_path / "ok.yaml", recipe_values(method, toy_dir, toy_data, out, max_steps=4, save_every=3, log_every=2)
    )
    assert main_of(method)(["--recipe", str(recipe), "--no-progress", "--resume"]) == 0


def test_recipe_differences_ignore_run_control_keys():
    saved = {"lr": 1e-3, "out": "a", "save_every": 10, "data": "d"}
    assert recipe_differences(saved, {**saved, "out": "b", "save_every": 5}) == []
    assert recipe_differences(saved, {**saved, "data": "e"}) == ["data: 'd' -> 'e'"]


@pytest.mark.parametrize("method", ["medusa", "draft"])
def test_warm_start_takes_the_weights_only(method, toy_dir, toy_data, tmp_path):
    code, first = run(method, toy_dir, toy_data, tmp_path, "first", max_steps=4, save_every=2)
    assert code == 0
    # lr ~ 0: the new run's weights stay those of the checkpoint; its step count starts at 0.
    code, warm = run(method, toy_dir, toy_data, tmp_path, "warm", "--init-from", str(first), max_steps=3, lr=1e-12)
    assert code == 0
    from safetensors.torch import load_file

    ckpt = load_file(str(first / "checkpoints" / "step-0000002" / "model.safetensors"))
    final = weights(warm, method)
    fresh = weights(first, method)
    changed = [k for k in final if not torch.equal(final[k], fresh[k])]
    assert changed, "the warm run must not simply copy the first run's final weights"
    assert [json.loads(line)["step"] for line in (warm / "metrics.jsonl").read_text().splitlines() if "loss" in line][
        0
    ] == 1
    for key, value in ckpt.items():
        name = key.removeprefix("heads.")
        if name in final:
            torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6)


def test_warm_start_errors(toy_dir, toy_data, tmp_path, capsys):
    code, _ = run("medusa", toy_dir, toy_data, tmp_path, "a", "--init-from", str(tmp_path / "nowhere"))
    assert code == 2 and "init_from" in capsys.readouterr().err
    code, first = run("medusa", toy_dir, toy_data, tmp_path, "m", max_steps=2, save_every=1)
    assert code == 0
    code, _ = run(
        "draft", toy_dir, toy_data, tmp_path, "d", "--init-from", str(first)
    )  # Medusa weights into a draft model
    assert code == 2 and "do not fit this model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exclude each other"):
        RunRecipe(**REQUIRED, resume=True, init_from="x")


@pytest.mark.parametrize("method", METHODS)
def test_a_nan_loss_stops_with_the_last_good_checkpoint_intact(
    method, toy_dir, toy_data, tmp_path, monkeypatch, capsys
):
    real = TrainingRun.mean
    calls = {"losses": 0}

    def poisoned(self, value):
        # the loss of optimizer step 4 (the first mean taken in each micro-step is the loss)
        calls["losses"] += 1
        if calls["losses"] == FIRST_MEAN_OF_STEP[method](4):
            value = torch.tensor(float("nan"))
        return real(self, value)

    monkeypatch.setattr(TrainingRun, "mean", poisoned)
    code, out = run(method, toy_dir, toy_data, tmp_path, "nan", max_steps=8, save_every=2)
    err = capsys.readouterr().err
    assert code == 2
    assert "the loss became nan at step 4" in err and "step-0000002" in err
    assert [p.name for p in checkpoints(out)] == ["step-0000002"]
    assert not (out / METHODS[method][1]).exists()
    state = json.loads((out / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
    assert state["step"] == 2
    monkeypatch.setattr(TrainingRun, "mean", real)
    recipe = write_recipe(
        tmp_path / "resume.yaml", recipe_values(method, toy_dir, toy_data, out, max_steps=8, save_every=2)
    )
    assert main_of(method)(["--recipe", str(recipe), "--no-progress", "--resume"]) == 0


# Means taken per optimizer step (one micro-step): Medusa the loss + one per head (2 heads);
# EAGLE the loss + one per TTT step (2); draft the loss only.
FIRST_MEAN_OF_STEP = {
    "medusa": lambda step: (step - 1) * 3 + 1,
    "eagle": lambda step: (step - 1) * 3 + 1,
    "draft": lambda step: (step - 1) * 1 + 1,
}


def test_output_folder_that_cannot_be_written(toy_dir, toy_data, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _ = run("medusa", toy_dir, toy_data, tmp_path, "x", out=str(blocker / "run"))
    assert code == 2 and "is a file, not a folder" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, _ = run("medusa", toy_dir, toy_data, tmp_path, "y", out=str(locked / "run"))
        assert code == 2 and "is not writable" in capsys.readouterr().err


def test_missing_recipe_and_typo(tmp_path, capsys):
    assert main_of("medusa")(["--recipe", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main_of("eagle")(["--recipe", str(tmp_path / "none.yaml"), "ttt_step=3"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err
    bad = write_recipe(tmp_path / "typo.yaml", {"target": "t", "data": "d", "out": "o", "keep_checkpoint": 2})
    assert main_of("medusa")(["--recipe", str(bad)]) == 2
    assert "keep_checkpoint (did you mean keep_checkpoints?)" in capsys.readouterr().err


def test_recipe_checks_of_the_shared_keys():
    with pytest.raises(ValueError, match="unknown tracker"):
        RunRecipe(**REQUIRED, report_to=["mlflow"])
    with pytest.raises(ValueError, match="needs hub_repo_id"):
        RunRecipe(**REQUIRED, push_to_hub=True)
    with pytest.raises(ValueError, match="keep_checkpoints"):
        RunRecipe(**REQUIRED, keep_checkpoints=-1)


def fake_deepspeed_run(config: dict, processes: int = 2, **recipe):
    """A TrainingRun whose accelerator looks like a DeepSpeed one (only what the check reads)."""
    from accelerate.utils import DistributedType

    r = SimpleNamespace(batch_size=2, grad_accum=1, grad_clip=1.0, **recipe)
    plugin = SimpleNamespace(deepspeed_config=config, hf_ds_config=SimpleNamespace(config_file="ds.json"))
    run = TrainingRun.__new__(TrainingRun)
    run.recipe = r
    run.accelerator = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        state=SimpleNamespace(deepspeed_plugin=plugin),
        num_processes=processes,
    )
    return run


def test_a_deepspeed_config_that_contradicts_the_recipe_is_refused():
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    with pytest.raises(
        RecipeError, match=r"ds.json: train_micro_batch_size_per_gpu = 4 contradicts the recipe \(batch_size gives 2\)"
    ):
        fake_deepspeed_run(config)._fit_deepspeed_config()
    with pytest.raises(RecipeError, match="train_batch_size = 8 contradicts"):
        fake_deepspeed_run({"train_batch_size": 8})._fit_deepspeed_config()
    with pytest.raises(RecipeError, match="gradient_accumulation_steps = 2 contradicts"):
        fake_deepspeed_run({"gradient_accumulation_steps": 2})._fit_deepspeed_config()
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "gradient_clipping": "auto",
    }
    fake_deepspeed_run(config)._fit_deepspeed_config()
    assert config == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
    }


def test_remote_code_is_not_run_unless_the_recipe_asks(tmp_path):
    from draftsmith.heads.models import ModelLoadError, load_causal_lm

    folder = tmp_path / "remote"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "custom-remote",
                "auto_map": {"AutoConfig": "conf.CustomConfig", "AutoModelForCausalLM": "conf.CustomModel"},
            }
        )
    )
    (folder / "conf.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(ModelLoadError):
        load_causal_lm(folder, device=torch.device("cpu"), dtype=torch.float32, role="target")
    assert not marker.exists()
    assert RunRecipe(**REQUIRED).trust_remote_code is False


@pytest.mark.slow
def test_trackers_wandb_offline_and_tensorboard(toy_dir, toy_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, out = run(
        "medusa", toy_dir, toy_data, tmp_path, "tracked", "report_to=[wandb,tensorboard]", max_steps=4, eval_every=2
    )
    assert code == 0
    assert list(out.glob("wandb/offline-run-*/run-*.wandb")), "wandb wrote no offline run"
    events = list((out / "draftsmith").rglob("events.out.tfevents.*"))
    assert events, "tensorboard wrote no event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "eval/tau_simulated", "eval/top1/1", "eval/top1/2"} <= tags
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
