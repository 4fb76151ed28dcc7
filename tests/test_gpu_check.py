"""scripts/gpu_check.sh as its CPU dry run (`GPU_CHECK_DEVICE=cpu`): the same commands on a toy target, so
a GPU session does not spend its time finding a command that no longer parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAGES = ("preflight", "target", "data", "eagle3", "draft", "eval", "tune", "fastpath")


@pytest.mark.slow
def test_every_stage_of_the_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = os.environ | {
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # its python3: this one
    }
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])
    timings = [line.split() for line in (out / "timings.txt").read_text().splitlines()[1:]]
    assert [row[0] for row in timings] == [*STAGES, "total"] and all(row[2] == "0" for row in timings[:-1])
    report = json.loads((out / "report.json").read_text())
    assert {"target-only", "distilled-draft"} <= {row["method"] for row in report["methods"]}
    assert (out / "bench.json").is_file() and (out / "serving.json").is_file()
    assert (out / "tune-eagle3" / "tuning.json").is_file() and (out / "eval-compiled" / "report.json").is_file()
