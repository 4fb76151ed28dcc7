"""Recipes, launches, command lines and weight readers shared by the tests: one tiny recipe per
method, so every lifecycle test runs for Medusa, EAGLE-3 and the draft model alike, the
`draftsmith eval`/`tune` command line over the toy target, and the interruption of a run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

# method -> (script, artifact folder, method-specific recipe keys)
METHODS = {
    "medusa": ("train/medusa.py", "heads", {"num_heads": 2, "lr": 1e-2}),
    "eagle": (
        "train/eagle.py",
        "head",
        {"version": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2, "eval_depth": 2, "lr": 3e-3},
    ),
    "draft": ("train/draft.py", "draft", {"draft_init": "checkpoint", "num_draft_tokens": 2, "lr": 1e-3}),
}


def recipe_base(target, data, out, **values) -> dict:
    """The keys every test recipe sets: the target, the data and the run folder `out` (as
    strings), on the CPU; the test's own keys (`values`) on top."""
    return dict(target=str(target), data=str(data), out=str(out), device="cpu") | values


# The toy training the tests share: 2 rows of up to 128 tokens a step, 12 steps (2 of warm-up)
# evaluated after the last on a third of the data, no checkpoint before the end; each method's lr.
TOY_TRAINING = dict(
    batch_size=2, max_length=128, max_steps=12, warmup_steps=2, eval_every=12, save_every=100, heldout_fraction=0.34
)


def toy_recipe(toy_dir: Path, toy_data: Path, out, **values) -> dict:
    """`recipe_base` over the toy target with `TOY_TRAINING`, the test's own keys (`values`, any of
    `TOY_TRAINING`'s among them) on top."""
    return recipe_base(toy_dir / "target", toy_data, out, **(TOY_TRAINING | values))


def head_recipe(toy_dir: Path, toy_data: Path, out, **values) -> dict:
    """`toy_recipe` at lr 3e-3: the training the EAGLE, DFlash and P-EAGLE tests share."""
    return toy_recipe(toy_dir, toy_data, out, **({"lr": 3e-3} | values))


def recipe_values(method: str, toy_dir: Path, toy_data: Path, out: Path, **extra) -> dict:
    quick = dict(max_length=64, max_steps=6, log_every=1, eval_every=1000, save_every=1000, heldout_fraction=0.2)
    values = toy_recipe(toy_dir, toy_data, out, **quick)
    values.update(METHODS[method][2])
    if method == "draft":
        values["draft_path"] = str(toy_dir / "draft")
    values.update(extra)
    return values


