"""Which divergence and which data make the best draft? An ablation on the demo target.

    python scripts/ablate_distill.py                     # SmolLM2 demo target
    python scripts/ablate_distill.py --steps 50 --prompts 6 --out runs/ablate-quick

    from draftsmith.demo.ablate import AblationSettings, run_ablation
    run_ablation(AblationSettings(steps=50, prompts=6, out="runs/ablate-quick"))

Same draft initialisation (the target's first layers, as the demo's distilled draft), same
budget (steps x batch), same seed for every run:
  - `ce / fixed`: plain cross-entropy on fixed text (the standard library's sources): the usual
    way a small draft is trained, the baseline;
  - forward KL, reverse KL, JSD (beta 0.5), TV and a KL+TV hybrid against the target's
    distributions (computed online by the frozen target), each on three data sources:
    fixed text, the target's own greedy answers (`draftsmith generate`), and on-policy samples
    of the draft itself (scored by the target);
then every draft is evaluated by the evaluator on the same held-out prompts, greedy and T = 1,
all methods interleaved in one run (alpha, tau counting the bonus token, speedup vs
target-only). Writes ablation.md and ablation.json to --out.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DIVERGENCE_RUNS = ("forward_kl", "reverse_kl", "jsd", "tv", "kl_tv")
DATA_RUNS = ("fixed", "generated", "on-policy")


def fixed_text(out: Path, max_chars: int) -> Path:
    """The standard library's sources (files sorted by path) as JSONL rows: the 'fixed' data."""
    import sysconfig

    rows, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue  # empty modules
        rows.append(json.dumps({"text": text}))
        total += len(text)
        if total >= max_chars:
            break
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out


