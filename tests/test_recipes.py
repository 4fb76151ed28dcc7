"""Every shipped recipe loads into its method's typed config and starts with the command that runs it."""

from pathlib import Path

import pytest

from draftsmith.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]


def config_for(path: Path):
    name = path.stem
    if name.startswith("medusa"):
        from draftsmith.train.medusa import MedusaRecipe

        return MedusaRecipe, "train/medusa.py"
    if name == "draft":
        from draftsmith.train.draft import DraftRecipe

        return DraftRecipe, "train/draft.py"
    if name.startswith("eagle"):
        from draftsmith.train.eagle import EagleRecipe

        return EagleRecipe, "train/eagle.py"
    raise AssertionError(f"{path}: no method for this recipe name")


RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


def test_there_are_recipes_for_every_family():
    families = {p.parent.name for p in RECIPES}
    assert {"demo", "llama3", "qwen2.5", "qwen3", "mistral"} <= families


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_loads_and_documents_its_command(path):
    config_cls, script = config_for(path)
    recipe = load_recipe(config_cls, path)
    text = path.read_text()
    assert text.startswith("#"), "a recipe starts with a comment block"
    assert f"accelerate launch {script} --recipe recipes/{path.parent.name}/{path.name}" in text
    assert recipe.out and recipe.target
