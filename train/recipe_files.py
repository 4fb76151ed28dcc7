"""The recipes and accelerate configs that ship inside the package, found by name.

    find_recipe("smollm2/draft")          # -> .../draftsmith/recipes/smollm2/draft.yaml
    find_recipe("my/recipe.yaml")         # a file is taken as it is
    accelerate_config("zero2")            # -> a config whose DeepSpeed JSON path resolves anywhere

A NAME is `<family>/<method>` (the file under recipes/, `.yaml` optional); they are package data,
so they are found the same from a checkout and from a wheel. A path that exists wins over a name.
"""

from __future__ import annotations

import difflib
import tempfile
from importlib import resources
from pathlib import Path

import yaml

from draftsmith.train.recipe import RecipeError

ACCELERATE = "accelerate"  # the folder of accelerate configs (not recipes)


def recipes_root() -> Path:
    """The folder the recipes were installed in (the checkout's recipes/ in an editable install)."""
    return Path(str(resources.files("draftsmith.recipes")))


def shipped_recipes() -> list[str]:
    """Every shipped recipe NAME, `<family>/<method>`."""
    root = recipes_root()
    return sorted(
        str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yaml") if p.parent.name != ACCELERATE
    )


def shipped_accelerate_configs() -> list[str]:
    return sorted(p.stem for p in (recipes_root() / ACCELERATE).glob("*.yaml"))


def _named(spec: str, names: list[str], what: str, hint: str) -> str:
    name = spec.removesuffix(".yaml")
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1)
    guess = f" (did you mean {close[0]}?)" if close else ""
    raise RecipeError(f"{what} {spec!r} is neither a file nor a shipped {hint}{guess}; shipped: {', '.join(names)}")


def find_recipe(spec) -> Path:
    """A recipe file: `spec` itself when it is a file, else the shipped recipe of that NAME."""
    path = Path(str(spec)).expanduser()
    if path.is_file():
        return path
    if path.is_absolute() or str(spec).startswith((".", "~")):  # a file path, not a NAME
        raise RecipeError(f"recipe {str(spec)!r} does not exist")
    name = _named(str(spec), shipped_recipes(), "recipe", "recipe NAME (<family>/<method>)")
    return recipes_root() / f"{name}.yaml"


def accelerate_config(spec) -> Path:
    """An accelerate config file: `spec` itself when it is a file, else the shipped one of that
    NAME (ddp, fsdp2, zero2, zero3, zero3_offload). A shipped DeepSpeed config names its JSON as
    recipes/accelerate/ds_*.json (relative to a checkout); outside one, a copy that names the
    installed JSON by its absolute path is written to a temporary file and returned."""
    path = Path(str(spec)).expanduser()
    if path.is_file():
        return path
    name = _named(str(spec), shipped_accelerate_configs(), "accelerate config", "config")
    path = recipes_root() / ACCELERATE / f"{name}.yaml"
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    deepspeed = (config or {}).get("deepspeed_config") or {}
    json_file = deepspeed.get("deepspeed_config_file")
    if not json_file or Path(json_file).is_file():
        return path
    deepspeed["deepspeed_config_file"] = str(recipes_root() / ACCELERATE / Path(json_file).name)
    with tempfile.NamedTemporaryFile("w", suffix=f"-{name}.yaml", prefix="draftsmith-", delete=False) as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return Path(f.name)
