"""What `draftsmith demo` trains on top of the demo target, cached beside it.

  1. self-distillation data: the target's own greedy answers to its training prompts
     (`draftsmith.distill.generate`, resumable shards);
  2. Medusa-1 heads trained on that data with `train/medusa.py`'s loop (`recipes/demo/medusa.yaml`
     holds the same settings for the command-line route);
  3. the demo's small draft distilled on the same data with `train/draft.py`'s loop (KL + TV
     hybrid against the target's distributions; `recipes/demo/draft.yaml`);
  4. an EAGLE-3 head trained with `train/eagle.py`'s loop (`recipes/demo/eagle3.yaml`);
  5. a DFlash block drafter trained with `train/dflash.py`'s loop (`recipes/demo/dflash.yaml`);
  6. a P-EAGLE head trained with `train/peagle.py`'s loop (`recipes/demo/peagle.yaml`).

They live in `<cache>/demo-heads-<preset>/` with a stamp recording the target's fingerprint and
the data budget; a stamp that does not match (another target build, another budget) means the
folder is rebuilt, never reused. A trained artifact is reused only when its saved recipe
equals the one the demo would run now.
"""

from __future__ import annotations


import shutil
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from draftsmith.distill.data import read_json, write_json_atomic


@dataclass(frozen=True)
class HeadsBudget:
    prompts: int  # training prompts answered by the target
    max_new_tokens: int  # per answer
    generate_batch: int
    medusa_steps: int
    medusa_batch: int
    num_heads: int
    max_length: int  # the demo target was trained on 256-token windows
    draft_steps: int  # distillation of the small draft
    eagle_steps: int  # EAGLE-3 head
    eagle_draft_vocab: int | None  # reduced draft vocabulary (None = the target's)
    dflash_steps: int  # DFlash block drafter (same data, same reduced vocabulary)
    peagle_steps: int  # P-EAGLE head (same data, same reduced vocabulary)


BUDGETS = {
    "cpu": HeadsBudget(prompts=1024, max_new_tokens=128, generate_batch=16, medusa_steps=400, medusa_batch=8, num_heads=4, max_length=256, draft_steps=200, eagle_steps=400, eagle_draft_vocab=1024, dflash_steps=400, peagle_steps=400),
    "gpu": HeadsBudget(prompts=2000, max_new_tokens=192, generate_batch=64, medusa_steps=1000, medusa_batch=16, num_heads=4, max_length=512, draft_steps=1000, eagle_steps=1000, eagle_draft_vocab=2048, dflash_steps=1000, peagle_steps=1000),
    "micro": HeadsBudget(prompts=32, max_new_tokens=24, generate_batch=8, medusa_steps=20, medusa_batch=4, num_heads=3, max_length=128, draft_steps=10, eagle_steps=10, eagle_draft_vocab=None, dflash_steps=10, peagle_steps=10),
}
STAMP = "stamp.json"


def heads_root(built) -> Path:
    return built.folder.parent / built.folder.name.replace("demo-target-", "demo-heads-")


def _stamp(built, target_fingerprint: str, budget: HeadsBudget) -> dict:
    """What the cached data depends on; each trained artifact also keeps its own recipe."""
    data = {k: v for k, v in asdict(budget).items() if k in ("prompts", "max_new_tokens", "generate_batch", "max_length")}
    return {"target_fingerprint": target_fingerprint, "data": data, "format": 2}


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


def prepare_root(built, target, budget: HeadsBudget, log=print) -> Path:
    """The cache folder for this target and budget (emptied when its stamp does not match)."""
    from draftsmith.heads.models import target_fingerprint

    root = heads_root(built)
    stamp = _stamp(built, target_fingerprint(target), budget)
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
    from draftsmith.distill.data import SUMMARY
    from draftsmith.distill.generate import GenerateSettings, generate_dataset
    from draftsmith.distill.summary import describe_summary
    from draftsmith.distill.sources import load_source

    out = root / "data"
    if (out / SUMMARY).is_file():
        return out
    log(f"self-distillation data: the target answers {budget.prompts} training prompts ({budget.max_new_tokens} tokens each)")
    source = load_source(str(ctx.built.train_prompts), limit=budget.prompts)
    settings = GenerateSettings(max_new_tokens=budget.max_new_tokens, batch_size=budget.generate_batch, max_length=budget.max_length)
    summary = generate_dataset(
        ctx.target, ctx.tokenizer, source, out, settings, template=None, template_spec="none",
        target_path=str(ctx.built.target), dtype=ctx.dtype, progress=ctx.progress, log=log,
    )  # fmt: skip
    log(describe_summary(summary))
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


def _run_fields(ctx, data: Path, out, max_length: int, steps: int) -> dict:
    """The recipe fields every demo training shares: the demo target and data, `steps` steps with
    one evaluation at the end and no intermediate checkpoint, fp32 on CPU."""
    return {
        "target": str(ctx.built.target), "data": str(data), "out": out, "max_length": max_length,
        "max_steps": steps, "eval_every": steps, "save_every": steps + 1,
        "device": ctx.device.type, "dtype": "float32" if ctx.device.type == "cpu" else "auto",
    }  # fmt: skip


def _top1_report(what: str, key: str):
    """The summary line of a head trainer's held-out evaluation: `what` per entry of `key`, tau."""

    def report(summary):
        ev = summary["eval"]
        return ev and f"{what} {[round(a, 3) for a in ev[key]]}, simulated tau {ev['tau_simulated']:.2f}"

    return report


