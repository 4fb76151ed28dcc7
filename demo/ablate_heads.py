"""Which divergence trains the best parallel head? A loss ablation on the demo target.

    python scripts/ablate_heads.py                              # the default head, 6 losses x 2 seeds
    python scripts/ablate_heads.py --method NAME --losses soft_ce,lk_hybrid --steps 50

    from draftsmith.demo.ablate_heads import HeadAblationSettings, head_recipes, run_head_ablation
    head_recipes("smollm2")                                     # the NAMEs it takes
    run_head_ablation(HeadAblationSettings(steps=100))

`method` names one of the demo family's shipped recipes whose trainer takes any divergence of
`distill.losses.DIVERGENCES` as its `loss` (`head_recipes`; by default the first of them). Every
head is the demo's recipe for its method (`demo/heads.py`: same data, reduced vocabulary, lr,
batch of 8 rows), with only `loss` and `seed` changed and the same budget (`steps`); the seed
moves the head's initialisation, the batch order and the sampled positions. Then every head is
evaluated by the evaluator on the demo's held-out prompts, greedy, at the head's natural K (what
its simulated tau assumes: the most the trained drafter proposes per target call when it bounds
that, else the recipe's `eval_depth`), all heads interleaved with target-only in one run. Per
loss, the table gives the mean over the seeds and the spread (min-max) of alpha, tau (counting
the bonus token), speedup vs target-only and the trainer's held-out simulated tau. Writes
heads_ablation.md and heads_ablation.json to `out`.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import cache
from pathlib import Path

from draftsmith.distill.losses import DIVERGENCES

DEFAULT_LOSSES = "soft_ce,forward_kl,tv,kl_tv,nla,lk_hybrid"
METRICS = ("alpha", "tau", "speedup", "tau_simulated")  # the first three from the evaluator, the last from training
PROBE_K = 64  # a K no one-pass head drafts: a drafter proposing fewer at it bounds its proposals


@cache
def head_recipes(target: str) -> tuple[str, ...]:
    """The shipped recipes of the demo `target`'s family (`demo.heads.demo_recipes`) this ablation
    takes, sorted: those whose trainer's `loss` defaults to a divergence of DIVERGENCES and accepts
    every one of them."""
    from draftsmith.demo.heads import demo_recipes, get_budget
    from draftsmith.train.recipe import load_recipe

    found = []
    for name, (method, path) in demo_recipes(get_budget(target, "default")).items():
        recipe_class = method.part("recipe")
        default = {f.name: f.default for f in fields(recipe_class)}.get("loss")
        if default not in DIVERGENCES:
            continue
        base = load_recipe(recipe_class, path)
        try:
            for loss in DIVERGENCES:
                replace(base, loss=loss)  # the recipe's own checks
        except ValueError:
            continue
        found.append(name)
    return tuple(sorted(found))


@dataclass(frozen=True)
class HeadAblationSettings:
    method: str | None = None  # a recipe name of `head_recipes` (the demo family's); None: the first of them
    losses: str = DEFAULT_LOSSES  # comma-separated DIVERGENCES; soft_ce is every trainer's default
    seeds: str = "0,1"  # comma-separated; two give the spread of each loss
    steps: int = 100  # per head (x 8 rows), the budget every head shares: ~2.5 min per default head on 2 busy cores
    prompts: int = 12  # held-out prompts for the evaluation
    max_new_tokens: int = 48
    target: str = "smollm2"  # demo target (smollm2, micro)
    out: str = "runs/ablate-heads"
    cache_dir: str | None = None  # demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self):
        from draftsmith.demo.heads import BUDGETS

        targets = sorted({target for target, _ in BUDGETS})
        if self.target not in targets:
            raise ValueError(f"target = {self.target!r}: expected one of {', '.join(targets)}")
        methods = head_recipes(self.target)
        if self.method is None and methods:
            object.__setattr__(self, "method", methods[0])  # frozen: the default resolved once, recorded as a name
        if self.method not in methods:
            raise ValueError(f"method = {self.method!r}: expected one of {', '.join(methods)}")
        bad = [name for name in self.loss_names if name not in DIVERGENCES]
        if bad or not self.loss_names:
            raise ValueError(f"losses = {self.losses!r}: expected comma-separated names from {', '.join(DIVERGENCES)}")
        try:
            _ = self.seed_values
        except ValueError:
            raise ValueError(f"seeds = {self.seeds!r}: expected comma-separated integers") from None
        for name in ("steps", "prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def loss_names(self) -> list[str]:
        return [name.strip() for name in self.losses.split(",") if name.strip()]

    @property
    def seed_values(self) -> list[int]:
        seeds = [int(s) for s in self.seeds.split(",") if s.strip()]
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError("no seeds, or a repeated seed")
        return seeds


def run_head_ablation(settings: HeadAblationSettings, log=print) -> dict:
    """The demo target (built or loaded from its cache) and the demo's data, then `ablate_heads`."""
    from draftsmith.demo.ablate import _demo_context
    from draftsmith.heads.models import resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    ctx = _demo_context(settings.target, settings.cache_dir, device, resolve_dtype(settings.dtype, device), log)
    ctx.progress = False
    budget, _, data, cache = ctx.distill_data()
    return ablate_heads(ctx, budget, data, cache, settings, log=log)


