"""`draftsmith train KIND [ARGS ...]`: a trainer of train/ run from anywhere, with a shipped recipe or a file.

    draftsmith train draft --recipe smollm2/draft max_steps=50 loss=tv
    draftsmith train KIND --recipe my-recipe.yaml --accelerate-config zero2 --num-processes 8
    draftsmith train KIND --help          # the trainer's own flags

KIND is a method of heads/registry.py. ARGS go unchanged to its trainer's command line, the one
`python -m draftsmith.train.KIND ARGS` reads, except the two launch flags taken here: without
--accelerate-config / --num-processes the loop runs in this process; with them, `accelerate
launch -m draftsmith.train.KIND ARGS` starts it. The trainer's parser reads ARGS (the recipe, its
keys, the overrides) before anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from draftsmith.heads.registry import METHODS, get_method
from draftsmith.scripts._args import UsageError, positive_int

LAUNCH = (
    "Launch flags, taken by `draftsmith train` before or after KIND: --accelerate-config NAME|FILE, --num-processes N."
)


def add_launch_flags(parser) -> None:
    parser.add_argument(
        "--accelerate-config",
        metavar="NAME|FILE",
        help="launch with `accelerate launch`: a shipped config NAME (ddp, fsdp2, zero2, zero3, zero3_offload) "
        "or a file",
    )
    parser.add_argument(
        "--num-processes",
        type=positive_int("--num-processes"),
        metavar="N",
        help="processes for `accelerate launch` (default: the config's)",
    )


def add_commands(sub) -> None:
    kinds = "\n".join(f"  {kind:<8} {m.title} (python -m {m.trainer})" for kind, m in METHODS.items())
    tr = sub.add_parser(
        "train",
        help="train a drafter with a recipe: a shipped NAME (FAMILY/RECIPE of recipes/, e.g. smollm2/draft) or a YAML file",
        description=__doc__,
        epilog=f"kinds:\n{kinds}\n\n`draftsmith train KIND --help` lists the ARGS the trainer of KIND reads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_flags(tr)
    tr.add_argument("method", choices=METHODS, metavar="KIND", help=f"the drafter method: {', '.join(METHODS)}")
    tr.add_argument(
        "trainer_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the trainer's own: --recipe NAME|FILE [key=value ...] [--resume] [--estimate-memory] ...",
    )
    tr.set_defaults(func=cmd_train)


def trainer_argv(args) -> list[str]:
    """ARGS less the launch flags, which land in `args` (they may also come after KIND)."""
    launch = argparse.ArgumentParser(prog=f"draftsmith train {args.method}", add_help=False, allow_abbrev=False)
    add_launch_flags(launch)
    _, rest = launch.parse_known_args(args.trainer_args, namespace=args)
    return rest


def cmd_train(args) -> int:
    from draftsmith.train.command_line import command_line
    from draftsmith.train.recipe import RecipeError

    method = get_method(args.method)
    argv = trainer_argv(args)
    module = importlib.import_module(method.trainer)
    about = f"{(module.__doc__ or method.title).strip().splitlines()[0]} {LAUNCH}"
    hint = f"recipes/<family>/{method.trainer.rsplit('.', 1)[-1]}*.yaml"
    try:  # the trainer's own parser (and its --help): the recipe, its keys and the overrides, before a process starts
        _, _, estimate = command_line(method.part("recipe"), about, hint, argv, prog=f"draftsmith train {method.kind}")
    except RecipeError as err:
        raise UsageError(str(err)) from None
    if "--no-progress" in argv:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if estimate is not None or args.accelerate_config is None and args.num_processes is None:
        return module.main(argv)
    from draftsmith.train.recipe_files import accelerate_config

    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if args.accelerate_config is not None:
        try:
            launch += ["--config_file", str(accelerate_config(args.accelerate_config))]
        except RecipeError as err:
            raise UsageError(f"--accelerate-config: {err}") from None
    if args.num_processes is not None:
        launch += ["--num_processes", str(args.num_processes)]
    return subprocess.call([*launch, "-m", method.trainer, *argv])
