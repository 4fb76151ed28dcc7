"""What `draftsmith demo` trains on top of the demo target, cached beside it.

  1. self-distillation data: the target's own answers to its training prompts under its chat
     template (`draftsmith.distill.generate`, resumable shards, loss masks on the answers);
  2. one hidden-state cache of that data (`draftsmith.distill.hidden_cache`): the layers every
     head reads ((2, L//2, L-3) for heads that read several, and the last) and the target's top-k logits, paid once
     and shared by every trainer below;
  3. every registered method (heads/registry.py) that has a shipped recipe for the target's family
     (`recipes/<family>/<name>.yaml`), trained from that recipe with the demo's data, cache, steps
     and batch: the recipes are the settings, for the demo and for the command line alike.

They live in `<cache>/demo-heads-<target>-<budget>/` with a stamp recording the target's
fingerprint and the data budget; a stamp that does not match means the folder is rebuilt, never
reused. A trained artifact is reused only when its saved recipe equals the one the demo would run.
"""

from __future__ import annotations

import shutil
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from draftsmith.distill.data import read_json, write_json_atomic


@dataclass(frozen=True)
class HeadsBudget:
    family: str  # recipes/<family>/: one shipped recipe per method sets how it trains on this target
    prompts: int  # training prompts answered by the target
    max_new_tokens: int  # per answer
    generate_batch: int
    max_length: int  # prompt + answer tokens trained
    batch_size: int  # rows per training step, every method
    steps_scale: float = 1.0  # each recipe's max_steps times this
    max_steps: int | None = None  # instead: every method this many steps
    overrides: tuple[tuple[str, object], ...] = ()  # recipe keys set for every method whose recipe has them
    evals: int = 1  # held-out evaluations per training run (their simulated tau is the learning curve)
    topk_logits: int = 64  # the top-k teacher logits kept in the cache (+ the tail's mass)


# Sized for 2 CPU cores (see README "draftsmith demo" for the measured times); `long` shows how
# acceptance grows with the tokens trained. The micro target (a toy) takes the same recipes, made small.
_SMOLLM2 = HeadsBudget("smollm2", prompts=512, max_new_tokens=128, generate_batch=16, max_length=512, batch_size=8)
BUDGETS = {
    ("smollm2", "default"): _SMOLLM2,
    ("smollm2", "long"): replace(_SMOLLM2, prompts=1024, steps_scale=4.0, evals=5),  # 2x prompts, 4x steps
    ("micro", "default"): HeadsBudget(
        "smollm2",
        prompts=32,
        max_new_tokens=16,
        generate_batch=8,
        max_length=512,
        batch_size=4,
        max_steps=10,
        topk_logits=8,
        overrides=(
            ("draft_vocab_size", None),
            ("draft_layers", 1),
            ("block_size", 4),
            ("num_depths", 3),
            ("ttt_steps", 2),
            ("eval_depth", 2),
        ),
    ),
}
STAMP = "stamp.json"


def get_budget(target: str, budget: str) -> HeadsBudget:
    from draftsmith.demo.target import DemoTargetError

    if (target, budget) not in BUDGETS:
        known = ", ".join(b for t, b in BUDGETS if t == target)
        raise DemoTargetError(f"unknown budget {budget!r} for the {target} target: expected one of {known}")
    return BUDGETS[target, budget]


def heads_root(built, budget_name: str) -> Path:
    return built.folder.parent / (built.folder.name.replace("demo-target-", "demo-heads-") + f"-{budget_name}")


def _stamp(target_fingerprint: str, budget: HeadsBudget, dtype) -> dict:
    """What the cached data depends on (the target's answers and states in its dtype); each trained
    artifact also keeps its own recipe."""
    keys = ("prompts", "max_new_tokens", "generate_batch", "max_length", "topk_logits")
    data = {k: getattr(budget, k) for k in keys} | {"dtype": str(dtype).removeprefix("torch.")}
    return {"target_fingerprint": target_fingerprint, "data": data, "format": 4}