def ablate_heads(ctx, budget, data: Path, cache: Path, settings: HeadAblationSettings, log=print) -> dict:
    """Train one head per (loss, seed) on `data` (a head with a training summary is reused),
    evaluate them all in one interleaved run, write the table and the JSON. `ctx` is a
    `DemoContext` (the target, its build folder and the demo's K), `budget` its `HeadsBudget`."""
    from draftsmith.eval.report import write_atomic

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(loss, seed) for loss in settings.loss_names for seed in settings.seed_values]
    training, folders = {}, {}
    t0 = time.perf_counter()
    for loss, seed in runs:
        name = f"{loss}/seed{seed}"
        method, base = _recipe(
            settings.method, ctx, budget, data, cache, out / "runs" / f"{loss}-seed{seed}", settings.steps
        )
        recipe = replace(base, loss=loss, seed=seed, serve_check_prompts=0)  # no serve check: the evaluation follows
        training[name] = _train_run(method, recipe, name, log)
        folders[name] = Path(recipe.out) / method.run_folder
    train_seconds = time.perf_counter() - t0
    drafters = {name: _drafter(method, folder, ctx, name) for name, folder in folders.items()}
    k = _natural_k(next(iter(drafters.values())), recipe)  # the same for every head: one recipe, loss and seed apart
    reports, num_prompts = _evaluate(settings, ctx, drafters, k, log)
    rows = _rows(settings, training, reports)
    text = "\n".join(_table_lines(settings, k, num_prompts, rows))
    record = {
        "rows": rows,
        "runs": {name: {"training": training[name], "eval": reports[name]} for name in training},
        "target_only": reports["target-only"],
        "num_draft_tokens": k,
        "train_seconds": train_seconds,
        "settings": asdict(settings),
    }
    write_atomic(out / "heads_ablation.md", text + "\n")
    write_atomic(out / "heads_ablation.json", json.dumps(record, indent=2, default=str))
    log(text)
    log(f"\nwrote {out / 'heads_ablation.md'} and {out / 'heads_ablation.json'}")
    return record


def _recipe(name: str, ctx, budget, data: Path, cache: Path, out: Path, steps: int):
    """(method, recipe): the demo's recipe `name` (recipes/<family>/<name>.yaml) for `steps` steps."""
    from draftsmith.demo.heads import demo_recipe

    method, recipe = demo_recipe(ctx, budget, name, data, cache, str(out))
    return method, replace(recipe, max_steps=steps, eval_every=steps, save_every=steps + 1)


def _natural_k(drafter, recipe) -> int:
    """Drafts per target call the head was trained for (the K its simulated tau assumes, its trainer's
    serve check's): the most the drafter proposes when it bounds its proposals (a one-pass head's
    block or depths), else the recipe's held-out depth `eval_depth` (a head that drafts a chain)."""
    bound = max(drafter.proposal_sizes(PROBE_K))
    return bound if bound < PROBE_K else recipe.eval_depth


def _train_run(method, recipe, name: str, log) -> dict:
    """One head (skipped when its training summary exists); its training summary."""
    import importlib

    train = importlib.import_module(method.trainer).train
    summary_path = Path(recipe.out) / "training_summary.json"
    if not summary_path.is_file():
        shutil.rmtree(recipe.out, ignore_errors=True)
        log(f"== {method.kind} {name}: {recipe.max_steps} steps x {recipe.batch_size} rows")
        t0 = time.perf_counter()
        train(recipe, progress=False)
        log(f"   {time.perf_counter() - t0:.0f} s")
    return json.loads(summary_path.read_text())