def demo_medusa(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """Medusa-1 heads trained on the demo data; returns the heads folder."""
    from draftsmith.train.medusa import MedusaRecipe, train

    def recipe_for(out):
        return MedusaRecipe(
            **_run_fields(ctx, data, out, budget.max_length, budget.medusa_steps),
            num_heads=budget.num_heads, batch_size=budget.medusa_batch,
        )  # fmt: skip

    report = _top1_report("Medusa heads: top-1 per head", "top1")
    announce = f"Medusa-1: {budget.num_heads} heads, {budget.medusa_steps} steps of {budget.medusa_batch} rows"
    return _train_once(ctx, root, "medusa", "heads", recipe_for, train, announce, report, log)


def demo_distilled_draft(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """The demo's independent small draft, distilled from the target on its own answers."""
    from draftsmith.train.draft import DraftRecipe, train

    def recipe_for(out):
        return DraftRecipe(
            **_run_fields(ctx, data, out, budget.max_length, budget.draft_steps),
            draft_init="checkpoint", draft_path=str(ctx.built.draft), loss="kl_tv", lr=1e-3, batch_size=8,
            num_draft_tokens=ctx.settings.num_draft_tokens,
        )  # fmt: skip

    def report(summary):
        ev, init = summary["eval"], summary["initial"]
        return ev and init and f"held-out acceptance (T = 1) {init['acceptance']:.3f} -> {ev['acceptance']:.3f}"

    announce = f"draft distillation: the small draft, KL+TV to the target, {budget.draft_steps} steps of 8 rows"
    return _train_once(ctx, root, "distilled-draft", "draft", recipe_for, train, announce, report, log)


def eagle_recipe(ctx, budget: HeadsBudget, data: Path, out: str, steps: int):
    """The demo's EAGLE-3 recipe: training-time test over 4 steps, reduced vocabulary, 8 rows."""
    from draftsmith.train.eagle import EagleRecipe

    return EagleRecipe(
        **_run_fields(ctx, data, out, budget.max_length, steps), version="eagle3",
        draft_vocab_size=budget.eagle_draft_vocab, ttt_steps=4, eval_depth=4, lr=1e-3, batch_size=8,
    )  # fmt: skip


def dflash_recipe(ctx, budget: HeadsBudget, data: Path, out: str, steps: int):
    """The demo's DFlash recipe: one block of K + 1 slots drafts the demo's K tokens."""
    from draftsmith.train.dflash import DFlashRecipe

    return DFlashRecipe(
        **_run_fields(ctx, data, out, budget.max_length, steps), **_one_pass_fields(ctx, budget),
        num_layers=1, block_size=ctx.settings.num_draft_tokens + 1, max_anchors=32,
    )  # fmt: skip


def peagle_recipe(ctx, budget: HeadsBudget, data: Path, out: str, steps: int):
    """The demo's P-EAGLE recipe: one forward drafts the demo's K tokens (K depths)."""
    from draftsmith.train.peagle import PEagleRecipe

    return PEagleRecipe(
        **_run_fields(ctx, data, out, budget.max_length, steps), **_one_pass_fields(ctx, budget),
        num_depths=ctx.settings.num_draft_tokens, max_anchors=128,
    )  # fmt: skip


def demo_eagle(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """An EAGLE-3 head trained on the demo data (training-time test, reduced vocabulary)."""
    from draftsmith.train.eagle import train

    def recipe_for(out):
        return eagle_recipe(ctx, budget, data, out, budget.eagle_steps)

    report = _top1_report("EAGLE-3 head: top-1 per draft step", "top1_per_step")

    announce = f"EAGLE-3: training-time test over 4 steps, {budget.eagle_steps} steps of 8 rows"
    return _train_once(ctx, root, "eagle3", "head", recipe_for, train, announce, report, log)


def _one_pass_fields(ctx, budget: HeadsBudget) -> dict:
    """The recipe fields of the demo's heads that draft every position in one forward (DFlash,
    P-EAGLE): the target's last three layers above the embeddings (all of a tinier target's),
    EAGLE-3's reduced vocabulary, lr 1e-3 (small heads on a small target) on 8 rows."""
    layers = ctx.target.config.get_text_config().num_hidden_layers
    aux = list(range(1, layers))[-3:] or None
    return {"aux_layers": aux, "draft_vocab_size": budget.eagle_draft_vocab, "lr": 1e-3, "batch_size": 8}


def demo_dflash(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """A DFlash block drafter trained on the demo data: one block of K + 1 slots drafts the
    demo's K tokens in one forward."""
    from draftsmith.train.dflash import train

    block = ctx.settings.num_draft_tokens + 1

    def recipe_for(out):
        return dflash_recipe(ctx, budget, data, out, budget.dflash_steps)

    report = _top1_report("DFlash head: top-1 per slot", "top1_per_slot")

    announce = f"DFlash: blocks of {block} slots ({block - 1} drafts per forward), {budget.dflash_steps} steps of 8 rows"
    return _train_once(ctx, root, "dflash", "head", recipe_for, train, announce, report, log)


def demo_peagle(ctx, budget: HeadsBudget, root: Path, data: Path, log=print) -> Path:
    """A P-EAGLE head trained on the demo data: one forward drafts the demo's K tokens (K depths)."""
    from draftsmith.train.peagle import train

    depths = ctx.settings.num_draft_tokens

    def recipe_for(out):
        return peagle_recipe(ctx, budget, data, out, budget.peagle_steps)

    report = _top1_report("P-EAGLE head: top-1 per depth", "top1_per_depth")

    announce = f"P-EAGLE: {depths} depths per forward (COD sampling), {budget.peagle_steps} steps of 8 rows"
    return _train_once(ctx, root, "peagle", "head", recipe_for, train, announce, report, log)
