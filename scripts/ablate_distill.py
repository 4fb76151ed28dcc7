"""Which divergence and which data make the best draft? An ablation on the demo target.

    python scripts/ablate_distill.py                     # cpu demo target, ~25 min on 2 cores
    python scripts/ablate_distill.py --steps 50 --prompts 6 --out runs/ablate-quick

Same draft initialisation (the demo's independent 0.9M draft), same budget (steps x batch),
same seed for every run:
  - `ce / fixed`: plain cross-entropy on fixed text (the standard-library sources the target
    was trained on): the usual way a small draft is trained, the baseline;
  - forward KL, reverse KL, JSD (beta 0.5), TV and a KL+TV hybrid against the target's
    distributions (computed online by the frozen target), each on three data sources:
    fixed text, the target's own greedy answers (`draftsmith generate`), and on-policy samples
    of the draft itself (scored by the target);
then every draft is evaluated by the evaluator on the same held-out prompts, greedy and T = 1,
all methods interleaved in one run (alpha, tau counting the bonus token, speedup vs
target-only). Writes ablation.md and ablation.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


DIVERGENCE_RUNS = ("forward_kl", "reverse_kl", "jsd", "tv", "kl_tv")
DATA_RUNS = ("fixed", "generated", "on-policy")


def fixed_text(corpus, out: Path, max_chars: int) -> Path:
    """The target's own training text (stdlib sources) as JSONL rows: the 'fixed' data."""
    rows, total = [], 0
    for rel in corpus.train_files:
        text = corpus.text(rel)
        if not text.strip():
            continue  # empty __init__.py files
        rows.append(json.dumps({"text": text}))
        total += len(text)
        if total >= max_chars:
            break
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", help="demo target preset (cpu, gpu, micro)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (the shared budget)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts for the evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    parser.add_argument("--out", default="runs/ablate-distill")
    parser.add_argument("--cache-dir", help="demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--only", help="comma-separated run names to train (e.g. ce/fixed,tv/generated); default all")
    args = parser.parse_args(argv)

    from draftsmith.eval.runtime.drafters import DraftModelDrafter
    from draftsmith.eval.evaluator import EvalSettings, evaluate, load_prompts
    from draftsmith.eval.report import write_atomic
    from draftsmith.heads.models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
    from draftsmith.scripts.demo import DemoContext, DemoSettings
    from draftsmith.scripts.demo_heads import BUDGETS, demo_data, prepare_root
    from draftsmith.scripts.demo_target import cpu_decode_threads, ensure_demo_target, get_preset, stdlib_corpus
    from draftsmith.train.draft import DraftRecipe, train

    preset = get_preset(args.preset)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    built = ensure_demo_target(preset, cache_dir=args.cache_dir, device=device, progress=True)
    tokenizer = load_tokenizer(built.target)
    target = load_causal_lm(built.target, device=device, dtype=dtype, role="target")
    ctx = DemoContext(target, tokenizer, built, device, dtype, DemoSettings(preset=preset.name), progress=True)
    budget = BUDGETS[preset.name]
    generated = demo_data(ctx, budget, prepare_root(built, target, budget), log=print)
    fixed = fixed_text(stdlib_corpus(preset), out / "fixed.jsonl", max_chars=2_000_000)

    runs = [("ce", "fixed")] + [(loss, data) for loss in DIVERGENCE_RUNS for data in DATA_RUNS]
    if args.only:
        wanted = set(args.only.split(","))
        runs = [r for r in runs if f"{r[0]}/{r[1]}" in wanted]
    results = {}
    for loss, data in runs:
        name = f"{loss}/{data}"
        run_out = out / "runs" / name.replace("/", "-")
        summary_path = run_out / "training_summary.json"
        if not summary_path.is_file():
            import shutil

            shutil.rmtree(run_out, ignore_errors=True)
            recipe = DraftRecipe(
                target=str(built.target), out=str(run_out), data=str(generated), fixed_data=str(fixed),
                data_mode="fixed" if data == "fixed" else "generated", on_policy_fraction=1.0 if data == "on-policy" else 0.0,
                draft_init="checkpoint", draft_path=str(built.draft), loss=loss, temperature=1.0,
                lr=args.lr, batch_size=args.batch_size, max_length=budget.max_length, max_steps=args.steps,
                warmup_steps=min(20, args.steps // 5), eval_every=args.steps, save_every=args.steps + 1,
                num_draft_tokens=args.num_draft_tokens, device=device.type, dtype="float32" if device.type == "cpu" else "auto",
            )  # fmt: skip
            print(f"== {name}")
            t0 = time.perf_counter()
            train(recipe, progress=False)
            print(f"   {time.perf_counter() - t0:.0f} s")
        results[name] = json.loads(summary_path.read_text())

    # One evaluation per mode, every draft interleaved with target-only on the same prompts.
    drafters = {"initial draft": DraftModelDrafter(load_causal_lm(built.draft, device=device, dtype=dtype, role="draft"), name="initial")}
    for name in results:
        folder = out / "runs" / name.replace("/", "-") / "draft"
        drafters[name] = DraftModelDrafter(load_causal_lm(folder, device=device, dtype=dtype, role="draft"), name=name)
    prompts = load_prompts(built.heldout_prompts, tokenizer, limit=args.prompts)
    reports = {}
    for mode, temperature in (("greedy", 0.0), ("T=1", 1.0)):
        settings = EvalSettings(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens, temperature=temperature, repeats=1, measure_distances=False)
        print(f"== evaluating {len(drafters)} drafts and target-only, {mode}")
        with cpu_decode_threads(device):
            reports[mode] = {row["method"]: row for row in evaluate(target, drafters, prompts, settings, eos_token_id=tokenizer.eos_token_id, progress=False)["methods"]}

    lines = [
        f"Draft distillation ablation on the demo target ({preset.name}): {args.steps} steps x {args.batch_size} rows per run, "
        f"same initial draft, K = {args.num_draft_tokens}, {len(prompts)} held-out prompts x {args.max_new_tokens} tokens, "
        "1 timed pass; tau counts the bonus token; held-out acceptance = mean sum(min(p, q)) at T = 1 on the target's answers.",
        "",
        "| run | loss | data | held-out acceptance | alpha greedy | tau greedy | speedup greedy | alpha T=1 | tau T=1 | speedup T=1 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = []
    for name in drafters:
        loss, data = name.split("/") if "/" in name else ("-", "-")
        held = results[name]["eval"]["acceptance"] if name in results else (next(iter(results.values()))["initial"]["acceptance"] if results else None)
        g, t = reports["greedy"][name], reports["T=1"][name]
        row = {"run": name, "loss": loss, "data": data, "heldout_acceptance": held, "alpha_greedy": g["alpha"], "tau_greedy": g["tau"], "speedup_greedy": g["speedup"], "alpha_t1": t["alpha"], "tau_t1": t["tau"], "speedup_t1": t["speedup"]}
        table.append(row)
        lines.append(
            f"| {name} | {loss} | {data} | {held:.3f} | {g['alpha']:.3f} | {g['tau']:.2f} | {g['speedup']:.2f}x | {t['alpha']:.3f} | {t['tau']:.2f} | {t['speedup']:.2f}x |"
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
    text = "\n".join(lines)
    write_atomic(out / "ablation.md", text + "\n")
    write_atomic(out / "ablation.json", json.dumps({"rows": table, "training": results, "args": vars(args)}, indent=2, default=str))
    print(text)
    print(f"\nwrote {out / 'ablation.md'} and {out / 'ablation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
