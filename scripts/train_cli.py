"""`draftsmith train`: a trainer of train/ run from anywhere, with a shipped recipe or a file.

    draftsmith train medusa --recipe smollm2/medusa max_steps=50 loss=forward_kl
    draftsmith train eagle --recipe my-eagle3.yaml --accelerate-config zero2 --num-processes 8

Without --accelerate-config / --num-processes the loop runs in this process (as
`python train/medusa.py` does); with them, `accelerate launch` starts the same module. The
recipe and its key=value overrides are checked before anything starts.
"""

from __future__ import annotations

import subprocess
import sys

from draftsmith.scripts._args import UsageError, positive_int

# method -> (module, its recipe class); the module's main() is the trainer's command line
TRAINERS = {
    "medusa": ("draftsmith.train.medusa", "MedusaRecipe"),
    "eagle": ("draftsmith.train.eagle", "EagleRecipe"),
    "draft": ("draftsmith.train.draft", "DraftRecipe"),
    "dflash": ("draftsmith.train.dflash", "DFlashRecipe"),
    "peagle": ("draftsmith.train.peagle", "PEagleRecipe"),
}


def add_commands(sub) -> None:
    tr = sub.add_parser(
        "train",
        help="train a drafter with a recipe: a shipped NAME (smollm2/medusa, llama3/eagle3, ...) or a YAML file",
        description=__doc__.split("\n\n")[0],
    )
    methods = tr.add_subparsers(dest="method", required=True, metavar="{" + ",".join(TRAINERS) + "}")
    for method in TRAINERS:  # one parser per trainer: the overrides are then its only positionals
        m = methods.add_parser(method, help=f"train/{method}.py")
        m.add_argument(
            "--recipe",
            required=True,
            help="a shipped recipe NAME (<family>/<method>, e.g. smollm2/medusa) or a YAML file",
        )
        m.add_argument(
            "--accelerate-config",
            help="launch with `accelerate launch`: a shipped config NAME (ddp, fsdp2, zero2, zero3, zero3_offload) or a file",
        )
        m.add_argument(
            "--num-processes",
            type=positive_int("--num-processes"),
            help="processes for `accelerate launch` (default: the config's)",
        )
        m.add_argument(
            "--resume",
            nargs="?",
            const=True,
            metavar="CHECKPOINT",
            help="continue the run in `out` from its latest checkpoint, or from the checkpoint given",
        )
        m.add_argument("--init-from", metavar="PATH", help="warm start from the weights of a checkpoint or run folder")
        m.add_argument("--no-progress", action="store_true")
        m.add_argument(
            "--estimate-memory",
            action="store_true",
            help="print the memory per process the recipe needs (nothing is loaded) and exit",
        )
        m.add_argument(
            "--shards",
            type=positive_int("--shards"),
            help="with --estimate-memory: processes (fsdp2, zero3) or GPUs (device_map)",
        )
        m.add_argument(
            "--device-memory",
            type=float,
            metavar="GIB",
            help="with --estimate-memory: a device's memory, to say how many fit",
        )
        m.add_argument(
            "overrides", nargs="*", metavar="key=value", help="recipe overrides, checked like the recipe's keys"
        )
        m.set_defaults(func=cmd_train)


def trainer_argv(args) -> list[str]:
    """The trainer's own command line (train/run.py `command_line`): the recipe found, the rest as given."""
    from draftsmith.train.recipe import RecipeError
    from draftsmith.train.recipe_files import find_recipe

    try:
        recipe = find_recipe(args.recipe)
    except RecipeError as err:
        raise UsageError(f"--recipe: {err}") from None
    extra = ["--no-progress"] if args.no_progress else []
    extra += ["--estimate-memory"] if args.estimate_memory else []
    extra += ["--shards", str(args.shards)] if args.shards is not None else []
    extra += ["--device-memory", str(args.device_memory)] if args.device_memory is not None else []
    if args.init_from is not None:
        extra += ["--init-from", args.init_from]
    if args.resume is True:
        extra.append("--resume")
    elif args.resume is not None:
        extra += ["--resume", args.resume]
    return ["--recipe", str(recipe), *extra, *args.overrides]


def cmd_train(args) -> int:
    import importlib

    from draftsmith.train.recipe import RecipeError
    from draftsmith.train.run import command_line

    module_name, recipe_class = TRAINERS[args.method]
    module = importlib.import_module(module_name)
    argv = trainer_argv(args)
    try:  # the recipe, its keys and the overrides, before a process starts
        command_line(getattr(module, recipe_class), f"draftsmith train {args.method}", "a recipe", argv)
    except RecipeError as err:
        raise UsageError(str(err)) from None
    if args.estimate_memory or args.accelerate_config is None and args.num_processes is None:
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
    return subprocess.call([*launch, "-m", module_name, *argv])
