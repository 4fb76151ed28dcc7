"""A run's checkpoints: how one is written, read back, checked whole, resumed and warm-started from.

A checkpoint is a folder `OUT/checkpoints/step-NNNNNNN` with accelerate's full state (model,
optimizer, registered scheduler, every process's RNG) and `trainer_state.json` (the step and
the resolved recipe), written to a temporary name and renamed: a folder with
`trainer_state.json` is complete (`run_folder.checkpoints` lists those). Batches are a pure
function of (seed, step), so a run resumed from step s reads what the uninterrupted run read and
ends with the same weights; a resumed run must therefore compute what the checkpoint's run
computed (`recipe_differences`), and only the run-control keys may change.

`TrainingRun.start` (train/run.py) calls `resume` or `warm_start`; `TrainingRun.checkpoint`
calls `save_checkpoint`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from draftsmith.distill.data import write_json_atomic
from draftsmith.train.recipe import RecipeError
from draftsmith.train.run_folder import checkpoints, latest_checkpoint

# Keys that steer the run, not what it computes: they may change when a run is resumed.
# Every other key must match the checkpoint's recipe (a resumed run that silently trained on
# other data or with another schedule would be neither run).
RUN_CONTROL_KEYS = frozenset(
    {
        "out",
        "resume",
        "init_from",
        "save_every",
        "keep_checkpoints",
        "log_every",
        "eval_every",
        "report_to",
        "tracker_project",
        "push_to_hub",
        "hub_repo_id",
        "hub_private",
        "device",
        "allow_target_mismatch",
        "target_sharding",
        "serve_check_prompts",
        "serve_check_new_tokens",
    }
)


# --------------------------------------------------------------------------- write and read


def save_checkpoint(accelerator, out: Path, step: int, recipe: dict, keep: int = 0) -> Path:
    """accelerate's full state + the step, written to a temporary folder and renamed; then all
    but the newest `keep` checkpoints are removed (0 keeps all)."""
    final = Path(out) / "checkpoints" / f"step-{step:07d}"
    tmp = Path(out) / "checkpoints" / f".step-{step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(tmp / "trainer_state.json", {"step": step, "recipe": recipe})
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep:
            for old in checkpoints(out)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_checkpoint(path: Path) -> dict:
    state_file = Path(path) / "trainer_state.json"
    if not state_file.is_file():
        raise RecipeError(
            f"resume: {str(path)!r} is not a complete checkpoint (no trainer_state.json); complete ones: step-* folders under OUT/checkpoints"
        )
    try:
        return json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecipeError(f"resume: {str(state_file)!r} is truncated or not JSON ({err})") from None


def unreadable_file(folder: Path) -> str | None:
    """'FILE (why)' for the first file of a checkpoint folder that cannot be read back whole (a
    run killed while the disk filled, a copy cut short), or None when every one reads."""
    from safetensors.torch import load_file

    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        try:
            if path.suffix == ".safetensors":
                load_file(str(path))
            elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
                # this run's own files, which accelerate's load_state would unpickle just the same
                torch.load(path, map_location="cpu", weights_only=False)
            elif path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
        except Exception as err:  # noqa: BLE001 - safetensors, zip and pickle readers each raise their own
            return f"{path} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'unreadable'})"
    return None


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every key that shapes the result and differs."""
    keys = sorted((set(saved) | set(current)) - RUN_CONTROL_KEYS)
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def _model_weights(folder: Path) -> Path:
    """The model's weights in an accelerate checkpoint folder (the first prepared model)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise RecipeError(
        f"init_from {str(folder)!r}: no model.safetensors in it (a DeepSpeed checkpoint keeps sharded states; "
        "warm-start from a checkpoint written without DeepSpeed, or resume the DeepSpeed run instead)"
    )


# --------------------------------------------------------------------------- resume and warm start


def resume(accelerator, out: Path, given, current: dict, say=print) -> int:
    """The step resumed from, with the accelerator's state loaded: the checkpoint `given` (a
    path), or with `given` True the newest of `out` that reads back whole (a truncated one is
    named and the one before it taken). `current` is the resolved recipe, which must match the
    checkpoint's but for RUN_CONTROL_KEYS."""
    explicit = given is not True
    candidates = [Path(given).expanduser()] if explicit else checkpoints(out)[::-1]
    if not candidates:
        say(f"resume: no checkpoint in {out}/checkpoints; starting at step 0")
        return 0
    skipped = []
    for ckpt in candidates:
        state = read_checkpoint(ckpt) if explicit else _readable_state(ckpt, skipped)
        if state is None:
            continue
        differ = recipe_differences(state["recipe"], current)
        if differ:
            raise RecipeError(
                f"resume from {ckpt}: the recipe differs from the checkpoint's in {'; '.join(differ)} (start a new run, or init_from for weights only)"
            )
        try:
            accelerator.load_state(str(ckpt))
        except Exception:
            bad = unreadable_file(ckpt)
            if bad is None:
                raise
            if explicit:
                older = [c for c in checkpoints(ckpt.parent.parent) if c.name < ckpt.name]  # OUT/checkpoints/step-N
                hint = f"resume from {older[-1]}, the one before it" if older else "start a new run"
                raise RecipeError(
                    f"resume: checkpoint {ckpt} cannot be read: {bad} is truncated or corrupt; {hint}"
                ) from None
            skipped.append(bad)
            continue
        if skipped:
            say(
                f"resume: skipped {len(skipped)} unreadable checkpoint(s) ({'; '.join(skipped)}); took {ckpt}, the newest good one"
            )
        say(f"resumed from {ckpt} (step {int(state['step'])})")
        return int(state["step"])
    raise RecipeError(
        f"resume: no checkpoint of {out} reads back whole ({'; '.join(skipped)}); start a new run in another out"
    )


def _readable_state(ckpt: Path, skipped: list) -> dict | None:
    try:
        return read_checkpoint(ckpt)
    except RecipeError as err:
        skipped.append(str(err).removeprefix("resume: "))
        return None


def warm_start(accelerator, source: Path, say=print) -> None:
    """The weights of `source` (a checkpoint folder, or a run folder: its latest checkpoint) put
    into the accelerator's first prepared model. Weights only: optimizer, schedule and step
    start fresh."""
    if (source / "checkpoints").is_dir():
        latest = latest_checkpoint(source)
        if latest is None:
            raise RecipeError(f"init_from {str(source)!r}: the run holds no complete checkpoint")
        source = latest
    if not source.is_dir():
        raise RecipeError(f"init_from {str(source)!r} is not a folder (expected a checkpoint folder or a run folder)")
    weights = _model_weights(source)
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    model = accelerator.unwrap_model(accelerator._models[0])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RecipeError(
            f"init_from {str(source)!r}: its weights do not fit this model (missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}); "
            "warm start needs a checkpoint of the same method and shape"
        )
    say(f"warm start from {weights} (weights only; optimizer and schedule start fresh)")
