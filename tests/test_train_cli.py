"""`draftsmith train KIND --recipe NAME|FILE [key=value ...]`: every method of the registry, its
arguments passed unchanged to the trainer's own command line (which finds shipped recipes by name,
package data, and checks the overrides like recipe keys) except the launch flags, and the same from
a non-editable install run outside the checkout."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.heads.registry import METHODS
from draftsmith.scripts import train_cli
from draftsmith.train.recipe import RecipeError
from draftsmith.train.recipe_files import accelerate_config, find_recipe, recipes_root, shipped_recipes

REPO = Path(__file__).resolve().parents[1]


def toy_overrides(toy_dir, toy_data, out) -> list[str]:
    return [
        f"target={toy_dir / 'target'}",
        f"data={toy_data}",
        f"out={out}",
        "device=cpu",
        "num_heads=2",
        "draft_vocab_size=null",  # the shipped recipe's 8,192 draft tokens: the toy has 320
        "max_steps=2",
        "batch_size=2",
        "max_length=64",
        "warmup_steps=1",
        "eval_every=2",
        "save_every=100",
        "heldout_fraction=0.34",
        "hidden_cache=null",  # the shipped recipe reads a cache of the real target
    ]


def test_every_recipe_in_the_folder_is_shipped_by_name():
    on_disk = sorted(str(p.relative_to(REPO / "recipes").with_suffix("")) for p in (REPO / "recipes").glob("*/*.yaml"))
    assert shipped_recipes() == [name for name in on_disk if not name.startswith("accelerate/")]
    assert find_recipe("smollm2/medusa") == recipes_root() / "smollm2" / "medusa.yaml"
    assert find_recipe("llama3/eagle3.yaml").is_file()
    with pytest.raises(
        RecipeError, match=r"recipe 'smollm2/medusaa' is neither a file .* \(did you mean smollm2/medusa\?\)"
    ):
        find_recipe("smollm2/medusaa")


def test_a_shipped_deepspeed_config_finds_its_json_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # recipes/accelerate/ds_zero2.json is not here
    config = yaml.safe_load(accelerate_config("zero2").read_text())
    json_file = Path(config["deepspeed_config"]["deepspeed_config_file"])
    assert json_file.is_absolute() and json.loads(json_file.read_text())["zero_optimization"]["stage"] == 2
    assert accelerate_config("ddp") == recipes_root() / "accelerate" / "ddp.yaml"  # nothing to resolve
    monkeypatch.chdir(REPO)
    assert accelerate_config("zero2") == recipes_root() / "accelerate" / "zero2.yaml"  # a checkout: as it is
    with pytest.raises(RecipeError, match="did you mean zero2"):
        accelerate_config("zero22")


def test_train_with_a_recipe_name_and_overrides(toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "medusa"
    args = ["train", "medusa", "--recipe", "smollm2/medusa", "--no-progress", *toy_overrides(toy_dir, toy_data, out)]
    code, stdout, err = run_cli(args)
    assert code == 0, err
    assert (out / "heads" / "config.json").is_file() and f"heads written to {out / 'heads'}" in stdout
    assert json.loads((out / "recipe.json").read_text())["max_steps"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "smollm2/medusa", "max_step=2"], "unknown key(s) max_step (did you mean max_steps?)"),
        (["--recipe", "smollm2/medusa", "max_steps=many"], "max_steps = 'many' should be int"),
        (["--recipe", "smollm2/medusaa"], "--recipe: recipe 'smollm2/medusaa' is neither a file nor a shipped recipe"),
        (
            ["--recipe", "smollm2/medusa", "--accelerate-config", "zero22"],
            "--accelerate-config: accelerate config 'zero22'",
        ),
    ],
)
def test_bad_train_input_is_one_line_and_exit_2(args, message, run_cli, tmp_path):
    code, _, err = run_cli(["train", "medusa", *args, f"out={tmp_path / 'o'}"])
    assert code == 2 and message in err and err.startswith("draftsmith train: error:"), err
    assert not (tmp_path / "o").exists()


def shipped_name(kind: str) -> str:
    """A shipped recipe of `kind` (smollm2/eagle3 for eagle)."""
    return next(name for name in shipped_recipes() if name.startswith(f"smollm2/{kind}"))


def estimate_overrides(kind, toy_dir, toy_data, out) -> list[str]:
    """A shipped recipe pointed at the toy target (the estimate reads only its config)."""
    fields = {f.name for f in dataclasses.fields(METHODS[kind].part("recipe"))}
    keys = [f"target={toy_dir / 'target'}", f"data={toy_data}", f"out={out}", "device=cpu"]
    keys += [f"{key}=null" for key in ("hidden_cache", "teacher_cache") if key in fields]
    return keys


@pytest.mark.parametrize("kind", list(METHODS))
def test_every_trainer_takes_a_recipe_name_itself(kind, toy_dir, toy_data, tmp_path, capsys):
    """`python -m draftsmith.train.KIND --recipe <family>/<recipe>`: the trainer's own command line
    finds the shipped recipe (here its memory estimate, which loads nothing)."""
    main = importlib.import_module(METHODS[kind].trainer).main
    argv = ["--recipe", shipped_name(kind), "--estimate-memory", *estimate_overrides(kind, toy_dir, toy_data, tmp_path)]
    assert main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("memory per process (estimate, target_sharding=none): target ")
    assert main(["--recipe", "smollm2/nothing"]) == 2
    assert "--recipe: recipe 'smollm2/nothing' is neither a file nor a shipped recipe" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter: ~15 s on 2 busy cores
def test_python_dash_m_takes_a_recipe_name(toy_dir, toy_data, tmp_path):
    args = [
        "--recipe",
        "smollm2/medusa",
        "--estimate-memory",
        *estimate_overrides("medusa", toy_dir, toy_data, tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "draftsmith.train.medusa", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("memory per process (estimate"), run.stdout


def test_the_arguments_go_to_the_trainer_unchanged_and_the_launch_flags_to_accelerate(
    toy_dir, toy_data, tmp_path, run_cli, monkeypatch
):
    launched = []
    monkeypatch.setattr(train_cli.subprocess, "call", lambda command: launched.append(command) or 0)
    trainer = ["--recipe", "smollm2/medusa", "--no-progress", *toy_overrides(toy_dir, toy_data, tmp_path / "o")]
    code, _, err = run_cli(
        ["train", "--num-processes", "3", "medusa", *trainer[:2], "--accelerate-config", "ddp", *trainer[2:]]
    )
    assert code == 0, err
    (command,) = launched
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[3:7] == ["--config_file", str(accelerate_config("ddp")), "--num_processes", "3"]
    assert command[7:] == ["-m", "draftsmith.train.medusa", *trainer]  # the recipe NAME too: each process finds it
    # checked before anything starts: a bad override, or a flag the trainer does not have, launches nothing
    code, _, err = run_cli(["train", "medusa", "--num-processes", "2", *trainer, "max_step=2"])
    assert code == 2 and "unknown key(s) max_step" in err and len(launched) == 1
    code, _, err = run_cli(["train", "medusa", "--num-processes", "2", *trainer, "--max-steps", "2"])
    assert code == 2 and "unrecognized arguments: --max-steps 2" in err and len(launched) == 1
    # the estimate runs here, never under accelerate
    estimate = [
        "--recipe",
        "smollm2/medusa",
        "--estimate-memory",
        *estimate_overrides("medusa", toy_dir, toy_data, tmp_path),
    ]
    code, out, err = run_cli(["train", "medusa", "--num-processes", "2", *estimate])
    assert code == 0 and out.startswith("memory per process") and len(launched) == 1, err


def test_train_help_lists_every_kind_and_each_kind_shows_its_trainer_flags(run_cli):
    code, out, _ = run_cli(["train", "--help"])
    assert code == 0 and "--accelerate-config NAME|FILE" in out and "--num-processes N" in out
    assert all(f"python -m {method.trainer}" in out for method in METHODS.values())
    for kind in METHODS:
        code, out, _ = run_cli(["train", kind, "--help"])
        assert code == 0 and out.startswith(f"usage: draftsmith train {kind} "), out
        assert "--recipe NAME|FILE" in out and "--estimate-memory" in out and "--accelerate-config" in out
    code, _, err = run_cli(["train", "medusas", "--recipe", "smollm2/medusa"])
    assert code == 2 and "argument KIND: invalid choice: 'medusas'" in err


@pytest.mark.slow  # builds the package and trains from it in a fresh interpreter: ~1.5 minutes on 2 busy cores
def test_train_from_a_non_editable_install_outside_the_checkout(toy_dir, toy_data, tmp_path):
    source = tmp_path / "source"  # the build writes build/ and *.egg-info beside the sources: not in the checkout
    skip = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "runs", "__pycache__", ".venv")
    shutil.copytree(REPO, source, ignore=skip)
    site = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
    ]
    build = subprocess.run([*pip, str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    shutil.rmtree(source)  # nothing may be read from a checkout from here on
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = (
        "import sys\n"
        "import draftsmith.train, draftsmith.recipes\n"
        "print('from', draftsmith.train.__file__, draftsmith.recipes.__file__)\n"
        "from draftsmith.scripts.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    args = [
        "train",
        "medusa",
        "--recipe",
        "smollm2/medusa",
        "--no-progress",
        *toy_overrides(toy_dir, toy_data, work / "run"),
    ]
    run = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    where = next(line for line in run.stdout.splitlines() if line.startswith("from "))
    installed = [str(site / "draftsmith" / package / "__init__.py") for package in ("train", "recipes")]
    assert where.split()[1:] == installed  # the installed copy, not the checkout
    assert (work / "run" / "heads" / "config.json").is_file()
