"""`draftsmith demo`: the whole job on the embedded target, in one command.

    draftsmith demo                 # cpu preset: builds the target once (~15 min), then ~2-5 min
    draftsmith demo --quick         # micro preset, a smoke run in about a minute
    draftsmith demo --preset gpu --device cuda

  1. build or load the demo target (`draftsmith.train.demo_target`, cached);
  2. prepare every drafter method the toolkit has (training them, with small budgets, where
     they need it; the small draft is trained with the target, as in the classic baseline;
     Medusa heads on the target's own answers, `draftsmith.train.demo_heads`, cached);
  3. evaluate all of them on the same held-out prompts with `draftsmith.eval.evaluator`;
  4. print one table (method, alpha, acceptance rate, tau, speedup, OOV, KL) at greedy and one at T = 1 (a
     shorter pass), headed by how much the target's greedy answers loop (loops inflate acceptance), and
     write report.json, report.md and acceptance.png (acceptance by draft position) to the output folder.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from draftsmith.train.demo_card import cpu_decode_threads, greedy_repetition, repetition_line, stage_summary
from draftsmith.train.demo_heads import BUDGETS, demo_data, demo_distilled_draft, demo_eagle, demo_medusa, heads_root, prepare_root
from draftsmith.train.demo_heads import demo_dflash, demo_peagle
from draftsmith.train.demo_target import DemoTarget, DemoTargetError, ensure_demo_target, get_preset


@dataclass(frozen=True)
class DemoSettings:
    preset: str = "cpu"  # the target to build or load
    num_prompts: int = 24  # held-out prompts; 24 x 64 tokens keeps the eval to a few minutes on CPU
    max_new_tokens: int = 64  # prompts are <= ~190 tokens; the target was trained on 256
    num_draft_tokens: int = 3  # K = 3: a small draft's acceptance decays fast past position 3
    repeats: int = 3  # timed passes; speedup is their median
    temperature: float = 0.0  # greedy: acceptance is then a property of the models alone
    sampled_temperature: float | None = 1.0  # a second table at this T (None: none); sampling is how most serve
    sampled_repeats: int = 1  # its timed passes: it is there for acceptance, so one keeps the demo short
    seed: int = 0
    compile: bool | str = False  # static KV cache + torch.compile'd steps for the target and every drafter

    @property
    def fast_path(self) -> dict:
        """The decoder's fast-path options (`generate(..., static_cache=, compile=)`)."""
        return {"static_cache": True, "compile": self.compile} if self.compile else {}

    def __post_init__(self):
        for name in ("num_prompts", "max_new_tokens", "num_draft_tokens", "repeats", "sampled_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.sampled_temperature is not None and self.sampled_temperature <= 0:
            raise ValueError(f"sampled_temperature must be > 0 (or None for no sampled table), got {self.sampled_temperature}")

    @property
    def second_temperature(self) -> float | None:
        """The sampled table's T, or None when there is none (or it would repeat the first)."""
        return None if self.sampled_temperature in (None, self.temperature) else self.sampled_temperature


# --quick: the micro target (built in seconds) and a handful of short decodes. It checks that
# the pipeline runs, not what the numbers are: the micro target is nearly flat.
QUICK = DemoSettings(preset="micro", num_prompts=4, max_new_tokens=16, repeats=1)


@dataclass
class DemoContext:
    """What a method may use to prepare its drafter."""

    target: torch.nn.Module
    tokenizer: object
    built: DemoTarget
    device: torch.device
    dtype: torch.dtype
    settings: DemoSettings
    progress: bool = True
    log: Callable = print
    _medusa: object = None  # trained heads, shared by the chain and tree methods
    _heads_cache: tuple | None = None  # (budget, root, data): the self-distillation data, made once
    _eagle: object = None  # the trained EAGLE-3 head, shared by the chain and tree methods
    _dflash_folder: Path | None = None  # the trained DFlash head, for the report
    _peagle_folder: Path | None = None  # the trained P-EAGLE head, for the report

    def eagle_head(self):
        if self._eagle is None:
            from draftsmith.heads.eagle import load_eagle

            budget, root, data = self.distill_data()
            self._eagle = load_eagle(demo_eagle(self, budget, root, data, log=self.log), target=self.target, device=self.device, dtype=self.dtype)
        return self._eagle

    def distill_data(self):
        """The target's own answers (made once, cached): (budget, cache root, data folder)."""
        if self._heads_cache is None:
            budget = BUDGETS[self.settings.preset]
            root = prepare_root(self.built, self.target, budget, log=self.log)
            self._heads_cache = (budget, root, demo_data(self, budget, root, log=self.log))
        return self._heads_cache

    def medusa_heads(self):
        """Self-distillation data + Medusa-1 heads for this target (trained once, cached)."""
        if self._medusa is None:
            from draftsmith.heads.medusa import load_medusa

            budget, root, data = self.distill_data()
            folder = demo_medusa(self, budget, root, data, log=self.log)
            self._medusa = load_medusa(folder, target=self.target, device=self.device, dtype=self.dtype)
        return self._medusa


@dataclass(frozen=True)
class DemoMethod:
    name: str
    what: str  # one line for the report
    prepare: Callable[[DemoContext], object]  # -> a Drafter (may train first)


def _prompt_lookup(ctx: DemoContext):
    from draftsmith.eval.runtime.drafters import PromptLookupDrafter

    return PromptLookupDrafter(max_ngram=3)


def _small_draft(ctx: DemoContext):
    from draftsmith.eval.runtime.drafters import DraftModelDrafter
    from draftsmith.heads.models import check_vocab_compatible, load_causal_lm

    check_vocab_compatible(ctx.built.target, ctx.built.draft, target_tokenizer=ctx.tokenizer)
    draft = load_causal_lm(ctx.built.draft, device=ctx.device, dtype=ctx.dtype, role="draft")
    return DraftModelDrafter(draft, name="small-draft")


def _distilled_draft(ctx: DemoContext):
    from draftsmith.eval.runtime.drafters import DraftModelDrafter
    from draftsmith.heads.models import load_causal_lm

    budget, root, data = ctx.distill_data()
    folder = demo_distilled_draft(ctx, budget, root, data, log=ctx.log)
    draft = load_causal_lm(folder, device=ctx.device, dtype=ctx.dtype, role="draft")
    return DraftModelDrafter(draft, name="distilled-draft")


def _medusa_chain(ctx: DemoContext):
    from draftsmith.eval.runtime.drafters import MedusaDrafter

    layers = ctx.target.config.get_text_config().num_hidden_layers
    return MedusaDrafter(ctx.medusa_heads(), layers, name="medusa-chain")


MEDUSA_TREE_NODES = 16  # verify 17 tokens per call: cheap on any device for a target this size


def _medusa_tree(ctx: DemoContext):
    from draftsmith.eval.runtime.drafters import MedusaDrafter
    from draftsmith.eval.medusa_tree import build_medusa_tree

    heads = ctx.medusa_heads()
    tree = build_medusa_tree(heads.config.head_accuracies, MEDUSA_TREE_NODES)
    layers = ctx.target.config.get_text_config().num_hidden_layers
    return MedusaDrafter(heads, layers, tree=tree, name="medusa-tree")


EAGLE_TREE = {"depth": 3, "top_k": 4, "total_tokens": 16}  # same node budget as the Medusa tree


def _eagle_chain(ctx: DemoContext):
    from draftsmith.eval.runtime.eagle import EagleDrafter

    return EagleDrafter(ctx.eagle_head(), name="eagle3-chain")


def _eagle_tree(ctx: DemoContext):
    from draftsmith.eval.runtime.eagle import EagleDrafter

    return EagleDrafter(ctx.eagle_head(), tree=EAGLE_TREE, name="eagle3-tree")


def _dflash(ctx: DemoContext):
    from draftsmith.eval.runtime.dflash import DFlashDrafter
    from draftsmith.heads.dflash_formats import load_dflash

    budget, root, data = ctx.distill_data()
    folder = demo_dflash(ctx, budget, root, data, log=ctx.log)
    ctx._dflash_folder = folder
    return DFlashDrafter(load_dflash(folder, target=ctx.target, device=ctx.device, dtype=ctx.dtype), name="dflash")


def _peagle(ctx: DemoContext):
    from draftsmith.eval.runtime.peagle import PEagleDrafter
    from draftsmith.heads.eagle import load_eagle

    budget, root, data = ctx.distill_data()
    folder = demo_peagle(ctx, budget, root, data, log=ctx.log)
    ctx._peagle_folder = folder
    return PEagleDrafter(load_eagle(folder, target=ctx.target, device=ctx.device, dtype=ctx.dtype), name="peagle")


# Every drafter method of the toolkit, in report order (each trained with a small demo budget).
METHODS: list[DemoMethod] = [
    DemoMethod("prompt-lookup", "n-gram lookup in the context (max n = 3); no model, no training", _prompt_lookup),
    DemoMethod("small-draft", "independent small Llama trained on the same data (built with the target)", _small_draft),
    DemoMethod("distilled-draft", "the small draft distilled from the target (KL + TV) on the target's own answers", _distilled_draft),
    DemoMethod("medusa-chain", "Medusa-1 heads trained on the target's own answers; top-1 of each head", _medusa_chain),
    DemoMethod("medusa-tree", f"the same heads, a {MEDUSA_TREE_NODES}-node tree built from their measured top-k accuracies", _medusa_tree),
    DemoMethod("eagle3-chain", "EAGLE-3 head (training-time test, reduced vocabulary) on the target's own answers; top-1 chain", _eagle_chain),
    DemoMethod("eagle3-tree", "the same head, EAGLE-2 dynamic tree (depth 3, top-k 4, 16 nodes)", _eagle_tree),
    DemoMethod("dflash", "DFlash block drafter (one forward drafts all K tokens) on the target's own answers", _dflash),
    DemoMethod("peagle", "P-EAGLE head (mask placeholders: one forward drafts all K depths) on the target's own answers", _peagle),
]

TABLE_NOTE = """\
alpha: conditional acceptance P(draft i accepted | drafts 1..i-1 accepted), pooled over positions.
acc. rate: the share of drafted tokens the target accepted (accepted / proposed; a tree proposes all its nodes).
tau: tokens per target call, counting the bonus token (target-only = 1.00; at most K + 1).
speedup: tokens/s over target-only tokens/s in the same timed pass (median over passes);
  on a CPU a tiny draft costs about half a target step, so speculation may well lose there.
OOV: target probability outside the draft's vocabulary (EAGLE-3's reduced vocabulary; else 0).
KL: KL(target || draft) on the draft's vocabulary, raw distributions along the decoded text (- : none).
Every row decodes exactly what the target alone would produce (lossless)."""


def run_demo(
    settings: DemoSettings,
    *,
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    device: str | None = "auto",
    dtype: str | None = "auto",
    force_build: bool = False,
    progress: bool = True,
    log=print,
) -> tuple[dict, Path]:
    """Build/load, prepare, evaluate, report. Returns (report, output folder)."""
    from draftsmith.eval.evaluator import EvalSettings, describe_target, evaluate, load_prompts
    from draftsmith.eval.report import compact_table, plot_acceptance, render_markdown, write_atomic, write_report
    from draftsmith.heads.models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    started = time.perf_counter()
    preset = get_preset(settings.preset)  # unknown preset: a clear error before any work
    device_t = resolve_device(device)
    dtype_t = resolve_dtype(dtype, device_t)
    out = Path(out) if out else Path("runs") / f"demo-{preset.name}"
    if out.exists() and not out.is_dir():
        raise DemoTargetError(f"--out {str(out)!r} exists and is not a folder")

    t = time.perf_counter()
    built = ensure_demo_target(preset, cache_dir=cache_dir, force=force_build, device=device_t, progress=progress, log=log)
    build_s = time.perf_counter() - t
    log(stage_summary(built.manifest))

    tokenizer = load_tokenizer(built.target)
    target = load_causal_lm(built.target, device=device_t, dtype=dtype_t, role="target")
    ctx = DemoContext(target, tokenizer, built, device_t, dtype_t, settings, progress=progress, log=log)
    drafters, prepare_s = {}, {}
    for method in METHODS:
        t = time.perf_counter()
        drafters[method.name] = method.prepare(ctx)
        prepare_s[method.name] = time.perf_counter() - t

    prompts = load_prompts(built.heldout_prompts, tokenizer, limit=settings.num_prompts)
    eval_settings = EvalSettings(
        num_draft_tokens=settings.num_draft_tokens,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        repeats=settings.repeats,
        seed=settings.seed,
        **settings.fast_path,
    )
    t = time.perf_counter()
    eos = tokenizer.eos_token_id
    with cpu_decode_threads(device_t):
        # The target alone, greedy, on the demo's prompts: how much of what is drafted is a loop.
        repetition = greedy_repetition(target, prompts, settings.max_new_tokens, eos)
        report = evaluate(target, drafters, prompts, eval_settings, eos_token_id=eos, progress=progress)
        sampled = None
        if settings.second_temperature is not None:
            sampled_settings = replace(eval_settings, temperature=settings.second_temperature, repeats=settings.sampled_repeats)
            sampled = evaluate(target, drafters, prompts, sampled_settings, eos_token_id=eos, progress=progress)
    eval_s = time.perf_counter() - t

    report["target"] = describe_target(built.target, target, device_t, dtype_t)
    report["drafts"] = {"small-draft": str(built.draft)}
    if ctx._medusa is not None:
        report["drafts"]["medusa"] = str(heads_root(built) / "medusa" / "heads")
    if ctx._heads_cache is not None:
        report["drafts"]["distilled-draft"] = str(heads_root(built) / "distilled-draft" / "draft")
    if ctx._eagle is not None:
        report["drafts"]["eagle3"] = str(heads_root(built) / "eagle3" / "head")
    if ctx._dflash_folder is not None:
        report["drafts"]["dflash"] = str(ctx._dflash_folder)
    if ctx._peagle_folder is not None:
        report["drafts"]["peagle"] = str(ctx._peagle_folder)
    report["prompts_file"] = str(built.heldout_prompts)
    report["demo"] = {
        "settings": asdict(settings),
        "methods": {m.name: m.what for m in METHODS},
        "demo_target": {
            "folder": str(built.folder),
            "preset": built.manifest["preset"],
            "models": {k: {kk: v[kk] for kk in ("parameters", "tokens_seen", "final_train_loss", "heldout_perplexity")} for k, v in built.manifest["models"].items()},
            "quality": {k: v for k, v in built.manifest["quality"].items() if k != "samples"},
        },
        "target_repetition": repetition,
        "sampled": None if sampled is None else {"mode": sampled["mode"], "repeats": settings.sampled_repeats, "methods": sampled["methods"]},
        "seconds": {"build_or_load": build_s, "prepare": prepare_s, "evaluate": eval_s, "total": time.perf_counter() - started},
        "torch_version": torch.__version__,
    }
    json_path, md_path = write_report(report, out)
    png_path = plot_acceptance(report, out / "acceptance.png")
    write_atomic(md_path, render_markdown(report) + demo_markdown(report))
    log("")
    log(f"draftsmith demo - {preset.name} target ({report['target']['parameters'] / 1e6:.2f}M params), {report['mode']}, "
        f"K = {settings.num_draft_tokens}, {len(prompts)} held-out prompts x {settings.max_new_tokens} new tokens")
    log(f"the target's {repetition_line(repetition)}: loops inflate every drafter's acceptance, prompt lookup's most")
    log(compact_table(report))
    if sampled is not None:
        log(f"\n{sampled['mode']}, the same prompts, {settings.sampled_repeats} timed pass(es):")
        log(compact_table(sampled))
    log(TABLE_NOTE)
    log(f"\nwrote {json_path}, {md_path} and {png_path} ({report['demo']['seconds']['total']:.0f} s in all)")
    return report, out


def demo_markdown(report: dict) -> str:
    """The demo's own sections of report.md: methods, the plot, and the target it ran on."""
    from draftsmith.eval.report import compact_table

    demo = report["demo"]
    target = demo["demo_target"]
    q = target["quality"]
    lines = ["## Methods", ""]
    lines += [f"- `{name}`: {what}" for name, what in demo["methods"].items()]
    lines += ["", f"The target's {repetition_line(demo['target_repetition'])}.", ""]
    if demo.get("sampled"):
        sampled = demo["sampled"]
        lines += [f"## The same methods at {sampled['mode']} ({sampled['repeats']} timed pass(es))", "", compact_table(sampled), ""]
    lines += ["## Acceptance by draft position (plot)", "", "![acceptance by draft position](acceptance.png)", ""]
    lines += [
        "## Demo target",
        "",
        f"`{target['folder']}` (preset `{target['preset']['name']}`; see its MODEL_CARD.md).",
        "",
        "| model | parameters | tokens seen | final train loss | held-out perplexity |",
        "|---|---|---|---|---|",
    ]
    for role, m in target["models"].items():
        lines.append(f"| {role} | {m['parameters'] / 1e6:.2f}M | {m['tokens_seen']:,} | {m['final_train_loss']:.3f} | {m['heldout_perplexity']:.2f} |")
    lines += [
        "",
        f"Build-time acceptance checks (K = {target['preset']['quality_k']}): self-draft alpha "
        f"{q['self_draft_greedy']['alpha']:.3f} (must be 1.0), small draft {q['small_draft_greedy']['alpha']:.3f} "
        f"greedy, {q['small_draft_t1']['alpha']:.3f} at T = 1.",
        "",
        "Seconds: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {sum(v.values()):.0f}" for k, v in demo["seconds"].items()),
        "",
    ]
    return "\n".join(lines)


def with_overrides(base: DemoSettings, **overrides) -> DemoSettings:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
