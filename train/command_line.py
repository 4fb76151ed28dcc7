"""The command line every trainer shares: `python train/<method>.py --recipe NAME|FILE key=value ...`
(and `draftsmith train METHOD ...`, which checks the same arguments before it launches).

`command_line` reads the arguments into the method's recipe, `trainer_main` runs the trainer
and prints its summary once (the main process), and `user_errors` are what it reports as one
line on stderr with exit status 2 instead of a traceback: a bad recipe, data, checkpoint or
Hub setting, a non-finite loss. The run itself is train/run.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.train.recipe import RecipeError
from draftsmith.train.run import TrainingError


def command_line(recipe_cls, description: str, recipe_hint: str, argv=None, prog: str | None = None):
    """(recipe, show_progress, estimate) from `--recipe NAME|FILE [--resume [PATH]] [--init-from PATH]
    [--estimate-memory [--shards N] [--device-memory GIB]] key=value ...`; `estimate` is None
    or (shards, device GiB) when only the memory estimate is asked for. A recipe NAME is a shipped
    one (train/recipe_files.py), found here so that every way of starting a trainer takes it."""
    import argparse

    from draftsmith.train.recipe import load_recipe, parse_overrides
    from draftsmith.train.recipe_files import find_recipe

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--recipe",
        metavar="NAME|FILE",
        help=f"a recipe YAML file, or the NAME <family>/<recipe> of a shipped one ({recipe_hint})",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        metavar="CHECKPOINT",
        help="continue the run in `out` from its latest checkpoint, or from the checkpoint folder given",
    )
    parser.add_argument(
        "--init-from",
        metavar="PATH",
        help="warm start a new run from the weights of a checkpoint or run folder (optimizer and schedule start fresh)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--estimate-memory",
        action="store_true",
        help="print the memory per process the recipe needs (from the target's config, nothing loaded) and exit",
    )
    parser.add_argument(
        "--shards",
        type=int,
        help="with --estimate-memory: processes (fsdp2, zero3) or GPUs (device_map) the target is spread over",
    )
    parser.add_argument(
        "--device-memory",
        type=float,
        metavar="GIB",
        help="with --estimate-memory: a device's memory, to say how many of them fit",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args(argv)
    if (args.shards is not None or args.device_memory is not None) and not args.estimate_memory:
        parser.error("--shards and --device-memory go with --estimate-memory")
    if args.shards is not None and args.shards < 1 or args.device_memory is not None and args.device_memory <= 0:
        parser.error("--shards must be >= 1 and --device-memory > 0")
    overrides = parse_overrides(args.overrides)
    if args.resume is not None:
        overrides["resume"] = args.resume
    if args.init_from is not None:
        overrides["init_from"] = args.init_from
    estimate = (args.shards, args.device_memory) if args.estimate_memory else None
    try:
        recipe = find_recipe(args.recipe) if args.recipe is not None else None
    except RecipeError as err:
        raise RecipeError(f"--recipe: {err}") from None
    return load_recipe(recipe_cls, recipe, overrides), not args.no_progress, estimate


def trainer_main(script: str, doc: str, recipe_cls, train, argv, *, result: str, shown: tuple = ()) -> int:
    """The command line of the trainer `script` (train/<method>.py; `doc`: its module docstring,
    whose first line describes it): the recipe read, `train(recipe, progress=...)` run, then the
    summary's `shown` keys as one JSON line and where the `result` folder was written, printed by
    the main process only (one summary, not one per process). A user error (recipe, data,
    checkpoint, a non-finite loss) is one line on stderr, `SCRIPT: error: ...`, exit status 2."""
    try:
        hint = f"recipes/<family>/{Path(script).stem}*.yaml"
        recipe, progress, estimate = command_line(recipe_cls, doc.strip().splitlines()[0], hint, argv)
        if estimate is not None:
            from draftsmith.train.sharding import estimate_report

            print(estimate_report(recipe, Path(script).stem, *estimate))
            return 0
        summary = train(recipe, progress=progress)
    except user_errors() as err:
        print(f"{script}: error: {err}", file=sys.stderr)
        return 2
    if is_main_process():
        if shown:
            print(json.dumps({k: summary[k] for k in shown}))
        print(f"{result} written to {Path(recipe.out) / result}")
    return 0


def user_errors() -> tuple[type[Exception], ...]:
    """Errors a trainer's command line reports as one clean line (exit status 2)."""
    from draftsmith.distill.data import DataError
    from draftsmith.distill.hidden_cache import CacheError
    from draftsmith.distill.sources import SourceError
    from draftsmith.heads.models import ModelLoadError
    from draftsmith.publish import HubError
    from draftsmith.train.sharding import ShardingError

    return (RecipeError, TrainingError, DataError, CacheError, SourceError, ModelLoadError, HubError, ShardingError)


def is_main_process() -> bool:
    """After training: whether this process prints the command line's summary (one, not P)."""
    from accelerate import PartialState

    return PartialState().is_main_process
