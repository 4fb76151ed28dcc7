"""`target_sharding`: the frozen target partitioned over processes (fsdp2, zero3) or spread over
the devices of one process (device_map), and the memory estimate that refuses a target that cannot fit.

- Two CPU processes with the target's decoder layers partitioned by `fully_shard` or by DeepSpeed
  ZeRO-3 (each holding half of them) train what one process with the whole target trains on the
  same global batch: the same loss at every step, the same final weights. The data's target check
  passes too, so the partitioned target's fingerprint is the whole target's.
- The estimator's numbers on the toy config, against a count written out by hand.
- The refusal: a device too small for the estimate stops the trainer with one line naming the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from lifecycle_helpers import (
    METHODS,
    accelerate_args,
    child_env,
    losses,
    main_of,
    recipe_values,
    run_script,
    weights,
    write_recipe,
)

from draftsmith.heads.registry import METHODS as REGISTRY
from draftsmith.heads.registry import get_method
from draftsmith.train import sharding
from draftsmith.train.medusa import MedusaRecipe
from draftsmith.train.recipe import RecipeError, load_recipe

# Losses agree to float32 summation order (measured 2e-7 relative for Medusa); weights to 1e-5.
# At the lifecycle recipe's EAGLE lr of 3e-3 Adam turns the rounding of one near-zero gradient into
# an update difference of 2e-5 (1 q_proj element in 4608, as tests/test_fsdp2.py found): 1e-3 here.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
LR = {"eagle": 1e-3}

# The toy target (heads/toy.py tiny_config("llama")): hidden 48, 2 layers, MLP 96, 4 heads of 12,
# 2 kv heads, vocabulary 320, untied lm_head, float32.
H, L, I, HEADS, KV, HD, V = 48, 2, 96, 4, 2, 12, 320
LAYER = H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H + 3 * H * I + 2 * H  # q, k, v, o, gate/up/down, 2 norms
NOT_LAYERS = V * H + H + V * H  # embeddings, final norm, lm_head
GIB = 1024**3


def medusa_recipe(toy_dir, toy_data, tmp_path, **extra):
    return MedusaRecipe(**recipe_values("medusa", toy_dir, toy_data, tmp_path / "run", **extra))


def test_the_estimate_matches_a_hand_count(toy_dir, toy_data, tmp_path):
    recipe = medusa_recipe(toy_dir, toy_data, tmp_path, target_sharding="fsdp2")  # 2 heads of 1 block, batch 2 x 64
    estimate = sharding.estimate_memory(recipe, "medusa", shards=2)
    assert estimate.target_bytes == 4 * (L * LAYER + NOT_LAYERS) == 289_728
    assert estimate.target_share == 4 * NOT_LAYERS + math.ceil(4 * L * LAYER / 2)  # layers halved, the rest whole
    assert estimate.gathered_layer == 4 * LAYER
    assert estimate.trainable_params == 2 * (H * H + H) + 2 * V * H  # a residual block and an lm_head copy per head
    assert estimate.activations == 2 * 64 * ((L + 1) * H * 4 + 3 * V * 4)
    assert estimate.total == estimate.target_share + 4 * LAYER + 16 * estimate.trainable_params + estimate.activations
    whole = sharding.estimate_memory(
        load_recipe(MedusaRecipe, None, recipe_values("medusa", toy_dir, toy_data, tmp_path / "r")), "medusa"
    )
    assert whole.target_share == whole.target_bytes and whole.gathered_layer == 0
    assert "target 282.9 KiB over 2 -> " in estimate.describe() and "(float32)" in estimate.describe()
    zero3 = sharding.estimate_memory(
        medusa_recipe(toy_dir, toy_data, tmp_path, target_sharding="zero3"), "medusa", shards=2
    )
    assert dataclasses.replace(zero3, sharding="fsdp2") == estimate  # ZeRO-3 partitions the same layers
    assert zero3.target_share == estimate.target_share and zero3.gathered_layer == 4 * LAYER


def build_head(kind, recipe, target, data):
    """What `train/<kind>.py` builds for `target` (its `train` builds it inline; these calls mirror it),
    with the trainers' own vocabulary map and mask token."""
    from draftsmith.train.common import draft_vocab_map, mask_token, target_sizes
    from draftsmith.train.eagle import head_options

    _, V, _ = target_sizes(target)
    if kind == "medusa":
        from draftsmith.heads.medusa import MedusaHeads

        return MedusaHeads.for_target(target, recipe.num_heads, recipe.num_layers, recipe.share_lm_head)
    if kind == "draft":
        from draftsmith.heads.models import load_tokenizer
        from draftsmith.train.draft import build_draft

        return build_draft(recipe, target, load_tokenizer(recipe.target), torch.device("cpu"))
    vocab_map = draft_vocab_map(recipe, data, V) if getattr(recipe, "version", "eagle3") == "eagle3" else None
    shape = dict(aux_layer_ids=recipe.aux_layers, vocab_map=vocab_map)
    if kind == "eagle":
        from draftsmith.heads.eagle import EagleHead

        return EagleHead.for_target(target, recipe.version, **shape, **head_options(recipe))
    mask_id, _ = mask_token(recipe, data, V)
    if kind == "peagle":
        from draftsmith.heads.eagle import PEagleHead

        options = head_options(recipe)
        return PEagleHead.for_target(target, mask_token_id=mask_id, num_depths=recipe.num_depths, **shape, **options)
    block = dict(num_layers=recipe.num_layers, block_size=recipe.block_size, mask_token_id=mask_id, **shape)
    if kind == "dflash":
        from draftsmith.heads.dflash import DFlashHead

        return DFlashHead.for_target(target, **block)
    if kind == "dspark":
        from draftsmith.heads.dspark import DSparkHead
        from draftsmith.train.dspark import VARIANT

        return DSparkHead.for_target(target, **block, **{key: getattr(recipe, key) for key in VARIANT})
    if kind == "domino":
        from draftsmith.heads.domino import DominoHead
        from draftsmith.train.domino import VARIANT

        return DominoHead.for_target(target, **block, **{key: getattr(recipe, key) for key in VARIANT})
    if kind == "dflash2":
        from draftsmith.heads.dflash2 import DFlash2Head
        from draftsmith.train.dflash2 import VARIANT

        return DFlash2Head.for_target(target, **block, **{key: getattr(recipe, key) for key in VARIANT})
    raise AssertionError(f"no builder for {kind!r}: add the head its trainer builds to build_head")


