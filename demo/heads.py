"""What `draftsmith demo` trains on top of the demo target, cached beside it.

  1. self-distillation data: the target's own answers to its training prompts under its chat
     template (`draftsmith.distill.generate`, resumable shards, loss masks on the answers);
  2. one hidden-state cache of that data (`draftsmith.distill.hidden_cache`): the layers every
     head reads (EAGLE-3's (2, L//2, L-3) and the last) and the target's top-k logits, paid once
     and shared by every trainer below;
  3. Medusa-1 heads (`train/medusa.py`), an EAGLE-3 head with a reduced draft vocabulary
     (`train/eagle.py`), a DFlash block drafter (`train/dflash.py`), a P-EAGLE head
     (`train/peagle.py`), and a layer-truncated copy of the target distilled DistillSpec-style
     (`train/draft.py`); `recipes/smollm2/*.yaml` hold the same settings for the command line.

They live in `<cache>/demo-heads-<target>-<budget>/` with a stamp recording the target's
fingerprint and the data budget; a stamp that does not match means the folder is rebuilt, never
reused. A trained artifact is reused only when its saved recipe equals the one the demo would run.
"""

from __future__ import annotations

import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from draftsmith.distill.data import read_json, write_json_atomic


@dataclass(frozen=True)
class HeadsBudget:
    prompts: int  # training prompts answered by the target
    max_new_tokens: int  # per answer
    generate_batch: int
    max_length: int  # prompt + answer tokens trained
    batch_size: int  # rows per training step, every head
    medusa_steps: int
    num_heads: int
    draft_steps: int  # distillation of the truncated target
    draft_layers: int  # layers kept by the truncated draft
    eagle_steps: int  # EAGLE-3 head
    ttt_steps: int  # EAGLE-3 training-time test unroll
    draft_vocab: int | None  # reduced vocabulary of EAGLE-3, DFlash and P-EAGLE (None = the target's)
    dflash_steps: int
    block_size: int  # DFlash slots per block: block_size - 1 drafts per forward
    peagle_steps: int
    peagle_depths: int
    evals: int = 1  # held-out evaluations per training run (their simulated tau is the learning curve)
    topk_logits: int = 64  # the draft distillation's teacher: top k + the tail's mass


