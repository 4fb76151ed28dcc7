"""Recipes, launches and weight readers shared by the training-lifecycle tests: one tiny recipe
per method, so every test runs for Medusa, EAGLE-3 and the draft model alike."""

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


def recipe_values(method: str, toy_dir: Path, toy_data: Path, out: Path, **extra) -> dict:
    values = dict(
        target=str(toy_dir / "target"),
        data=str(toy_data),
        out=str(out),
        device="cpu",
        batch_size=2,
        max_length=64,
        max_steps=6,
        warmup_steps=2,
        log_every=1,
        eval_every=1000,
        save_every=1000,
        heldout_fraction=0.2,
    )
    values.update(METHODS[method][2])
    if method == "draft":
        values["draft_path"] = str(toy_dir / "draft")
    values.update(extra)
    return values


def write_recipe(path: Path, values: dict) -> Path:
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
