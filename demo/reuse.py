"""When a second `draftsmith demo` may print the report of the first instead of measuring again.

The evaluation is most of a cached rerun's time (about 20 minutes on 2 CPU cores, against a
minute to load everything). A report in `--out` is reused only when everything its figures
depend on is unchanged: the demo's settings and budget, the target's fingerprint, the bytes of
every trained drafter and of the held-out prompts, the source of the package that measured it,
the torch and transformers versions, the device, dtype and thread count. Anything else, or
`--remeasure`, measures again. A reused report says when it was measured.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import torch

# The packages whose code decides what the demo measures: the decoder, the evaluator, the heads,
# the prompts and the demo itself (training code is covered by the drafters' own bytes).
MEASURING_PACKAGES = ("decoding", "eval", "heads", "distill", "demo")


def folder_sha256(folder: Path) -> str:
    """sha256 over every file below `folder`: its relative path and its bytes."""
    from draftsmith.heads.artifacts import files_sha256

    return hashlib.sha256(json.dumps(files_sha256(folder)).encode()).hexdigest()


def code_sha256() -> str:
    """sha256 over the Python source of the measuring packages, by module path."""
    digest = hashlib.sha256()
    for name in MEASURING_PACKAGES:
        for root in (Path(p) for p in importlib.import_module(f"draftsmith.{name}").__path__):
            for path in sorted(root.rglob("*.py")) if root.is_dir() else ():
                digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def measured_inputs(*, settings: dict, budget: dict, target, folders: dict, prompts_file, device, dtype) -> dict:
    """Everything a demo report's figures depend on, as plain JSON values."""
    import transformers

    from draftsmith.heads.artifacts import file_sha256
    from draftsmith.heads.models import target_fingerprint

    device = torch.device(device)
    inputs = {
        "settings": settings,
        "budget": budget,
        "target": target_fingerprint(target),
        "drafters": {name: folder_sha256(folder) for name, folder in sorted(folders.items())},
        "prompts": file_sha256(prompts_file),
        "code": code_sha256(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    return json.loads(json.dumps(inputs))  # tuples become lists, as they come back from report.json


def reusable_report(out: Path, inputs: dict) -> dict | None:
    """The report in `out` when it was measured from exactly `inputs`, else None."""
    try:
        report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    demo = report.get("demo") if isinstance(report, dict) else None
    if not isinstance(demo, dict) or demo.get("inputs") != inputs:
        return None
    if not all((out / name).is_file() for name in ("report.md", "acceptance.png")):
        return None
    return report