def _drafter(method, folder: Path, ctx, name: str):
    """The head as `draftsmith eval` loads it (`chain_drafter`, with its checks), named `name`."""
    from draftsmith.eval.drafter_specs import chain_drafter

    drafter = chain_drafter(method.kind, folder, ctx.target, ctx.device, ctx.dtype)
    drafter.name = name
    return drafter


def _evaluate(settings, ctx, drafters: dict, k: int, log) -> tuple[dict, int]:
    """({method: evaluator row}, prompts): every head (`drafters`) and target-only, greedy, one timed pass."""
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.eval.evaluator import EvalSettings, evaluate, load_prompts

    template = resolve_chat_template("auto", ctx.tokenizer)  # the instructions through the target's chat template
    prompts = load_prompts(ctx.built.heldout_prompts, ctx.tokenizer, limit=settings.prompts, template=template)
    eval_settings = EvalSettings(
        num_draft_tokens=k, max_new_tokens=settings.max_new_tokens, repeats=1, measure_distances=False
    )
    log(f"== evaluating {len(drafters)} heads and target-only, greedy, K = {k}, {len(prompts)} prompts")
    eos = ctx.tokenizer.eos_token_id
    report = evaluate(ctx.target, drafters, prompts, eval_settings, eos_token_id=eos, progress=False)
    return {row["method"]: row for row in report["methods"]}, len(prompts)


def _rows(settings, training: dict, reports: dict) -> list[dict]:
    """Per loss: mean, min and max over the seeds of each metric."""
    rows = []
    for loss in settings.loss_names:
        names = [f"{loss}/seed{seed}" for seed in settings.seed_values]
        row = {"loss": loss, "seeds": settings.seed_values}
        for metric in METRICS:
            if metric == "tau_simulated":
                values = [training[n]["eval"]["tau_simulated"] for n in names]
            else:
                values = [reports[n][metric] for n in names]
            row[metric] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "values": values}
        rows.append(row)
    return rows


def _table_lines(settings, k: int, num_prompts: int, rows: list[dict]) -> list[str]:
    """heads_ablation.md: the table (mean [min-max] over the seeds), then the best loss against soft CE."""
    seeds = ", ".join(map(str, settings.seed_values))
    lines = [
        f"Loss ablation of the {settings.method} head on the demo target ({settings.target}): "
        f"{settings.steps} steps x 8 rows per head, the demo's recipe otherwise; seeds {seeds}; greedy, K = {k}, "
        f"{num_prompts} held-out prompts x {settings.max_new_tokens} tokens, 1 timed pass, all heads interleaved; "
        "mean [min-max] over the seeds; tau counts the bonus token; simulated tau = the trainer's held-out, "
        "teacher-forced estimate.",
        "",
        "| loss | alpha | tau | speedup | simulated tau |",
        "|---|---:|---:|---:|---:|",
    ]
    fmt = {"alpha": "{:.3f}", "tau": "{:.2f}", "speedup": "{:.2f}", "tau_simulated": "{:.2f}"}
    for r in rows:
        cells = []
        for m in METRICS:
            mean, low, high = (fmt[m].format(r[m][key]) for key in ("mean", "min", "max"))
            cells.append(f"{mean}{'x' if m == 'speedup' else ''} [{low}-{high}]")
        lines.append(f"| {r['loss']} | " + " | ".join(cells) + " |")
    # The best mean alpha against soft CE (the trainers' default), or against the runner-up when soft CE is best.
    ranked = sorted(rows, key=lambda r: -r["alpha"]["mean"])
    base = next((r for r in rows if r["loss"] == "soft_ce"), None)
    other = base if base is not None and base is not ranked[0] else (ranked[1] if len(ranked) > 1 else None)
    if other is not None:
        best = ranked[0]
        apart = best["alpha"]["min"] > other["alpha"]["max"]
        lines += [
            "",
            (
                f"best alpha: {best['loss']} {best['alpha']['mean']:.3f} vs {other['loss']} {other['alpha']['mean']:.3f}; "
                f"the seed ranges {'do not overlap' if apart else 'overlap (within the seed noise)'}"
            ),
        ]
    return lines
