"""A run's output folder `out`: what is in it, and what a run may do to it.

- Nothing is written into `out` before the run's inputs are checked: `check_out_writable`
  looks without creating it, `TrainingRun.start` creates it.
- A run that starts at step 0 refuses a folder holding another run (`refuse_earlier_run`):
  writing into it would replace that run's result and mix the two in metrics.jsonl.
- A resumed run drops the metrics lines logged past its checkpoint (`drop_metrics_after`).
- A run that fails leaves the folder as it found it (`cleaned_up_on_error`), unless it wrote a
  checkpoint, which `resume=true` continues.

A checkpoint is a folder `OUT/checkpoints/step-NNNNNNN`; one holding `trainer_state.json` is
complete (train/run.py writes it last and renames the folder into place).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

from draftsmith.heads.artifacts import check_writable_folder
from draftsmith.train.recipe import RecipeError

# What a run writes into `out` from its start: a folder holding one of them holds a run.
RUN_RECORDS = ("metrics.jsonl", "training_summary.json", "recipe.json")


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(out) / "checkpoints"
    return sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()) if root.is_dir() else []


def latest_checkpoint(out: Path) -> Path | None:
    done = checkpoints(out)
    return done[-1] if done else None


def check_out_writable(out: Path) -> None:
    """That `out` is (or can be made) a writable folder, checked without creating it."""
    check_writable_folder(out, "out", RecipeError)


def refuse_earlier_run(out: Path) -> None:
    """RecipeError when `out` holds another run's records (say a finished run that kept no
    checkpoint): a new run there would replace its result and mix two runs in metrics.jsonl."""
    found = [name for name in RUN_RECORDS if (Path(out) / name).exists()]
    if found:
        raise RecipeError(
            f"out {str(out)!r} already holds a run ({', '.join(found)}) and no checkpoint to resume from: "
            "choose another out, or remove that folder to train it again"
        )


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a line cut short (a run killed mid-write)."""
    try:
        return json.loads(line).get("step", math.inf)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def drop_metrics_after(metrics: Path, step: int) -> None:
    """Resumed at `step`: the lines an interrupted run logged past its checkpoint go, so that
    metrics.jsonl reads as one run (the resumed run logs those steps again)."""
    if step == 0 or not metrics.is_file():
        return
    lines = metrics.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) != len(lines):
        tmp = metrics.with_name(f".{metrics.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(metrics)


def cleaned_up_on_error(train):
    """`train(recipe, ...)` that, when it fails, leaves `recipe.out` as it found it: what the run
    created there is removed (the folder too when the run made it), unless the run wrote a
    checkpoint (then it is kept: `resume=true` continues it). A failed run leaves neither an
    empty folder nor a recipe.json without a result beside an earlier artifact."""

    @functools.wraps(train)
    def guarded(recipe, *args, **kwargs):
        out = Path(recipe.out)
        before = {p.name for p in out.iterdir()} if out.is_dir() else None
        saved = set(checkpoints(out))
        try:
            return train(recipe, *args, **kwargs)
        except BaseException:
            if not set(checkpoints(out)) - saved and out.is_dir() and _is_main_process():
                made = [out] if before is None else [p for p in out.iterdir() if p.name not in before]
                for path in made:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
            raise

    return guarded


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process
