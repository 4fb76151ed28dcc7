"""Recipes: one YAML per model family and method, read into the method's typed config.

    accelerate launch train/medusa.py --recipe recipes/demo/medusa.yaml max_steps=50 lr=3e-4

The YAML names components and hyperparameters only; defaults live in the method's config
dataclass, nowhere else. Unknown keys are errors that list the valid ones (a typo must not
silently train with a default). `key=value` overrides on the command line are parsed as YAML
values (`lr=3e-4`, `share_lm_head=true`, `lora_target_modules=[q_proj,v_proj]`).
Strings that start with `~` are expanded to the home folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


def _expected_type(cls, name):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _check_value(cls, name: str, value, where: str):
    """Light type check against the dataclass annotation (int/float/bool/str/list/None)."""
    hint = _expected_type(cls, name)
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (hint,)
    for option in options:
        base = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return value
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base is bool and isinstance(value, bool):
            return value
        if base is str and isinstance(value, str):
            return os.path.expanduser(value) if value.startswith("~") else value
        if base in (list, tuple) and isinstance(value, (list, tuple)):
            return list(value)
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise RecipeError(f"{where}: {name} = {value!r} should be {names}")


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(text) if text.strip() else None
    return overrides


def load_recipe(config_cls, path: str | Path | None, overrides: list[str] | dict | None = None):
    """`config_cls` instance from the YAML at `path` (or none) plus overrides."""
    values: dict = {}
    where = "recipe"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise RecipeError(f"recipe {where!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {where!r} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"recipe {where!r} must be a mapping of key: value, got {type(loaded).__name__}")
        values.update(loaded or {})
    extra = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for source, mapping in ((where, values), ("command line", extra)):
        unknown = sorted(set(mapping) - fields)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, fields, n=1)
                hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
            raise RecipeError(f"{source}: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(sorted(fields))}")
    values.update(extra)
    checked = {name: _check_value(config_cls, name, value, where) for name, value in values.items()}
    try:
        return config_cls(**checked)
    except TypeError as err:  # a required key is missing
        required = [f.name for f in dataclasses.fields(config_cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in checked]
        raise RecipeError(f"{where}: missing required key(s) {', '.join(missing)} ({err})") from None
    except ValueError as err:
        raise RecipeError(f"{where}: {err}") from None


def recipe_dict(config) -> dict:
    """The resolved recipe (every default filled in), saved with checkpoints and results."""
    return dataclasses.asdict(config)


def run_info(recipe) -> dict:
    """What a run's folder records beside its outputs: the resolved recipe, the versions of the
    packages that shape the result, the git revision and the machine, so a run can be
    reproduced (or a drift explained) from its folder alone."""
    import platform
    import subprocess
    import sys
    from importlib import metadata

    versions = {}
    for package in ("draftsmith", "torch", "transformers", "accelerate", "peft", "datasets", "safetensors", "tokenizers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "recipe": recipe_dict(recipe),
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_revision": revision,
        "command": sys.argv,
    }