def _trained_with(folder: Path, recipe) -> bool:
    """True when `folder` was trained with `recipe`, keys that do not change the weights aside (the
    run-control keys a resume may change too: output path, logging, the serve check...)."""
    from draftsmith.train.checkpoints import RUN_CONTROL_KEYS
    from draftsmith.train.recipe import recipe_dict

    try:
        saved = read_json(folder / "recipe.json", "recipe")
    except ValueError:
        return False
    want = recipe_dict(recipe)
    # a key the saved recipe lacks (added to the trainer since) was trained at its default
    defaults = {f.name: f.default for f in fields(recipe) if f.default is not MISSING}
    saved = {**{k: defaults[k] for k in want.keys() - saved.keys() if k in defaults}, **saved}
    return {k: v for k, v in saved.items() if k not in RUN_CONTROL_KEYS} == {
        k: v for k, v in want.items() if k not in RUN_CONTROL_KEYS
    }


def prepare_root(root: Path, target, budget: HeadsBudget, log=print) -> Path:
    """The cache folder for this target and budget (emptied when its stamp does not match)."""
    from draftsmith.heads.models import target_fingerprint

    stamp = _stamp(target_fingerprint(target), budget, target.dtype)
    if root.exists():
        try:
            old = read_json(root / STAMP, "demo heads stamp")
        except ValueError:
            old = None
        if old != stamp:
            log(f"{root}: made for another target build or budget; rebuilding")
            shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / STAMP, stamp)
    return root


def demo_data(ctx, budget: HeadsBudget, root: Path, log=print) -> Path:
    """The target's own answers to `budget.prompts` training prompts (resumes a partial run)."""
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.distill.data import SUMMARY
    from draftsmith.distill.generate import GenerateSettings
    from draftsmith.distill.generate_run import generate_dataset
    from draftsmith.distill.sources import load_source
    from draftsmith.distill.summary import describe_summary

    out = root / "data"
    if (out / SUMMARY).is_file():
        return out
    log(
        f"self-distillation data: the target answers {budget.prompts} training prompts (up to {budget.max_new_tokens} tokens)"
    )
    source = load_source(str(ctx.built.train_prompts), limit=budget.prompts)
    settings = GenerateSettings(
        max_new_tokens=budget.max_new_tokens, batch_size=budget.generate_batch, max_length=budget.max_length
    )
    template = resolve_chat_template("auto", ctx.tokenizer)
    summary = generate_dataset(
        ctx.target,
        ctx.tokenizer,
        source,
        out,
        settings,
        template=template,
        template_spec="auto",
        target_path=str(ctx.built.target),
        dtype=ctx.dtype,
        progress=ctx.progress,
        log=log,
    )
    log(describe_summary(summary))
    return out


def head_layers(ctx) -> list[int]:
    """The target layers every head of the demo reads: (2, L//2, L-3), as the recipes of a family set them."""
    from draftsmith.heads.layers import spread_layer_ids

    return spread_layer_ids(ctx.target.config.get_text_config().num_hidden_layers)