@dataclass(frozen=True)
class AblationSettings:
    target: str = "smollm2"  # demo target (smollm2, micro)
    steps: int = 100  # training steps per run: the budget every run shares
    batch_size: int = 8
    lr: float = 1e-3
    prompts: int = 12  # held-out prompts for the evaluation
    max_new_tokens: int = 48
    num_draft_tokens: int = 3  # K: the demo draft's acceptance decays fast past position 3
    out: str = "runs/ablate-distill"
    cache_dir: str | None = None  # demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)
    device: str = "auto"
    dtype: str = "auto"
    only: str | None = None  # comma-separated run names to train (e.g. ce/fixed,tv/generated); None = all

    def __post_init__(self):
        for name in ("steps", "batch_size", "prompts", "max_new_tokens", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def runs(self) -> list[tuple[str, str]]:
        """(loss, data) of every run, the CE baseline first; --only keeps the named ones."""
        runs = [("ce", "fixed")] + [(loss, data) for loss in DIVERGENCE_RUNS for data in DATA_RUNS]
        if self.only:
            wanted = set(self.only.split(","))
            runs = [r for r in runs if f"{r[0]}/{r[1]}" in wanted]
        return runs


def run_ablation(settings: AblationSettings, log=print) -> dict:
    """Train every run (a run with a training summary is reused), evaluate them all, write
    ablation.md and ablation.json to `settings.out`. Returns the table rows and training summaries."""
    from draftsmith.decoding.drafters import DraftModelDrafter
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.eval.evaluator import load_prompts
    from draftsmith.eval.report import write_atomic
    from draftsmith.heads.draft import draft_by_truncation
    from draftsmith.heads.models import load_causal_lm, resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = _demo_context(settings.target, settings.cache_dir, device, dtype, log)
    built, target, tokenizer = ctx.built, ctx.target, ctx.tokenizer
    budget, _, generated, _ = ctx.distill_data()
    fixed = fixed_text(out / "fixed.jsonl", max_chars=2_000_000)
    results = {}
    for loss, data in settings.runs():
        name = f"{loss}/{data}"
        run_out = out / "runs" / name.replace("/", "-")
        results[name] = _train_run(settings, built, budget, generated, fixed, loss, data, run_out, device, log)

    # One evaluation per mode, every draft interleaved with target-only on the same prompts.
    initial = draft_by_truncation(target, budget.draft_layers)
    drafters = {"initial draft": DraftModelDrafter(initial, name="initial")}
    for name in results:
        folder = out / "runs" / name.replace("/", "-") / "draft"
        drafters[name] = DraftModelDrafter(load_causal_lm(folder, device=device, dtype=dtype, role="draft"), name=name)
    template = resolve_chat_template("auto", tokenizer)  # the instructions through the target's chat template
    prompts = load_prompts(built.heldout_prompts, tokenizer, limit=settings.prompts, template=template)
    reports = _evaluate(settings, target, drafters, prompts, tokenizer.eos_token_id, log)
    table = _rows(drafters, results, reports)
    text = "\n".join(_table_lines(settings, settings.target, len(prompts), table))
    write_atomic(out / "ablation.md", text + "\n")
    record = {"rows": table, "training": results, "args": asdict(settings)}
    write_atomic(out / "ablation.json", json.dumps(record, indent=2, default=str))
    log(text)
    log(f"\nwrote {out / 'ablation.md'} and {out / 'ablation.json'}")
    return record


def _demo_context(name: str, cache_dir, device, dtype, log):
    """The demo target (built or loaded from its cache) and a `DemoContext` over it (default budget)."""
    from draftsmith.demo.run import DemoContext, DemoSettings
    from draftsmith.demo.target import ensure_demo_target
    from draftsmith.heads.models import load_causal_lm, load_tokenizer

    built = ensure_demo_target(name, cache_dir=cache_dir, progress=True, log=log)
    target = load_causal_lm(built.target, device=device, dtype=dtype, role="target")
    return DemoContext(target, load_tokenizer(built.target), built, device, dtype, DemoSettings(target=name), log=log)


def _train_run(
    settings, built, budget, generated: Path, fixed: Path, loss: str, data: str, run_out: Path, device, log
) -> dict:
    """One draft distillation run (skipped when its training summary exists); its summary."""
    from draftsmith.train.draft import DraftRecipe, train

    summary_path = run_out / "training_summary.json"
    if not summary_path.is_file():
        shutil.rmtree(run_out, ignore_errors=True)
        recipe = DraftRecipe(
            target=str(built.target),
            out=str(run_out),
            data=str(generated),
            fixed_data=str(fixed),
            data_mode="fixed" if data == "fixed" else "generated",
            on_policy_fraction=1.0 if data == "on-policy" else 0.0,
            draft_init="truncate",
            draft_layers=budget.draft_layers,
            loss=loss,
            temperature=1.0,
            lr=settings.lr,
            batch_size=settings.batch_size,
            max_length=budget.max_length,
            max_steps=settings.steps,
            warmup_steps=min(20, settings.steps // 5),
            eval_every=settings.steps,
            save_every=settings.steps + 1,
            num_draft_tokens=settings.num_draft_tokens,
            device=device.type,
            dtype="float32" if device.type == "cpu" else "auto",
        )
        log(f"== {loss}/{data}")
        t0 = time.perf_counter()
        train(recipe, progress=False)
        log(f"   {time.perf_counter() - t0:.0f} s")
    return json.loads(summary_path.read_text())


def _evaluate(settings, target, drafters: dict, prompts, eos_token_id, log) -> dict:
    """{mode: {method: row}} at greedy and T = 1, one timed pass each."""
    from draftsmith.eval.evaluator import EvalSettings, evaluate

    reports = {}
    for mode, temperature in (("greedy", 0.0), ("T=1", 1.0)):
        eval_settings = EvalSettings(
            num_draft_tokens=settings.num_draft_tokens,
            max_new_tokens=settings.max_new_tokens,
            temperature=temperature,
            repeats=1,
            measure_distances=False,
        )
        log(f"== evaluating {len(drafters)} drafts and target-only, {mode}")
        report = evaluate(target, drafters, prompts, eval_settings, eos_token_id=eos_token_id, progress=False)
        reports[mode] = {row["method"]: row for row in report["methods"]}
    return reports


def _rows(drafters: dict, results: dict, reports: dict) -> list[dict]:
    # The initial draft's held-out acceptance is recorded by every run (as "initial").
    initial = next(iter(results.values()))["initial"]["acceptance"] if results else None
    table = []
    for name in drafters:
        loss, data = name.split("/") if "/" in name else ("-", "-")
        held = results[name]["eval"]["acceptance"] if name in results else initial
        g, t = reports["greedy"][name], reports["T=1"][name]
        table.append(
            {
                "run": name,
                "loss": loss,
                "data": data,
                "heldout_acceptance": held,
                "alpha_greedy": g["alpha"],
                "tau_greedy": g["tau"],
                "speedup_greedy": g["speedup"],
                "alpha_t1": t["alpha"],
                "tau_t1": t["tau"],
                "speedup_t1": t["speedup"],
            }
        )
    return table


def _table_lines(settings: AblationSettings, preset: str, num_prompts: int, table: list[dict]) -> list[str]:
    """ablation.md: the table, then the best distilled draft against the CE baseline."""
    lines = [
        f"Draft distillation ablation on the demo target ({preset}): {settings.steps} steps x {settings.batch_size} rows per run, "
        f"same initial draft, K = {settings.num_draft_tokens}, {num_prompts} held-out prompts x {settings.max_new_tokens} tokens, "
        "1 timed pass; tau counts the bonus token; held-out acceptance = mean sum(min(p, q)) at T = 1 on the target's answers.",
        "",
        "| run | loss | data | held-out acceptance | alpha greedy | tau greedy | speedup greedy | alpha T=1 | tau T=1 | speedup T=1 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['run']} | {r['loss']} | {r['data']} | {r['heldout_acceptance']:.3f} | {r['alpha_greedy']:.3f} | {r['tau_greedy']:.2f} | "
            f"{r['speedup_greedy']:.2f}x | {r['alpha_t1']:.3f} | {r['tau_t1']:.2f} | {r['speedup_t1']:.2f}x |"
        )
    baseline = next((r for r in table if r["run"] == "ce/fixed"), None)
    distilled = [r for r in table if r["loss"] in DIVERGENCE_RUNS]
    if baseline and distilled:
        for key, label in (("alpha_greedy", "greedy"), ("alpha_t1", "T = 1")):
            best = max(distilled, key=lambda r: r[key])
            ratio = best[key] / baseline[key] if baseline[key] else float("inf")
            lines.append("")
            lines.append(
                f"{label}: best distilled draft {best['run']} alpha {best[key]:.3f} = {ratio:.3f}x the CE baseline's {baseline[key]:.3f} "
                f"(target >= 1.10x: {'met' if ratio >= 1.10 else 'NOT met'})"
            )
    return lines