def head_recipe(kind, toy_dir, toy_data, out, **extra):
    """`kind`'s recipe on the toy target: the lifecycle tests' keys where they have them, else the run keys."""
    values = recipe_values(kind if kind in METHODS else "medusa", toy_dir, toy_data, out)
    if kind not in METHODS:
        values.pop("num_heads")
    return get_method(kind).part("recipe")(**{**values, **extra})


# Every method with its lifecycle recipe, then the variants that change the count's formula.
VARIANTS = [
    ("medusa", {"share_lm_head": True, "num_layers": 2}),
    ("eagle", {"version": "eagle1", "draft_vocab_size": None}),
    ("eagle", {"fc_norm": True, "norm_output": True, "draft_vocab_size": None, "aux_layers": [0, 2]}),
    ("eagle", {"draft_vocab_size": None, "vocab_map": "VOCAB_MAP"}),
    ("peagle", {"fc_norm": True, "draft_vocab_size": 64, "num_depths": 3}),
    ("peagle", {"qk_norm": False, "draft_vocab_size": 64, "num_depths": 3}),
    ("eagle", {"qk_norm": True, "draft_vocab_size": None}),
    ("dflash", {"draft_vocab_size": 64, "num_layers": 2}),
    ("dflash", {"aux_layers": [0, 1, 2]}),
    ("draft", {"draft_init": "truncate", "draft_layers": 1}),
    ("draft", {"draft_init": "config", "draft_layers": 1, "draft_hidden": 32}),
]


CASES = [(kind, {}) for kind in REGISTRY] + VARIANTS