def write_recipe(path: Path, values: dict | None = None, /, **more) -> Path:
    """Write the recipe `values` (and/or the keys `more`) to the YAML file `path`, paths as
    strings, and return `path`."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in {**(values or {}), **more}.items()}
    path.write_text("# test recipe\n" + yaml.safe_dump(values), encoding="utf-8")
    return path


def main_of(method: str):
    import importlib

    return importlib.import_module(f"draftsmith.train.{method}").main


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def weights(out: Path, method: str) -> dict:
    from safetensors.torch import load_file

    folder = Path(out) / METHODS[method][1]
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    assert state, f"no weights in {folder}"
    return state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.update(extra)
    return env


def run_script(args: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=timeout
    )


def python_script(method: str) -> list[str]:
    return [sys.executable, str(REPO / METHODS[method][0])]


def toy_eval_args(
    verb: str,
    toy_dir: Path,
    *drafter_args,
    target=None,
    prompts=None,
    limit=None,
    max_new_tokens=None,
    repeats=1,
    k=None,
    out=None,
    device="cpu",
    progress=False,
    extra=(),
) -> list:
    """A `draftsmith eval` (or `tune`, the `verb`) command line over the toy target and its
    prompts: `drafter_args` name the drafters, the keywords what differs between tests (a flag
    whose value is None is left out; `progress=True` leaves out `--no-progress`)."""
    args = [verb, "--target", target or toy_dir / "target", *drafter_args]
    args += ["--prompts", prompts or toy_dir / "prompts.jsonl"]
    for flag, value in (("--limit", limit), ("--max-new-tokens", max_new_tokens), ("--repeats", repeats)):
        if value is not None:
            args += [flag, value]
    if not progress:
        args.append("--no-progress")
    if device is not None:
        args += ["--device", device]
    if k is not None:
        args += ["-k", k]
    if out is not None:
        args += ["--out", out]
    return [*args, *extra]


def accelerate_args(*script_args, processes: int = 2, port: bool = True, options=()) -> list[str]:
    """The command line of `accelerate launch` run by this interpreter (whether or not its bin/ is
    on PATH): `options` (a config file, `--cpu`, `--multi_gpu`), then `processes` processes on one
    machine in fp32 without dynamo, on a free port unless `port` is False, then the script and its
    arguments (`script_args`)."""
    args = [sys.executable, "-m", "accelerate.commands.launch", *options]
    args += ["--num_processes", processes, "--num_machines", 1, "--mixed_precision", "no", "--dynamo_backend", "no"]
    if port:
        args += ["--main_process_port", free_port()]
    return [str(a) for a in [*args, *script_args]]


def toy_generate_args(toy_dir: Path, out, *, max_new_tokens: int = 8, extra=()) -> list[str]:
    """The `draftsmith generate` command line that makes the session's `toy_data` (greedy
    self-distillation of the toy target on 6 prompts, 8 new tokens, batches of 3, shards of 4,
    no chat template) into `out`; a test that changes a setting names it."""
    args = ["generate", "--target", toy_dir / "target", "--prompts", toy_dir / "prompts.jsonl", "--limit", 6]
    args += ["--max-new-tokens", max_new_tokens, "--batch-size", 3, "--shard-size", 4, "--chat-template", "none"]
    args += ["--out", out, "--no-progress", "--device", "cpu", *extra]
    return [str(a) for a in args]


def cache_hidden_args(toy_dir: Path, data, out, layers: str, *extra, dtype: str | None = "fp32") -> list:
    """The `draftsmith cache-hidden` command line over the toy target: the hidden states of
    `layers` on `data` into `out`, stored as `dtype` (None: the default), with `extra` flags."""
    args = ["cache-hidden", "--target", toy_dir / "target", "--data", data, "--layers", layers]
    if dtype is not None:
        args += ["--dtype", dtype]
    return [*args, *extra, "--out", out, "--no-progress", "--device", "cpu"]


def launch_one_process(script: str, values: dict, cwd: Path) -> str:
    """Run the command users run, `accelerate launch --cpu <script> --recipe <recipe>`, with one
    process from the folder `cwd`, in a subprocess, the recipe `values` written to
    `cwd/launched.yaml`: it succeeds; its stdout."""
    recipe = write_recipe(cwd / "launched.yaml", values)
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    cmd = accelerate_args(
        REPO / script, "--recipe", recipe, "--no-progress", processes=1, port=False, options=["--cpu"]
    )
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def smoke_recipe(method, target, data, out, **values) -> dict:
    """The recipe of a registered method's two-step smoke run: `recipe_base` with 2 steps of 2
    rows, the test's own `values`, then the method's own `smoke_recipe` keys on top."""
    common = TOY_TRAINING | dict(
        max_length=64, max_steps=2, warmup_steps=1, log_every=1, eval_every=1000, save_every=1000
    )
    return recipe_base(target, data, out, **common) | values | dict(method.smoke_recipe)


def eval_error_args(toy_dir: Path, *drafter_args, out) -> list:
    """A bare `draftsmith eval` command line over the toy target and its prompts (no quick
    settings: the tests of its argument errors stop before any decoding)."""
    return ["eval", "--target", toy_dir / "target", *drafter_args, "--prompts", toy_dir / "prompts.jsonl", "--out", out]


def assert_loss_falls(out: Path, steps: int) -> None:
    """The run in `out` logged `steps` losses, the mean of the last 3 below that of the first 3."""
    logged = losses(out)
    assert len(logged) == steps and sum(logged[-3:]) / 3 < sum(logged[:3]) / 3


def assert_two_heads_evaluate(run_cli, toy_dir: Path, flag: str, head, second, out: Path, extra=()) -> dict:
    """`draftsmith eval` over the toy target (2 prompts, 8 new tokens, k = 3, into `out`) of the
    head folder `head` and of `second`, named "second", both under `flag` (`extra` flags on top):
    it succeeds and reports both methods; the report."""
    code, _, err = run_cli(
        toy_eval_args(
            "eval",
            toy_dir,
            *(flag, head, flag, f"second={second}"),
            limit=2,
            max_new_tokens=8,
            k=3,
            out=out,
            extra=extra,
        )
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert {"head", "second"} <= {r["method"] for r in report["methods"]}
    return report


def interrupt_call(monkeypatch, owner, name: str, n: int):
    """Make the `n`-th call of `owner.name` raise KeyboardInterrupt (a Ctrl-C in the middle of a
    run), every other call running as it did; the function as it was, to put back."""
    real, calls = getattr(owner, name), []

    def dies_on_nth(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, dies_on_nth)
    return real


def assert_fast_path_decodes_the_same(run_cli, toy_dir: Path, flag: str, out: Path, *drafter_args, **settings):
    """`draftsmith eval` over the toy target of `drafter_args` (`settings` as `toy_eval_args` takes
    them, `--no-distances`), into `out/plain`, then with `flag` (a fast path) into `out/fast`: both
    succeed and every method makes the same new tokens in as many target calls (greedy decoding);
    (the plain report, the fast report, the fast run's stdout)."""
    reports = {}
    for name, extra in (("plain", ()), ("fast", (flag,))):
        args = toy_eval_args(
            "eval", toy_dir, *drafter_args, out=out / name, extra=("--no-distances", *extra), **settings
        )
        code, stdout, err = run_cli(args)
        assert code == 0, err
        reports[name] = json.loads((out / name / "report.json").read_text())
    rows = {r["method"]: r for r in reports["plain"]["methods"]}
    for row in reports["fast"]["methods"]:
        same = (rows[row["method"]]["new_tokens"], rows[row["method"]]["target_calls"])
        assert (row["new_tokens"], row["target_calls"]) == same, row["method"]
    return reports["plain"], reports["fast"], stdout


def generate_cli_args(toy_dir: Path, *flags, prompts=None, out=None, device="cpu", progress=False) -> list:
    """A `draftsmith generate` command line over the toy target and its prompts (or the file
    `prompts`): `flags`, then `--out out` when given, `--no-progress` unless `progress`, and
    `--device device` unless `device` is None."""
    args = ["generate", "--target", toy_dir / "target", "--prompts", prompts or toy_dir / "prompts.jsonl", *flags]
    if out is not None:
        args += ["--out", out]
    if not progress:
        args.append("--no-progress")
    if device is not None:
        args += ["--device", device]
    return args