# Sized for 2 CPU cores (see README "draftsmith demo" for the measured times); `long` shows how
# acceptance grows with the tokens trained.
BUDGETS = {
    ("smollm2", "default"): HeadsBudget(
        prompts=512,
        max_new_tokens=128,
        generate_batch=16,
        max_length=512,
        batch_size=8,
        medusa_steps=30,
        num_heads=3,
        draft_steps=30,
        draft_layers=4,
        eagle_steps=60,
        ttt_steps=3,
        draft_vocab=8192,
        dflash_steps=120,
        block_size=8,
        peagle_steps=40,
        peagle_depths=6,
    ),
    ("smollm2", "long"): HeadsBudget(
        prompts=1024,
        max_new_tokens=128,
        generate_batch=16,
        max_length=512,
        batch_size=8,
        medusa_steps=120,
        num_heads=3,
        draft_steps=120,
        draft_layers=4,
        eagle_steps=480,
        ttt_steps=3,
        draft_vocab=8192,
        dflash_steps=960,
        block_size=8,
        peagle_steps=640,
        peagle_depths=6,
        evals=5,
    ),
    ("micro", "default"): HeadsBudget(
        prompts=32,
        max_new_tokens=16,
        generate_batch=8,
        max_length=512,
        batch_size=4,
        medusa_steps=10,
        num_heads=3,
        draft_steps=5,
        draft_layers=1,
        eagle_steps=10,
        ttt_steps=2,
        draft_vocab=None,
        dflash_steps=10,
        block_size=4,
        peagle_steps=10,
        peagle_depths=3,
        topk_logits=8,
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


def _stamp(target_fingerprint: str, budget: HeadsBudget) -> dict:
    """What the cached data depends on; each trained artifact also keeps its own recipe."""
    keys = ("prompts", "max_new_tokens", "generate_batch", "max_length", "topk_logits")
    return {"target_fingerprint": target_fingerprint, "data": {k: getattr(budget, k) for k in keys}, "format": 3}


def _trained_with(folder: Path, recipe) -> bool:
    """True when `folder` was trained with `recipe`, keys that do not change the weights aside (the
    run-control keys a resume may change too: output path, logging, the serve check...)."""
    from draftsmith.train.recipe import recipe_dict
    from draftsmith.train.run import RUN_CONTROL_KEYS

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

    stamp = _stamp(target_fingerprint(target), budget)
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
    from draftsmith.distill.generate import GenerateSettings, generate_dataset
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
    """The target layers every head of the demo reads: EAGLE-3's (2, L//2, L-3)."""
    from draftsmith.heads.eagle.model import default_aux_layer_ids

    return default_aux_layer_ids(ctx.target.config.get_text_config().num_hidden_layers)


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


def _train_once(ctx, root: Path, name: str, artifact: str, recipe_for, train, announce: str, report, log) -> Path:
    """Train into `root/name` once and reuse it while its saved recipe equals this one. The run
    goes to a hidden work folder, renamed into place when complete: nothing half-trained is
    ever reused. Returns the artifact folder (`root/name/artifact`)."""
    final, work = root / name, root / f".{name}-training"
    recipe = recipe_for(str(work))
    if (final / artifact / "config.json").is_file() and _trained_with(final, recipe):
        return final / artifact
    shutil.rmtree(work, ignore_errors=True)
    log(announce)
    line = report(train(recipe, progress=ctx.progress))
    if line:
        log(line)
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    return final / artifact


def _run_fields(ctx, budget: HeadsBudget, data: Path, out, steps: int) -> dict:
    """The recipe fields every demo training shares: the demo target and data, `steps` steps of
    `budget.batch_size` rows with `budget.evals` held-out evaluations and no intermediate
    checkpoint, fp32 weights (bf16 autocast stays each trainer's choice)."""
    return {
        "target": str(ctx.built.target),
        "data": str(data),
        "out": out,
        "max_length": budget.max_length,
        "max_steps": steps,
        "eval_every": max(1, steps // budget.evals),
        "save_every": steps + 1,
        "batch_size": budget.batch_size,
        "device": ctx.device.type,
        "dtype": "float32" if ctx.device.type == "cpu" else "auto",
    }


def _cache(cache: Path | None) -> str | None:
    return None if cache is None else str(cache)  # None: the trainer runs the target online


def _head_fields(ctx, budget: HeadsBudget, cache: Path | None) -> dict:
    """The keys the heads over the target's states share: the cached layers, the reduced vocabulary,
    lr 1e-3 (small heads in short runs)."""
    return {
        "aux_layers": head_layers(ctx),
        "draft_vocab_size": budget.draft_vocab,
        "hidden_cache": _cache(cache),
        "lr": 1e-3,
    }


def _top1_report(what: str, key: str):
    """The summary line of a head trainer's held-out evaluation: `what` per entry of `key`, tau, tokens/s."""

    def report(summary):
        ev = summary["eval"]
        rate = summary.get("train_tokens_per_second")
        speed = f", {rate:,.0f} training tokens/s" if rate else ""
        return ev and f"{what} {[round(a, 3) for a in ev[key]]}, simulated tau {ev['tau_simulated']:.2f}{speed}"

    return report


def medusa_recipe(ctx, budget: HeadsBudget, data: Path, cache: Path, out: str):
    from draftsmith.train.medusa import MedusaRecipe

    # the target's frozen lm_head: a 49k-row head per Medusa head would be most of the drafting cost
    return MedusaRecipe(
        **_run_fields(ctx, budget, data, out, budget.medusa_steps),
        num_heads=budget.num_heads,
        share_lm_head=True,
        hidden_cache=_cache(cache),
    )


def draft_recipe(ctx, budget: HeadsBudget, data: Path, cache: Path, out: str):
    from draftsmith.train.draft import DraftRecipe

    return DraftRecipe(
        **_run_fields(ctx, budget, data, out, budget.draft_steps),
        draft_init="truncate",
        draft_layers=budget.draft_layers,
        loss="kl_tv",
        lr=1e-3,
        teacher_cache=_cache(cache),
        num_draft_tokens=ctx.settings.num_draft_tokens,
    )


def eagle_recipe(ctx, budget: HeadsBudget, data: Path, cache: Path, out: str):
    from draftsmith.train.eagle import EagleRecipe

    return EagleRecipe(
        **_run_fields(ctx, budget, data, out, budget.eagle_steps),
        **_head_fields(ctx, budget, cache),
        version="eagle3",
        ttt_steps=budget.ttt_steps,
        eval_depth=ctx.settings.num_draft_tokens,
    )


def dflash_recipe(ctx, budget: HeadsBudget, data: Path, cache: Path, out: str):
    from draftsmith.train.dflash import DFlashRecipe

    return DFlashRecipe(
        **_run_fields(ctx, budget, data, out, budget.dflash_steps),
        **_head_fields(ctx, budget, cache),
        num_layers=1,
        block_size=budget.block_size,
        max_anchors=64,
    )


def peagle_recipe(ctx, budget: HeadsBudget, data: Path, cache: Path, out: str):
    from draftsmith.train.peagle import PEagleRecipe

    return PEagleRecipe(
        **_run_fields(ctx, budget, data, out, budget.peagle_steps),
        **_head_fields(ctx, budget, cache),
        num_depths=budget.peagle_depths,
        max_anchors=128,
    )


def _distilled_report(summary):
    ev, init = summary["eval"], summary["initial"]
    return ev and init and f"held-out acceptance (T = 1) {init['acceptance']:.3f} -> {ev['acceptance']:.3f}"


# name: (trainer module, artifact folder, recipe builder, the announcement, the summary line)
TRAINED = {
    "medusa": (
        "medusa",
        "heads",
        medusa_recipe,
        lambda b: f"Medusa-1: {b.num_heads} heads over the target's lm_head, {b.medusa_steps} steps",
        _top1_report("Medusa heads: top-1 per head", "top1"),
    ),
    "distilled-draft": (
        "draft",
        "draft",
        draft_recipe,
        lambda b: f"draft distillation: the target's first "
        f"{b.draft_layers} layers, KL+TV from the top-{b.topk_logits} teacher, {b.draft_steps} steps",
        _distilled_report,
    ),
    "eagle3": (
        "eagle",
        "head",
        eagle_recipe,
        lambda b: f"EAGLE-3: training-time test over {b.ttt_steps} steps, "
        f"draft vocabulary {b.draft_vocab}, {b.eagle_steps} steps",
        _top1_report("EAGLE-3 head: top-1 per step", "top1_per_step"),
    ),
    "dflash": (
        "dflash",
        "head",
        dflash_recipe,
        lambda b: f"DFlash: blocks of {b.block_size} slots "
        f"({b.block_size - 1} drafts per forward), {b.dflash_steps} steps",
        _top1_report("DFlash head: top-1 per slot", "top1_per_slot"),
    ),
    "peagle": (
        "peagle",
        "head",
        peagle_recipe,
        lambda b: f"P-EAGLE: {b.peagle_depths} depths per forward, {b.peagle_steps} steps",
        _top1_report("P-EAGLE head: top-1 per depth", "top1_per_depth"),
    ),
}


def train_demo_drafter(ctx, name: str, log=print) -> Path:
    """The trained artifact `name` of TRAINED (trained once on the demo data from the shared cache)."""
    import importlib

    module, artifact, recipe_builder, announce, report = TRAINED[name]
    budget, root, data, cache = ctx.distill_data()
    train = importlib.import_module(f"draftsmith.train.{module}").train

    def recipe_for(out):
        return recipe_builder(ctx, budget, data, cache, out)

    return _train_once(ctx, root, name, artifact, recipe_for, train, announce(budget), report, log)


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
    for name in TRAINED:
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
