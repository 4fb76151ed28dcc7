"""Every shipped recipe loads into its method's typed config and starts with the command that runs it."""

from pathlib import Path

import pytest

from draftsmith.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
#: Recipes of trainers that take a head of any method instead of being one (not in the registry):
#: file name -> (the recipe class, the trainer's script).
POST_TRAINERS = {"onpolicy": ("draftsmith.train.onpolicy:OnPolicyRecipe", "train/onpolicy.py")}


def config_for(path: Path):
    """(the recipe class, the trainer's script) of the registered method whose recipe names the
    file's (`Method.recipe_files`; medusa2.yaml is a Medusa recipe), or of a POST_TRAINERS entry."""
    import importlib

    from draftsmith.heads.registry import METHODS

    name = path.stem
    if name in POST_TRAINERS:
        (module, _, cls), script = POST_TRAINERS[name][0].partition(":"), POST_TRAINERS[name][1]
        return getattr(importlib.import_module(module), cls), script
    for exact in (True, False):
        for method in METHODS.values():
            if any(name == r if exact else name.startswith(r) for r in method.recipe_files):
                return method.part("recipe"), method.trainer.removeprefix("draftsmith.").replace(".", "/") + ".py"
    raise AssertionError(f"{path}: no method for this recipe name")


RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")
LAUNCH_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


def test_there_are_recipes_for_every_family():
    families = {p.parent.name for p in RECIPES}
    assert {"smollm2", "llama3", "qwen2.5", "qwen3", "mistral"} <= families


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_loads_and_documents_its_command(path):
    config_cls, script = config_for(path)
    recipe = load_recipe(config_cls, path)
    text = path.read_text()
    assert text.startswith("#"), "a recipe starts with a comment block"
    assert f"accelerate launch {script} --recipe recipes/{path.parent.name}/{path.name}" in text
    import re

    command = re.escape(f"accelerate launch {script} --recipe recipes/{path.parent.name}/{path.name}")
    assert re.search(rf"^#.*{command} [a-z0-9_]+=", text, re.M), "the comment block shows one key=value override"
    assert recipe.out and recipe.target


def test_launch_configs_for_every_engine():
    assert {p.stem for p in LAUNCH_CONFIGS} == {"ddp", "fsdp2", "zero2", "zero3", "zero3_offload"}


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_launch_config_loads_and_leaves_batch_sizes_to_the_recipe(path):
    import json

    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    text = path.read_text()
    assert text.startswith("#") and f"accelerate launch --config_file recipes/accelerate/{path.name} " in text
    if config.distributed_type == "DEEPSPEED":
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        for key in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
        ):
            assert ds[key] == "auto", f"{ds_file.name}: {key} must come from the recipe"
        assert ds["zero_optimization"]["stage"] == (2 if "zero2" in path.stem else 3)
        assert ("offload_optimizer" in ds["zero_optimization"]) == ("offload" in path.stem)
    elif config.distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2


QWEN3_5 = sorted((REPO / "recipes" / "qwen3_5").glob("*.yaml"))


@pytest.mark.parametrize("path", QWEN3_5, ids=lambda p: p.stem)
def test_the_hybrid_recipes_estimate_memory_on_qwen3_5_27b(path):
    """The Qwen3.5 recipes against a meta model of Qwen3.5-27B's text shape (64 layers: 48 Gated
    DeltaNet, 16 full attention; 26.9B parameters): the estimate counts the recurrent layers'
    weights with the rest (bf16: ~54 GB), the recipe's aux layers exist, and the head is counted."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from draftsmith.heads.registry import METHODS
    from draftsmith.train.sharding import estimate_memory

    config = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
    )
    with init_empty_weights():
        target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert config.layer_types.count("linear_attention") == 48
    recipe_class, _ = config_for(path)
    recipe = load_recipe(recipe_class, path)
    kind = next(m.kind for m in METHODS.values() if m.part("recipe") is recipe_class)
    assert all(0 <= i <= 64 for i in getattr(recipe, "aux_layers", None) or ())
    estimate = estimate_memory(recipe, kind, shards=1, target=target)
    assert 53e9 < estimate.target_bytes < 55e9  # 26.9B parameters in bf16, the recurrent layers' among them
    assert estimate.trainable_params > 0 and estimate.total > estimate.target_bytes