@pytest.mark.parametrize("kind, extra", CASES, ids=[f"{kind}-{'-'.join(extra) or 'recipe'}" for kind, extra in CASES])
def test_the_head_count_is_what_the_trainer_trains(kind, extra, toy_dir, toy_data, tmp_path):
    """The estimator counts the trained model from the recipe's shape keys before the target
    loads (each trainer's `head_parameters`, through the registry); the trainers' own modules,
    built on the real toy target, hold that many parameters."""
    from draftsmith.distill.data import DistillData
    from draftsmith.distill.vocab import build_vocab_map, save_vocab_map
    from draftsmith.heads.models import load_causal_lm

    data = DistillData(str(toy_data))
    if extra.get("vocab_map") == "VOCAB_MAP":  # a `draftsmith vocab-map` file: its size is read from the file
        vmap = build_vocab_map(data.token_counts(), 48, data.data_hash)
        extra = {**extra, "vocab_map": str(save_vocab_map(vmap, tmp_path / "vocab.safetensors"))}
    recipe = head_recipe(kind, toy_dir, toy_data, tmp_path / "run", **extra)
    target = load_causal_lm(recipe.target, device=torch.device("cpu"), dtype=torch.float32, role="target")
    built = build_head(kind, recipe, target, data)
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in built.parameters() if not p.requires_grad)
    assert get_method(kind).head_parameters(recipe, target) == (trainable, frozen)
    estimate = sharding.estimate_memory(recipe, kind)  # on the meta target, as a run prints it
    assert (estimate.trainable_params, estimate.frozen_head_params) == (trainable, frozen)