def demo_cache(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """One hidden-state cache of the demo data for every trainer: the heads' layers and the last
    (bf16), and the target's top-k logits (the draft distillation's teacher). Its manifest records
    the target's forward-only tokens/s, the yardstick of the trainers' own."""
    import torch

    from draftsmith.distill.data import DistillData
    from draftsmith.distill.hidden_cache import MANIFEST, cache_hidden_states

    out = root / "hidden"
    layers = head_layers(ctx) + [ctx.target.config.get_text_config().num_hidden_layers]
    if (out / MANIFEST).is_file():
        return out
    log(f"hidden-state cache: layers {layers} in bf16 and the top {budget.topk_logits} logits, one target forward")
    cache_hidden_states(
        ctx.target,
        DistillData(data),
        out,
        layers_spec=layers,
        dtype=torch.bfloat16,
        batch_size=budget.batch_size,
        topk=budget.topk_logits,
        target_path=str(ctx.built.target),
        progress=ctx.progress,
        log=log,
    )
    return out


def _train_once(ctx, root: Path, name: str, artifact: str, recipe, train, announce: str, log) -> Path:
    """Train into `root/name` once and reuse it while its saved recipe equals this one. The run
    goes to a hidden work folder (`recipe.out`), renamed into place when complete: nothing
    half-trained is ever reused. Returns the artifact folder (`root/name/artifact`)."""
    final, work = root / name, Path(recipe.out)
    if (final / artifact / "config.json").is_file() and _trained_with(final, recipe):
        return final / artifact
    shutil.rmtree(work, ignore_errors=True)
    log(announce)
    line = _summary_line(train(recipe, progress=ctx.progress))
    if line:
        log(line)
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    return final / artifact


def _summary_line(summary: dict) -> str | None:
    """The held-out evaluation of a finished run in one line: its simulated tau (or acceptance) and tokens/s."""
    ev = summary.get("eval") or {}
    rate = summary.get("train_tokens_per_second")
    speed = f", {rate:,.0f} training tokens/s" if rate else ""
    if "tau_simulated" in ev:
        return f"held-out simulated tau {ev['tau_simulated']:.2f} (counts the bonus token){speed}"
    if "acceptance" in ev:
        return f"held-out acceptance (T = 1) {ev['acceptance']:.3f}{speed}"
    return None


def demo_recipes(budget: HeadsBudget) -> dict[str, tuple]:
    """{recipe name: (its method, its file)} of every registered method with a recipe in the
    budget's family folder, in the registry's order."""
    from draftsmith.heads.registry import METHODS
    from draftsmith.train.recipe_files import recipes_root

    found = {}
    for method in METHODS.values():
        for name in method.recipe_files:
            path = recipes_root() / budget.family / f"{name}.yaml"
            if path.is_file():
                found[name] = (method, path)
                break
    return found


def demo_recipe(ctx, budget: HeadsBudget, name: str, data: Path, cache: Path | None, out: str):
    """The shipped recipe `name` of the budget's family with the demo's own data, cache, output,
    steps and batch (and the budget's overrides): (method, recipe)."""
    from dataclasses import fields as recipe_fields

    from draftsmith.train.recipe import load_recipe

    method, path = demo_recipes(budget)[name]
    recipe_class = method.part("recipe")
    base = load_recipe(recipe_class, path)
    keys = {f.name for f in recipe_fields(recipe_class)}
    steps = budget.max_steps or max(1, round(base.max_steps * budget.steps_scale))
    values = {k: v for k, v in budget.overrides if k in keys}
    for key in ("hidden_cache", "teacher_cache"):  # the demo's one cache serves every method that reads one
        if getattr(base, key, None) is not None:
            values[key] = None if cache is None else str(cache)
    if getattr(base, "aux_layers", None) is not None:
        values["aux_layers"] = head_layers(ctx)
    values |= {
        "target": str(ctx.built.target),
        "data": str(data),
        "out": out,
        "max_length": budget.max_length,
        "max_steps": steps,
        "eval_every": max(1, steps // budget.evals),
        "save_every": steps + 1,
        "batch_size": budget.batch_size,
        "device": ctx.device.type,
        "dtype": str(ctx.dtype).removeprefix("torch."),  # the demo's; heads train in fp32 under its autocast
    }
    return method, replace(base, **values)


def train_demo_drafter(ctx, name: str, log=print) -> Path:
    """The trained artifact of the demo recipe `name` (trained once on the demo data from the shared cache)."""
    import importlib

    budget, root, data, cache = ctx.distill_data()
    method, recipe = demo_recipe(ctx, budget, name, data, cache, str(root / f".{name}-training"))
    train = importlib.import_module(method.trainer).train
    announce = (
        f"{method.title}: recipes/{budget.family}/{name}.yaml, {recipe.max_steps} steps x {recipe.batch_size} rows"
    )
    return _train_once(ctx, root, name, method.run_folder, recipe, train, announce, log)


def learning_curve(folder: Path) -> list[dict]:
    """(step, simulated tau) of each held-out evaluation of the run whose artifact is `folder`."""
    import json

    points = []
    metrics = folder.parent / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if isinstance(row.get("eval"), dict) and "tau_simulated" in row["eval"]:
                points.append({"step": row["step"], "tau_simulated": row["eval"]["tau_simulated"]})
    return points


def training_speeds(root: Path) -> dict:
    """Each trainer's tokens/s and the target's forward-only tokens/s of the shared cache."""
    speeds = {}
    for name in (p.name for p in sorted(root.iterdir()) if (p / "training_summary.json").is_file()):
        try:
            speeds[name] = read_json(root / name / "training_summary.json", "summary").get("train_tokens_per_second")
        except ValueError:
            continue
    try:
        run = read_json(root / "hidden" / "manifest.json", "cache").get("last_run") or {}
        speeds["target-forward"] = run.get("forward_tokens_per_second")  # the cache pass: the target's forward alone
    except ValueError:
        pass
    return speeds
