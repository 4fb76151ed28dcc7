"""What a demo-target build measures about itself, and the model card it writes.

    with cpu_decode_threads(device):
        quality = quality_report(target, draft, tokenizer, heldout_rows, num_prompts=8, k=3, new_tokens=48,
                                 repetition_prompts=32, repetition_new_tokens=96)
    card = model_card(manifest)          # MODEL_CARD.md of `draftsmith.train.demo_target`

Acceptance is measured through the real decoder (`draftsmith.eval.runtime.generate`): the
target drafting for itself must be accepted every time, the small draft is the baseline.
How much the target's greedy answers loop (`draftsmith.eval.repetition`) is measured too:
loops are easy to predict and inflate every drafter's acceptance, prompt lookup's most.
"""

from __future__ import annotations

import contextlib

import torch

from draftsmith.eval.repetition import repetition_share

REPETITION_N = 4  # n-gram size of the repetition share: long enough that code's short idioms rarely count


@contextlib.contextmanager
def cpu_decode_threads(device: torch.device):
    """Batch-1 decoding of models this small costs per-op overhead, not FLOPs: on CPU a second
    intra-op thread only adds synchronisation (and on a shared machine waits for a busy core).
    So decode with one thread; every method gets the same, so speedups stay comparable."""
    before = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def measure_acceptance(target, drafter, prompts: list[torch.Tensor], *, k: int, new_tokens: int, temperature: float, seed: int = 0) -> dict:
    """Pooled acceptance of `drafter` against `target` on `prompts` through the real decoder."""
    from draftsmith.eval.runtime import generate

    stats = None
    for i, ids in enumerate(prompts):
        out = generate(target, drafter, ids, max_new_tokens=new_tokens, num_draft_tokens=k, temperature=temperature, seed=seed + i)
        stats = out.stats if stats is None else stats + out.stats
    return {"alpha": stats.alpha, "tau": stats.tau, "alpha_per_position": stats.alpha_per_position, "k": k, "temperature": temperature}


@torch.no_grad()
def greedy_samples(target, tokenizer, prompts: list[str], new_tokens: int) -> list[dict]:
    from draftsmith.eval.runtime import generate

    rows = []
    for text in prompts:
        ids = torch.tensor(tokenizer(text).input_ids)
        out = generate(target, None, ids, max_new_tokens=new_tokens, eos_token_id=tokenizer.eos_token_id)
        rows.append({"prompt": text, "completion": tokenizer.decode(out.tokens)})
    return rows


@torch.no_grad()
def greedy_answers(target, prompts: list[torch.Tensor], new_tokens: int, eos_token_id=None) -> list[list[int]]:
    """The target's plain greedy answers (no repetition penalty), new tokens only."""
    from draftsmith.eval.runtime import generate

    return [generate(target, None, ids, max_new_tokens=new_tokens, eos_token_id=eos_token_id).tokens for ids in prompts]


def greedy_repetition(target, prompts: list[torch.Tensor], new_tokens: int, eos_token_id=None) -> dict:
    """The repeated-4-gram share (per answer and pooled) of the target's greedy answers."""
    share = repetition_share(greedy_answers(target, prompts, new_tokens, eos_token_id), n=REPETITION_N)
    return {**share, "new_tokens": new_tokens}


def quality_report(
    target, draft, tokenizer, heldout_rows: list[dict], *, num_prompts: int, k: int, new_tokens: int,
    repetition_prompts: int, repetition_new_tokens: int,
) -> dict:  # fmt: skip
    """The numbers of the model card: samples, self-draft and small-draft acceptance, at K = `k`
    on the first `num_prompts` held-out rows, `new_tokens` tokens each; the repetition share of
    greedy answers of `repetition_new_tokens` to the first `repetition_prompts` rows."""
    from draftsmith.eval.runtime.drafters import DraftModelDrafter

    texts = [r["prompt"] for r in heldout_rows[:num_prompts]]
    opts = dict(k=k, new_tokens=new_tokens)
    prompts = [torch.tensor(tokenizer(t).input_ids) for t in texts]
    rep_prompts = [torch.tensor(tokenizer(r["prompt"]).input_ids) for r in heldout_rows[:repetition_prompts]]
    return {
        "repetition": greedy_repetition(target, rep_prompts, repetition_new_tokens, tokenizer.eos_token_id),
        "samples": greedy_samples(target, tokenizer, texts[:3], new_tokens),
        # The target drafting for itself: every draft must be accepted (alpha = 1.0), or
        # the decoder, the cache handling or the drafter is broken.
        "self_draft_greedy": measure_acceptance(target, DraftModelDrafter(target), prompts, temperature=0.0, **opts),
        "small_draft_greedy": measure_acceptance(target, DraftModelDrafter(draft), prompts, temperature=0.0, **opts),
        "small_draft_t1": measure_acceptance(target, DraftModelDrafter(draft), prompts, temperature=1.0, **opts),
    }


