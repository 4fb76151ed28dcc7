"""`draftsmith demo`: the whole job on a real target, in one command.

  draftsmith demo                   # SmolLM2-135M-Instruct: imported, answered, every drafter trained, ranked
  draftsmith demo --budget long     # each head trained longer: how acceptance grows with tokens trained
  draftsmith demo --quick           # the micro target, a smoke run in about a minute

1. build or load the demo target (`draftsmith.demo.target`, cached): the GGUF import and
   the instruction prompts;
2. prepare every drafter method the toolkit has (`draftsmith.demo.heads`, cached): the
   target's own answers, one hidden-state cache, then each drafter trained from it;
3. evaluate all of them on the same held-out prompts with `draftsmith.eval.evaluator`;
4. print one table (method, alpha, acceptance rate, tau, speedup, OOV, KL) at greedy and one at
   T = 1, headed by how much the target's greedy answers loop (loops inflate acceptance), with
   whether every greedy row decoded exactly target-only's tokens and each trainer's tokens/s
   beside the target's forward-only tokens/s; write report.json, report.md and acceptance.png.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftsmith.demo.card import greedy_repetition, repetition_line
from draftsmith.demo.heads import (
    demo_cache,
    demo_data,
    get_budget,
    heads_root,
    learning_curve,
    prepare_root,
    train_demo_drafter,
    training_speeds,
)
from draftsmith.demo.reuse import measured_inputs, reusable_report
from draftsmith.demo.target import DemoTarget, DemoTargetError, describe_build, ensure_demo_target, get_target
from draftsmith.eval.evaluator import BASELINE


@dataclass(frozen=True)
class DemoSettings:
    target: str = "smollm2"  # the demo target (demo/target.py): smollm2, or micro for --quick
    budget: str = "default"  # the training budget (demo/heads.py BUDGETS): default, or long
    num_prompts: int = 8  # held-out prompts; 8 x 64 tokens is ~40 s of target-only decoding per row on 2 CPU cores
    max_new_tokens: int = 64
    num_draft_tokens: int = 3  # K = 3 for every row; `tune` picks each drafter's own K from this pass
    repeats: int = 1  # timed passes; speedup is their median
    temperature: float = 0.0  # greedy: acceptance is then a property of the models alone
    sampled_temperature: float | None = 1.0  # a second table at this T (None: none); sampling is how most serve
    sampled_repeats: int = 1  # its timed passes
    seed: int = 0
    compile: bool | str = False  # static KV cache + torch.compile'd steps for the target and every drafter
    tune: bool = True  # a third table: each chain drafter at the K `tune` picks (acceptance measured at K <= 6)
    tune_prompts: int = 4  # held-out prompts besides the evaluated ones, in their task mix: `tune` measures there

    @property
    def fast_path(self) -> dict:
        """The decoder's fast-path options (`generate(..., static_cache=, compile=)`)."""
        return {"static_cache": True, "compile": self.compile} if self.compile else {}

    def __post_init__(self):
        for name in ("num_prompts", "max_new_tokens", "num_draft_tokens", "repeats", "sampled_repeats", "tune_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.sampled_temperature is not None and self.sampled_temperature <= 0:
            raise ValueError(
                f"sampled_temperature must be > 0 (or None for no sampled table), got {self.sampled_temperature}"
            )

    @property
    def second_temperature(self) -> float | None:
        """The sampled table's T, or None when there is none (or it would repeat the first)."""
        return None if self.sampled_temperature in (None, self.temperature) else self.sampled_temperature


# --quick: the micro target (built in seconds) and a handful of short decodes. It checks that
# the pipeline runs, not what the numbers are: the micro target has random weights.
QUICK = DemoSettings(target="micro", num_prompts=4, max_new_tokens=16, repeats=1, tune_prompts=2)


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
    folders: dict = field(default_factory=dict)  # trained artifacts by name, for the report
    _loaded: dict = field(default_factory=dict)  # loaded heads shared by a chain and a tree row
    _data: tuple | None = None  # (budget, root, data, cache): the self-distillation data, made once

    def distill_data(self):
        """The target's own answers and their hidden-state cache (made once, cached):
        (budget, cache root, data folder, hidden cache folder)."""
        if self._data is None:
            budget = get_budget(self.settings.target, self.settings.budget)
            root = prepare_root(heads_root(self.built, self.settings.budget), self.target, budget, log=self.log)
            data = demo_data(self, budget, root, log=self.log)
            self._data = (budget, root, data, demo_cache(self, budget, root, data, log=self.log))
        return self._data

    def trained(self, name: str, load):
        """`load(folder, target=, device=, dtype=)` of the trained artifact `name`, loaded once."""
        if name not in self._loaded:
            self.folders[name] = train_demo_drafter(self, name, log=self.log)
            self._loaded[name] = load(self.folders[name], target=self.target, device=self.device, dtype=self.dtype)
        return self._loaded[name]


@dataclass(frozen=True)
class DemoMethod:
    name: str
    what: str  # one line for the report
    prepare: Callable[[DemoContext], object]  # -> a Drafter (may train first)


def _prompt_lookup(ctx: DemoContext):
    from draftsmith.decoding.drafters import PromptLookupDrafter

    return PromptLookupDrafter(max_ngram=3)


TREE_NODES = 16  # every tree row verifies 17 tokens per call


def _trained_row(name: str, method, row: str, tree: str | None):
    """The `prepare` of row `row` of the drafter the demo trains from recipe `name` (of `method`)."""

    def prepare(ctx: DemoContext):
        from draftsmith.heads.registry import RowOptions

        drafter = ctx.trained(name, method.load)
        return method.rows(drafter, ctx.target, name, RowOptions(tree=tree, tree_nodes=TREE_NODES))[row]

    return prepare


def _recipe_line(path: Path) -> str:
    """What a recipe trains: the first sentence of its opening comment."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or not line.strip("# "):
            break
        words.append(line.strip("# "))
    text = " ".join(words)
    return text.split(". ")[0].rstrip(".") if text else path.stem


def demo_methods(budget) -> list[DemoMethod]:
    """Prompt lookup (free), then every registered method the budget's family has a recipe for, in
    the registry's order: its chain row, and its tree row when the method decodes trees."""
    from draftsmith.demo.heads import demo_recipes

    rows = [
        DemoMethod("prompt-lookup", "n-gram lookup in the context (max n = 3); no model, no training", _prompt_lookup)
    ]
    for name, (method, path) in demo_recipes(budget).items():
        what = _recipe_line(path)
        chain = name + method.row_suffix
        rows.append(DemoMethod(chain, f"{what}; {method.title}, top-1 chain", _trained_row(name, method, chain, None)))
        if method.default_tree:
            tree, spec = f"{name}-tree", method.default_tree
            rows.append(
                DemoMethod(tree, f"the same, decoded as a tree ({spec})", _trained_row(name, method, tree, spec))
            )
    return rows


TABLE_NOTE = """\
alpha: conditional acceptance P(draft i accepted | drafts 1..i-1 accepted), pooled over positions.
acc. rate: the share of drafted tokens the target accepted (accepted / proposed; a tree proposes all its nodes).
tau: tokens per target call, counting the bonus token (target-only = 1.00; at most K + 1).
speedup: tokens/s over target-only tokens/s in the same timed pass (median over passes).
OOV: target probability outside the tokens the draft can propose (a reduced draft vocabulary or a candidate set; else 0).
KL: KL(target || draft) on the draft's vocabulary, raw distributions along the decoded text (- : none).
Every row decodes the target's own greedy tokens (lossless; in bf16 up to rounding at near-ties: eval/identity.py)."""


def run_demo(
    settings: DemoSettings,
    *,
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    device: str | None = "auto",
    dtype: str | None = "auto",
    force_build: bool = False,
    remeasure: bool = False,
    progress: bool = True,
    log=print,
) -> tuple[dict, Path]:
    """Build/load, prepare, evaluate, report. Returns (report, output folder). The report already
    in `out` is printed again instead when everything it was measured from is unchanged
    (`draftsmith.demo.reuse`), unless `remeasure`."""
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.eval.evaluator import EvalSettings, describe_target, evaluate, load_prompt_file
    from draftsmith.eval.report import dumps_strict, plot_acceptance, render_markdown, write_atomic
    from draftsmith.heads.models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    started = time.perf_counter()
    spec = get_target(settings.target)  # unknown target or budget: a clear error before any work
    budget = get_budget(spec.name, settings.budget)
    # `tune` picks each K on the held-out prompts after the evaluated ones: a K chosen on the prompts
    # it is then timed on would be fitted to them (tuning on the test set)
    wanted = settings.num_prompts + (settings.tune_prompts if settings.tune else 0)
    if wanted > spec.heldout_prompts:
        raise DemoTargetError(
            f"the {spec.name} target has {spec.heldout_prompts} held-out prompts: {settings.num_prompts} to evaluate "
            f"and {wanted - settings.num_prompts} others to tune on need {wanted} (lower --prompts, or --no-tune)"
        )
    device_t = resolve_device(device)
    # bf16 wherever it is native, CPUs with AVX512-BF16/AMX too: the precision targets are served in,
    # and there a verify of K + 1 tokens costs about one target step (fp32: 1.4-1.8 on such a CPU)
    dtype_t = resolve_dtype(dtype, device_t, native="any")
    out = Path(out) if out else Path("runs") / f"demo-{spec.name}"
    if out.exists() and not out.is_dir():
        raise DemoTargetError(f"--out {str(out)!r} exists and is not a folder")

    t = time.perf_counter()
    built = ensure_demo_target(spec.name, cache_dir=cache_dir, force=force_build, progress=progress, log=log)
    build_s = time.perf_counter() - t
    log(describe_build(built.manifest))

    tokenizer = load_tokenizer(built.target)
    target = load_causal_lm(built.target, device=device_t, dtype=dtype_t, role="target")
    ctx = DemoContext(target, tokenizer, built, device_t, dtype_t, settings, progress=progress, log=log)
    drafters, prepare_s = {}, {}
    methods = demo_methods(budget)
    for method in methods:
        t = time.perf_counter()
        drafters[method.name] = method.prepare(ctx)
        prepare_s[method.name] = time.perf_counter() - t

    # a report in `out` measured from these very inputs is printed again (demo/reuse.py)
    inputs = measured_inputs(
        settings=asdict(settings),
        budget=asdict(budget),
        target=target,
        folders=ctx.folders,
        prompts_file=built.heldout_prompts,
        device=device_t,
        dtype=dtype_t,
    )
    reused = None if remeasure else reusable_report(out, inputs)
    if reused is not None:
        log(
            f"\n{out / 'report.json'}: measured at {reused['demo']['measured_at']} from the same settings, target, "
            "drafters, prompts, code and versions; printed again (--remeasure times it again)"
        )
        print_summary(reused, log)
        log(
            f"{time.perf_counter() - started:.0f} s this run; the measurement's: {seconds_line(reused['demo']['seconds'])}"
        )
        return reused, out

    # the held-out instructions through the target's chat template (its system line included), first user turn
    template = resolve_chat_template("auto", tokenizer)
    held_out, held_out_tasks = load_prompt_file(built.heldout_prompts, tokenizer, template=template)
    prompts, tasks = held_out[: settings.num_prompts], held_out_tasks[: settings.num_prompts]
    tune_prompts = [held_out[i] for i in tune_rows(held_out_tasks, settings.num_prompts, wanted - settings.num_prompts)]
    eval_settings = EvalSettings(
        num_draft_tokens=settings.num_draft_tokens,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        repeats=settings.repeats,
        seed=settings.seed,
        **settings.fast_path,
    )
    eval_s = {}  # each pass's seconds
    t = time.perf_counter()

    def lap(name):
        nonlocal t
        eval_s[name] = time.perf_counter() - t
        t = time.perf_counter()

    eos = tokenizer.eos_token_id
    # The target alone, greedy, on the demo's prompts: how much of what is drafted is a loop.
    repetition = greedy_repetition(target, prompts, settings.max_new_tokens, eos)
    lap("repetition")
    report = evaluate(target, drafters, prompts, eval_settings, eos_token_id=eos, progress=progress, tasks=tasks)
    lap("greedy")
    tuned = None
    if settings.tune:
        tuned = tuned_pass(target, drafters, prompts, tune_prompts, eval_settings, eos, progress, log)
        lap("tune")
    sampled = None
    if settings.second_temperature is not None:
        # the KL/TV pass is the greedy table's: this one measures acceptance and speed
        sampled_settings = replace(
            eval_settings,
            temperature=settings.second_temperature,
            repeats=settings.sampled_repeats,
            measure_distances=False,
        )
        sampled = evaluate(target, drafters, prompts, sampled_settings, eos_token_id=eos, progress=progress)
        lap("sampled")

    report["target"] = describe_target(built.target, target, device_t, dtype_t)
    report["drafts"] = {name: str(folder) for name, folder in ctx.folders.items()}
    report["prompts_file"] = str(built.heldout_prompts)
    root = heads_root(built, settings.budget)
    report["demo"] = {
        "settings": asdict(settings),
        "budget": asdict(budget),
        "methods": {m.name: m.what for m in methods},
        "demo_target": {
            "folder": str(built.folder),
            "what": spec.what,
            "source": built.manifest["source"],
            "prompts": built.manifest["prompts"],
        },
        "target_repetition": repetition,
        "tuned": tuned,
        "greedy_identity": identical_rows(report, tuned),
        "training_tokens_per_second": training_speeds(root),
        "learning_curves": {name: learning_curve(folder) for name, folder in ctx.folders.items()},
        "sampled": None
        if sampled is None
        else {"mode": sampled["mode"], "repeats": settings.sampled_repeats, "methods": sampled["methods"]},
        "seconds": {
            "build_or_load": build_s,
            "prepare": prepare_s,
            "evaluate": eval_s,
            "total": time.perf_counter() - started,
        },
        "torch_version": torch.__version__,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": inputs,
    }
    # report.json last: a report without its report.md and plot is never reused
    out.mkdir(parents=True, exist_ok=True)
    png_path = plot_acceptance(report, out / "acceptance.png")
    md_path = out / "report.md"
    write_atomic(md_path, render_markdown(report) + demo_markdown(report))
    json_path = out / "report.json"
    write_atomic(json_path, dumps_strict(report))
    print_summary(report, log)
    log(f"\nwrote {json_path}, {md_path} and {png_path}")
    log(f"seconds: {seconds_line(report['demo']['seconds'])}")
    return report, out


def seconds_line(seconds: dict) -> str:
    """Where a demo run's time went: each step, the evaluation's passes in brackets."""
    parts = []
    for step, value in seconds.items():
        if step == "prepare":  # per drafter: their sum
            value = sum(value.values())
        if step == "evaluate":  # per pass: their sum, then each
            passes = ", ".join(f"{name} {s:.0f}" for name, s in value.items())
            value = f"{sum(value.values()):.0f} ({passes})"
        parts.append(f"{step} {value if isinstance(value, str) else f'{value:.0f}'}")
    return ", ".join(parts)


def print_summary(report: dict, log=print) -> None:
    """The demo's tables and the lines under them, from its report."""
    from draftsmith.eval.report import compact_table

    demo, settings = report["demo"], report["demo"]["settings"]
    log("")
    log(
        f"draftsmith demo - {demo['demo_target']['what']}, {report['mode']}, K = {settings['num_draft_tokens']}, "
        f"{report['num_prompts']} held-out prompts x {settings['max_new_tokens']} new tokens, budget {settings['budget']}"
    )
    log(
        f"the target's {repetition_line(demo['target_repetition'])}: loops inflate every drafter's acceptance, "
        "prompt lookup's most"
    )
    log(compact_table(report))
    if demo["tuned"] is not None:
        log(
            f"\ngreedy, each chain drafter at the K `tune` picks from the acceptance and costs it measured at "
            f"K <= {TUNE_K_MAX} on {settings['tune_prompts']} other held-out prompts (from its tau: the same accounting "
            "with the row's own tau and costs):"
        )
        log(tuned_table(demo["tuned"]))
    if demo["sampled"] is not None:
        log(f"\n{demo['sampled']['mode']}, the same prompts, {demo['sampled']['repeats']} timed pass(es):")
        log(compact_table(demo["sampled"]))
    log(TABLE_NOTE)
    log(speeds_line(demo["training_tokens_per_second"]))
    log(identity_line(demo["greedy_identity"]))


TUNE_K_MAX = 6  # acceptance per position measured this deep predicts every K <= 6


def tune_rows(tasks: list, num_evaluated: int, n: int) -> list[int]:
    """The `n` held-out prompts `tune` measures on: none of the first `num_evaluated` (the evaluated ones),
    with their task mix, for four prompts of one kind predict the speedups of another badly (a head accepts
    far more on code than on prose). Each pick is the first unused prompt of the task furthest below its
    share of the evaluated prompts; file order breaks ties, and a task they lack waits while the others
    are below their share."""
    share = Counter(tasks[:num_evaluated])
    unused = list(range(num_evaluated, len(tasks)))
    picked, have = [], Counter()
    while unused and len(picked) < n:
        step = len(picked) + 1  # the first prompt of the task furthest below its share once it is picked
        _, first = max((share[tasks[i]] / num_evaluated * step - have[tasks[i]], -i) for i in unused)
        best = -first
        unused.remove(best)
        picked.append(best)
        have[tasks[best]] += 1
    return picked


def tuned_pass(target, drafters: dict, prompts, tune_prompts, eval_settings, eos, progress, log) -> dict:
    """Each chain drafter at the K that `tune` picks: acceptance per position at K_max and the
    measured costs (draft time, the verify curve v(n)) on `tune_prompts` (not the evaluated ones),
    `tune_chain`'s choice, then one greedy evaluation of them all on `prompts`, each at its K, with
    target-only in the same pass."""
    from draftsmith.eval.evaluator import evaluate
    from draftsmith.eval.sweep import measure_chain
    from draftsmith.eval.tune import tune_chain

    chosen = {}
    for name, drafter in drafters.items():
        if getattr(drafter, "tree", None) is not None:
            continue  # trees are sized by their node budget, not by K
        k_max = min(TUNE_K_MAX, max(drafter.proposal_sizes(TUNE_K_MAX)))
        measured = measure_chain(
            target,
            drafter,
            tune_prompts,
            k_max,
            replace(eval_settings, num_draft_tokens=k_max),
            eos_token_id=eos,
            progress=False,
        )
        tuning = tune_chain(measured.alpha_per_position, measured.draft_seconds, measured.verify_seconds)
        k = tuning.best.setting["num_speculative_tokens"]
        chosen[name] = {
            "k": k,
            "k_max": k_max,
            "predicted_speedup": tuning.best.speedup,
            "predicted_tau": tuning.best.tau,
            "alpha_per_position": measured.alpha_per_position,
        }
        log(f"tune {name}: K = {k} of 0..{k_max} (predicted {tuning.best.speedup:.2f}x, tau {tuning.best.tau:.2f})")
    # K = 0: no K pays, the drafter is not run; the others each at its K, against one target-only pass
    ks = {name: c["k"] for name, c in chosen.items() if c["k"] > 0}
    rows = []
    if ks:
        result = evaluate(
            target,
            {name: drafters[name] for name in ks},
            prompts,
            replace(eval_settings, measure_distances=False),
            eos_token_id=eos,
            progress=progress,
            num_draft_tokens=ks,
        )
        rows = [{**row, "k": ks[row["method"]]} for row in result["methods"] if row["method"] in ks]
    order = list(drafters)
    return {"chosen": chosen, "methods": sorted(rows, key=lambda r: order.index(r["method"]))}


def tuned_table(tuned: dict) -> str:
    """Markdown: each tuned row with its K, tau, measured speedup, `tune`'s prediction (from the
    acceptance and costs it measured on its own prompts) and the same accounting from the row's
    own tau and costs (their gap is the sample `tune` saw; the second's gap to the measured
    speedup is the decoder's overhead)."""
    lines = [
        "| method | K | alpha | tau | speedup | predicted by tune | from its tau | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in tuned["methods"]:
        check = row.get("greedy_identity")
        same = "-" if check is None else {"identical": "yes", "rounding": "rounding"}.get(check["verdict"], "NO")
        own = row.get("predicted_speedup_measured_costs")
        lines.append(
            f"| {row['method']} | {row['k']} | {row['alpha']:.2f} | {row['tau']:.2f} | {row['speedup']:.2f}x | "
            f"{tuned['chosen'][row['method']]['predicted_speedup']:.2f}x | "
            f"{'-' if own is None else f'{own:.2f}x'} | {same} |"
        )
    idle = [name for name, c in tuned["chosen"].items() if c["k"] == 0]
    if idle:  # tune_chain's K = 0: even one draft costs more than its acceptance returns
        lines += ["", f"K = 0 (no K pays, plain decoding is faster; not run): {', '.join(idle)}"]
    return "\n".join(lines)


def identical_rows(report: dict, tuned: dict | None = None) -> dict | None:
    """Greedy only: per row (the K = 3 table, then the tuned one as NAME@K=k), its `compare_greedy`
    against target-only on the demo's own prompts (a lossless decoder's promise: the target's own
    tokens, exactly in fp32, up to the dtype's rounding at near-ties in bf16)."""
    if report["mode"] != "greedy":
        return None
    rows = {row["method"]: row["greedy_identity"] for row in report["methods"] if row["method"] != BASELINE}
    for row in (tuned or {}).get("methods", []):
        rows[f"{row['method']}@K={row['k']}"] = row["greedy_identity"]
    return rows


def identity_line(identical: dict | None) -> str:
    from draftsmith.eval.identity import TIE_ULPS

    if identical is None:
        return "(token identity is a greedy check: sampled rows are checked by `draftsmith check-lossless`)"
    bad = [name for name, check in identical.items() if check["verdict"] == "mismatch"]
    if bad:
        return f"NOT LOSSLESS: {', '.join(bad)} decoded tokens the target would not choose at greedy"
    parted = {name: check for name, check in identical.items() if check["verdict"] == "rounding"}
    line = f"every greedy row ({len(identical)}) decoded the target's own tokens"
    if not parted:
        return line + ": exactly target-only's on every prompt"
    worst = max(c["max_gap_ulps"] for c in parted.values())
    noise = max(c["target_only_max_gap_ulps"] for c in parted.values())
    dtype = next(iter(parted.values()))["dtype"]
    differing = sum(c["prompts_differing"] for c in parted.values())
    total = sum(c["prompts"] for c in parted.values())
    return (
        f"{line}: {len(identical) - len(parted)} exactly target-only's; {len(parted)} parted from it on "
        f"{differing} of {total} prompts at {dtype} near-ties (every token within {worst:.1f} ulp of the "
        f"target's best logit, target-only's own within {noise:.1f}; tolerance {TIE_ULPS:g})"
    )


def speeds_line(speeds: dict) -> str:
    """Each trainer's tokens/s beside the target's forward-only tokens/s (the shared cache's pass)."""
    base = speeds.get("target-forward")
    parts = []
    for name, rate in speeds.items():
        if name == "target-forward" or rate is None:
            continue
        parts.append(f"{name} {rate:,.0f}" + (f" ({rate / base:.2f}x)" if base else ""))
    head = f"target forward-only {base:,.0f} tokens/s" if base else "target forward-only: not measured"
    return f"training tokens/s: {', '.join(parts) or '-'}; {head}"


def demo_markdown(report: dict) -> str:
    """The demo's own sections of report.md: methods, the plot, training, the target it ran on."""
    from draftsmith.eval.report import compact_table

    demo = report["demo"]
    target = demo["demo_target"]
    lines = ["## Methods", ""]
    lines += [f"- `{name}`: {what}" for name, what in demo["methods"].items()]
    lines += [
        "",
        f"The target's {repetition_line(demo['target_repetition'])}.",
        "",
        identity_line(demo["greedy_identity"]),
        "",
    ]
    if demo.get("tuned"):
        lines += ["## Each chain drafter at the K `tune` picks (greedy)", "", tuned_table(demo["tuned"]), ""]
    if demo.get("sampled"):
        sampled = demo["sampled"]
        lines += [
            f"## The same methods at {sampled['mode']} ({sampled['repeats']} timed pass(es))",
            "",
            compact_table(sampled),
            "",
        ]
    lines += ["## Acceptance by draft position (plot)", "", "![acceptance by draft position](acceptance.png)", ""]
    lines += [
        "## Training",
        "",
        speeds_line(demo["training_tokens_per_second"]),
        "",
        "Held-out simulated tau (greedy, teacher-forced, bonus token counted) by training step:",
        "",
    ]
    for name, points in demo["learning_curves"].items():
        if points:
            lines.append(f"- {name}: " + ", ".join(f"step {p['step']}: {p['tau_simulated']:.2f}" for p in points))
    source = target["source"]
    origin = (
        f"`{source['package']}` {source['version']}, file sha256 {source['sha256']}"
        if source["kind"] == "gguf"
        else "random weights"
    )
    lines += [
        "",
        "## Demo target",
        "",
        f"{target['what']}: `{target['folder']}` ({origin}; see target/MODEL_CARD.md).",
        "",
        f"Seconds: {seconds_line(demo['seconds'])}.",
        "",
    ]
    return "\n".join(lines)


def with_overrides(base: DemoSettings, **overrides) -> DemoSettings:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