def test_a_target_that_cannot_fit_is_refused_with_the_numbers(toy_dir, toy_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sharding, "available_bytes", lambda device: (300_000, f"free on {device}"))
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", recipe_values("medusa", toy_dir, toy_data, out))
    assert main_of("medusa")(["--recipe", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(
        r"target does not fit: memory per process .*target 282\.9 KiB .* = 1\.\d+ MiB, more than 90% of the 293\.0 KiB free on cpu",
        err,
    ), err
    assert "set target_sharding: fsdp2" in err
    assert not out.exists()  # refused before anything was written
    # 8 GiB of layers over 2 processes of 1 GiB: 4 GiB each; 10 give 0.8 GiB + one gathered 0.05 GiB (9 give 0.94)
    estimate = sharding.estimate_memory(
        MedusaRecipe(**recipe_values("medusa", toy_dir, toy_data, out, target_sharding="fsdp2")), "medusa", shards=2
    )
    big = dataclasses.replace(
        estimate, target_bytes=8 * GIB, replicated_bytes=0, layer_bytes=GIB // 20, trainable_params=0, activations=0
    )
    with pytest.raises(
        sharding.ShardingError,
        match=r"target 8\.00 GiB over 2 -> 4\.00 GiB .* = 4\.05 GiB, more than 90% of the 1\.00 GiB free on cuda:0; 10 processes of this size would fit",
    ):
        sharding.check_fits(big, GIB, "free on cuda:0")
    sharding.check_fits(big.with_shards(10), GIB, "free on cuda:0")  # fits: no error
    with pytest.raises(sharding.ShardingError, match="even one layer per device does not fit"):
        sharding.check_fits(estimate, 1000, "free on cuda:0")


def test_a_bad_target_sharding_is_one_line_naming_the_key(toy_dir, toy_data, tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(
            MedusaRecipe,
            None,
            recipe_values("medusa", toy_dir, toy_data, tmp_path / "run", target_sharding="tensor_parallel"),
        )
    message = "target_sharding = 'tensor_parallel': expected one of none, device_map, fsdp2, zero3"
    assert message in str(err.value) and str(err.value).startswith("command line: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("how", ["fsdp2", "zero3"])
def test_sharding_needs_a_frozen_target_and_the_right_process_count(how, toy_dir, toy_data, tmp_path, capsys):
    from draftsmith.train.draft import DraftRecipe

    with pytest.raises(RecipeError, match="medusa2 trains LoRA on it"):
        load_recipe(
            MedusaRecipe,
            None,
            recipe_values("medusa", toy_dir, toy_data, tmp_path / "a", mode="medusa2", target_sharding=how),
        )
    with pytest.raises(
        RecipeError, match=f"target_sharding = {how} partitions the layers draft_init = truncate copies"
    ):
        load_recipe(
            DraftRecipe,
            None,
            recipe_values("draft", toy_dir, toy_data, tmp_path / "a", draft_init="truncate", target_sharding=how),
        )
    recipe = write_recipe(
        tmp_path / "r.yaml", recipe_values("medusa", toy_dir, toy_data, tmp_path / "run", target_sharding=how)
    )
    assert main_of("medusa")(["--recipe", str(recipe), "--no-progress"]) == 2
    assert f"target_sharding = {how} partitions the target over processes, but 1 was started" in capsys.readouterr().err


def test_estimate_memory_prints_without_loading(toy_dir, toy_data, tmp_path, capsys):
    recipe = write_recipe(
        tmp_path / "r.yaml", recipe_values("medusa", toy_dir, toy_data, tmp_path / "run", target_sharding="fsdp2")
    )
    args = ["--recipe", str(recipe), "--estimate-memory", "--shards", "2", "--device-memory", "0.0003"]
    assert main_of("medusa")(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("memory per process (estimate, target_sharding=fsdp2): target 282.9 KiB over 2 -> ")
    assert re.match(r"fits with \d+ processes of 0\.0003 GiB", lines[1]) or lines[1].startswith("no number of"), lines
    assert not (tmp_path / "run").exists()


def test_device_map_in_one_process_trains_what_the_whole_target_trains(toy_dir, toy_data, tmp_path):
    """On a machine without GPUs every layer maps to the CPU: the path (the plan, the output hook,
    the head kept where the map put the last hidden state) runs; several GPUs are not exercised."""
    runs = {}
    for value in ("none", "device_map"):
        out = tmp_path / value
        recipe = write_recipe(
            tmp_path / f"{value}.yaml",
            recipe_values("medusa", toy_dir, toy_data, out, max_steps=3, target_sharding=value),
        )
        assert main_of("medusa")(["--recipe", str(recipe), "--no-progress"]) == 0
        runs[value] = out
    assert losses(runs["device_map"]) == losses(runs["none"])
    summary = json.loads((runs["device_map"] / "training_summary.json").read_text())
    assert summary["target_sharding"] == "device_map" and summary["memory_estimate"]["sharding"] == "device_map"


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, how, launch",
    [("medusa", "fsdp2", "ddp"), ("eagle", "fsdp2", "ddp"), ("medusa", "zero3", "ddp"), ("medusa", "zero3", "zero2")],
)
def test_two_processes_with_the_target_partitioned_train_what_one_whole_target_trains(
    method, how, launch, toy_dir, toy_data, tmp_path
):
    """The head's engine (DDP, or DeepSpeed ZeRO-2) is independent of the target's partitioning."""
    keys = {"max_steps": 4, **({"lr": LR[method]} if method in LR else {})}
    reference = tmp_path / "whole"
    recipe = write_recipe(
        tmp_path / "whole.yaml", recipe_values(method, toy_dir, toy_data, reference, batch_size=4, **keys)
    )
    assert main_of(method)(["--recipe", str(recipe), "--no-progress"]) == 0

    out = tmp_path / "sharded"
    # DeepSpeed must not be told `cpu` (accelerate would skip it); without CUDA it runs on the CPU over gloo.
    device, env = ("cpu", {"ACCELERATE_USE_CPU": "true"}) if launch == "ddp" else ("auto", {})
    values = recipe_values(method, toy_dir, toy_data, out, batch_size=2, target_sharding=how, device=device, **keys)
    recipe = write_recipe(tmp_path / "sharded.yaml", values)
    args = accelerate_args(
        METHODS[method][0],
        "--recipe",
        recipe,
        "--no-progress",
        options=["--config_file", f"recipes/accelerate/{launch}.yaml"],
    )
    done = run_script(args, env=child_env(**env))
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["distributed"].endswith("DEEPSPEED" if launch == "zero2" else "MULTI_CPU"), summary["distributed"]
    estimate = summary["memory_estimate"]
    assert summary["processes"] == 2 and summary["target_sharding"] == how and estimate["shards"] == 2
    # the main process holds half of the layers and the rest whole (FSDP2 shards dim 0, ZeRO-3 each flattened
    # parameter: every toy dim 0 and size is even)
    held, layers = summary["target_bytes_held"], estimate["target_bytes"] - estimate["replicated_bytes"]
    assert held == estimate["replicated_bytes"] + layers // 2 < estimate["target_bytes"], summary
    assert "target: " in done.stdout and "held by each process" in done.stdout
    torch.testing.assert_close(losses(out), losses(reference), rtol=LOSS_RTOL, atol=0)
    a, b = weights(reference, method), weights(out, method)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=WEIGHT_ATOL)