def model_card(m: dict) -> str:
    p, c, q = m["preset"], m["corpus"], m["quality"]
    lines = [
        f"# draftsmith demo target ({p['name']} preset)",
        "",
        "A small Llama trained from scratch by `draftsmith build-target`, with an independent small",
        "draft trained the same way, for running and testing draftsmith without a hub download.",
        "",
        "## Data",
        "",
        f"- Corpus: the Python {c['python']} standard library sources ({c['root']}); test folders, idlelib, "
        "lib2to3, turtledemo, site-packages and the data modules encodings/ and pydoc_data/ excluded; files sorted by path, 1 in "
        f"{p['heldout_every']} held out.",
        f"- {c['train_files']} train files ({c['train_bytes'] / 1e6:.2f} MB, {c['train_tokens']:,} tokens), "
        f"{c['heldout_files']} held-out files ({c['heldout_bytes'] / 1e6:.2f} MB, {c['heldout_tokens']:,} tokens).",
        f"- Tokenizer: {m['tokenizer']['type']}, {m['tokenizer']['vocab_size']} tokens, specials "
        f"{', '.join(m['tokenizer']['special_tokens'])}; every sequence starts with <s>.",
        "",
        "## Models",
        "",
        "| model | parameters | shape (hidden x layers) | tokens seen | final train loss | held-out loss | held-out perplexity | train tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role, r in m["models"].items():
        lines.append(
            f"| {role} | {r['parameters'] / 1e6:.2f}M | {r['shape']['hidden']} x {r['shape']['layers']} | {r['tokens_seen']:,} | "
            f"{r['final_train_loss']:.3f} | {r['heldout_loss']:.3f} | {r['heldout_perplexity']:.2f} | {r['tokens_per_second']:,.0f} |"
        )
    lines += [
        "",
        f"Training: AdamW, linear warm-up then cosine, batch {p['batch_size']} x {p['seq_len']} tokens, "
        f"bf16 autocast: {m['models']['target']['train']['bf16']} (the preset asks {p['bf16']}: on only where the device has "
        f"bf16 units), on {m['device']} (torch {m['torch']}).",
        "",
        f"## Acceptance (K = {p['quality_k']}, {p['quality_prompts']} held-out prompts, {p['quality_new_tokens']} new tokens)",
        "",
        "| drafter | mode | alpha | tau (counts the bonus token) | alpha per position |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("self_draft_greedy", "self-draft (sanity: must be 1.0)"), ("small_draft_greedy", "small draft"), ("small_draft_t1", "small draft")):
        r = q[name]
        mode = "greedy" if r["temperature"] == 0 else f"T = {r['temperature']:g}"
        per = " ".join(f"{a:.2f}" for a in r["alpha_per_position"])
        lines.append(f"| {label} | {mode} | {r['alpha']:.3f} | {r['tau']:.2f} | {per} |")
    rep = repetition_line(q["repetition"])
    lines += ["", "## Repetition", "", rep[:1].upper() + rep[1:] + ": loops are easy to predict, so they inflate acceptance.", ""]
    lines += ["## Greedy samples (held-out prompts)", ""]
    for s in q["samples"]:
        lines += ["```python", s["prompt"] + s["completion"], "```", ""]
    t = m["timings"]
    lines += [
        "## Build",
        "",
        "Stage wall times (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in t.items()),
        "",
        f"Built {m['created']}. Prompts: {m['prompts']['train']} train, {m['prompts']['heldout']} held-out "
        "(`prompts/*.jsonl`, code prefixes: signatures, docstrings, first lines of functions).",
        "",
    ]
    return "\n".join(lines)


def repetition_line(rep: dict) -> str:
    """One sentence on how much greedy answers loop (a `greedy_repetition` result)."""
    per = sorted(x for x in rep["per_answer"] if x is not None)
    pooled = "-" if rep["pooled"] is None else f"{100 * rep['pooled']:.1f}%"
    spread = f" (per answer: median {100 * per[len(per) // 2]:.0f}%, max {100 * per[-1]:.0f}%)" if per else ""
    return (
        f"greedy answers (no repetition penalty, up to {rep['new_tokens']} new tokens, {rep['answers']} held-out prompts) "
        f"repeat {pooled} of their {rep['n']}-grams{spread}"
    )


def stage_summary(manifest: dict) -> str:
    """A few lines for the terminal after a build or a cache hit."""
    models = manifest["models"]
    q = manifest["quality"]
    return (
        f"target {models['target']['parameters'] / 1e6:.2f}M params, held-out ppl {models['target']['heldout_perplexity']:.2f}; "
        f"draft {models['draft']['parameters'] / 1e6:.2f}M, ppl {models['draft']['heldout_perplexity']:.2f}; "
        f"self-draft alpha {q['self_draft_greedy']['alpha']:.3f}; small-draft alpha greedy "
        f"{q['small_draft_greedy']['alpha']:.3f}, T=1 {q['small_draft_t1']['alpha']:.3f}; target's greedy answers repeat "
        f"{100 * (q['repetition']['pooled'] or 0):.1f}% of their {q['repetition']['n']}-grams"
    )
