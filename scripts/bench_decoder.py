"""Decoder speed: draftsmith's `generate` against Hugging Face `generate`, greedy, batch 1.

    python scripts/bench_decoder.py                      # random Llama pair built in-process (~2 min, 2 CPU cores)
    python scripts/bench_decoder.py --num-draft-tokens 3 --repeats 5 --out bench.json
    python scripts/bench_decoder.py --hidden 512 --layers 8 --draft-layers 2 --max-new-tokens 64
    python scripts/bench_decoder.py --target path/to/target --draft path/to/draft --device cuda

One process, one target/draft pair, the same prompts and the same K for every method:

    hf-generate      target.generate(...)                          target only
    draftsmith       generate(target, None, ...)                   target only
    hf-assisted      target.generate(assistant_model=draft, ...)   K fixed on the assistant
    draftsmith-spec  generate(target, DraftModelDrafter(draft))    K
    and hf-assisted / draftsmith-spec again with a self-draft (a copy of the target, alpha = 1
    up to float round-off): the draft is as good as it gets, so what differs is decoder overhead.

Methods are interleaved within every repeat (the order rotates per prompt) so that load from
other work on the machine hits all of them alike; each row reports the median over repeats of
tokens/s, warm-up excluded, timers synchronised with the device. EOS is disabled: every run
emits exactly --max-new-tokens tokens. Greedy outputs must be identical across methods; a
WARNING row says where they are not.

Goals (from the issue): draftsmith target-only >= 1.00x hf-generate, and draftsmith-spec
>= 1.25x hf-assisted with the same pair and K.

Without --target, the target is a random Llama (hidden 256, 4 layers, vocab 8192: ~5 ms per
forward on one core, the size class of the project's own small targets) whose output head is
scaled up so that next-token distributions are peaked (as tests/fixtures.py does): with the
default initialisation they are near-uniform and greedy acceptance means nothing. Without
--draft, the draft is the target truncated to its first --draft-layers layers (embeddings,
those layers, final norm, lm_head). Acceptance of a random truncated model is near zero and
says nothing about trained drafts; it is reported as measured. The ratios depend on the model
size: the bigger the forward, the smaller the share of decoder overhead (see the third command).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from draftsmith.eval.decoder import DecodeStats, generate, synchronize
from draftsmith.eval.drafters import DraftModelDrafter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Used when the target folder has a tokenizer; otherwise prompts are random token ids.
TEXT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "Speculative decoding speeds up generation because",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "for i, line in enumerate(open(path)):\n    if line.startswith('#'):\n",
    "Translate to French: The weather is nice today.\n",
    "Q: What is the capital of Italy?\nA:",
]


@dataclass
class BenchConfig:
    target: str | None = None  # HF folder; None = a random Llama built in-process
    draft: str | None = None  # HF folder; None = the target truncated to `draft_layers`
    draft_layers: int = 1  # 1 of 4 layers: c ~ 0.3-0.4 on CPU, where per-forward overhead dominates
    num_draft_tokens: int = 4  # K, the same for both decoders
    max_new_tokens: int = 128  # prefill stays a small share of a run; the bench fits in ~2 min
    prompts: int = 4  # prompts per repeat, every method runs each of them
    prompt_len: int = 32  # random-id prompts only
    repeats: int = 3  # median of >= 3 runs (REFERENCE.md, metric conventions)
    device: str | None = None  # None = cuda if available, else cpu
    dtype: str | None = None  # None = float32 on cpu, bfloat16 on cuda
    # CPU: 1 thread. Batch-1 decoding of small models is bound by per-op overhead, and with
    # intra-op threads a busy machine stalls every op (measured on 2 shared cores under load,
    # h512 x 8 target: 30 ms with 1 thread vs 360 ms with 2, median per forward).
    threads: int = 1  # CPU intra-op threads; 0 = torch's default
    seed: int = 0  # weights and random prompts
    out: str | None = None  # optional JSON with every run
    # The random target (no --target): a forward costs a few ms (~5 ms on one core).
    hidden: int = 256
    layers: int = 4
    vocab: int = 8192  # the brief's example size; 4096 would halve the lm_head cost
    head_scale: float = 8.0  # x8 on lm_head: peaked distributions (tests/fixtures.py HEAD_SCALE)
    no_self_draft: bool = False  # skip the self-draft rows (halves the run time with big targets)

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available here; use --device cpu")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_draft_tokens", "max_new_tokens", "prompts", "prompt_len", "draft_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (a median of fewer runs is noise), got {self.repeats}")
        if self.draft is not None and self.target is None:
            raise ValueError("--draft needs --target (the random target has no matching draft folder)")
        for name in ("target", "draft"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"--{name} {path!r} is not a folder (expected a Hugging Face model folder)")


def parse_args(argv=None) -> BenchConfig:
    """Flags are the fields of `BenchConfig` (`num_draft_tokens` -> `--num-draft-tokens`)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # The help of a flag is the comment beside its field.
    helps = dict(re.findall(r"^    (\w+): [^#\n]*# (.*)$", inspect.getsource(BenchConfig), re.M))
    for f in dataclasses.fields(BenchConfig):
        flags = ["--" + f.name.replace("_", "-")] + (["-k"] if f.name == "num_draft_tokens" else [])
        kwargs = dict(dest=f.name, help=helps.get(f.name))
        if isinstance(f.default, bool):
            parser.add_argument(*flags, action="store_true", **kwargs)
        else:
            kind = str if f.default is None else type(f.default)
            parser.add_argument(*flags, type=kind, default=f.default, **kwargs)
    try:
        return BenchConfig(**vars(parser.parse_args(argv)))
    except ValueError as err:
        parser.error(str(err))


# ----------------------------------------------------------------------------- models


def random_llama(cfg: BenchConfig) -> LlamaForCausalLM:
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=3 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=max(1, cfg.hidden // 64),
        num_key_value_heads=max(1, cfg.hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(cfg.head_scale)
    return model


def truncated(model, num_layers: int):
    """A copy of `model` that keeps its first `num_layers` decoder layers (plus embeddings,
    final norm and lm_head); the config is otherwise unchanged."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    if not 1 <= num_layers < text.num_hidden_layers:
        raise ValueError(f"--draft-layers must be in 1..{text.num_hidden_layers - 1}, got {num_layers}")
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config)
    layer = re.compile(r"\.layers\.(\d+)\.")
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if (m := layer.search(name)) is None or int(m.group(1)) < num_layers
    }
    missing, unexpected = draft.load_state_dict(kept, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"truncation left missing={missing[:4]} unexpected={unexpected[:4]} weights")
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


def load_models(cfg: BenchConfig):
    """Returns target, draft, self-draft (or None), tokenizer (or None), a description."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    tokenizer = None
    if cfg.target is None:
        target = random_llama(cfg)
        what = (
            f"random Llama target (hidden {cfg.hidden} x {cfg.layers} layers, vocab {cfg.vocab}, "
            f"lm_head x{cfg.head_scale:g} for peaked distributions)"
        )
    else:
        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype)
        what = f"target {cfg.target}"
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.target)
        except Exception:  # noqa: BLE001 - the tokenizer is optional: prompts fall back to random ids
            tokenizer = None
    if cfg.draft is None:
        draft = truncated(target, cfg.draft_layers)
        what += f"; draft = the target's first {cfg.draft_layers} layers"
    else:
        draft = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=dtype)
        what += f"; draft {cfg.draft}"
    self_draft = None if cfg.no_self_draft else copy.deepcopy(target)
    models = [m for m in (target, draft, self_draft) if m is not None]
    for model in models:
        model.to(device=device, dtype=dtype).eval()
        gen = model.generation_config
        gen.eos_token_id = None  # fixed-length runs: every method emits max_new_tokens
        if gen.pad_token_id is None:
            gen.pad_token_id = 0  # silences HF's "setting pad_token_id" warning; batch 1 never pads
    for assistant in models[1:]:
        # HF assisted generation with exactly K drafts per round, as draftsmith does:
        gen = assistant.generation_config
        gen.num_assistant_tokens = cfg.num_draft_tokens
        gen.num_assistant_tokens_schedule = "constant"  # no heuristic growing/shrinking of K
        gen.assistant_confidence_threshold = 0.0  # 0 = no ConfidenceCriteria, no early cut
    return target, draft, self_draft, tokenizer, what


def make_prompts(cfg: BenchConfig, tokenizer, vocab_size: int) -> list[torch.Tensor]:
    if tokenizer is not None:
        texts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(cfg.prompts)]
        return [torch.tensor(tokenizer(t)["input_ids"], dtype=torch.long) for t in texts]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    # Ids 0-2 are the random model's special tokens; prompts avoid them.
    return [torch.randint(3, vocab_size, (cfg.prompt_len,), generator=gen) for _ in range(cfg.prompts)]


@torch.inference_mode()
def mean_top1(model, prompts, device) -> float:
    """Mean probability of the argmax over the prompt positions: how peaked the target is."""
    tops = [torch.softmax(model(input_ids=p[None].to(device)).logits[0].float(), -1).amax(-1) for p in prompts]
    return torch.cat(tops).mean().item()


# ----------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str  # hf-generate, draftsmith, hf-assisted, draftsmith-spec
    draft: str  # "-" (target only), "trunc-<layers>", "draft" (--draft) or "self"
    run: object  # ids [T] -> (new tokens, DecodeStats | None)
    counterpart: str | None = None  # the HF row this one is compared with
    baseline: str | None = None  # the target-only row of the same implementation
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: DecodeStats | None = None
    outputs: dict[int, list[int]] = field(default_factory=dict)
    target_forwards: int | None = None  # target forward calls in the warm-up run (incl. prefill)

    @property
    def key(self) -> str:
        return self.name if self.draft == "-" else f"{self.name} ({self.draft})"

    @property
    def tok_per_s(self) -> list[float]:
        return [n / s for n, s in zip(self.tokens, self.seconds)]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_per_s)


def build_methods(cfg: BenchConfig, target, draft, self_draft) -> list[Method]:
    K, M = cfg.num_draft_tokens, cfg.max_new_tokens

    def hf(assistant=None):
        def run(ids):
            ids = ids[None].to(target.device)
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=M,
                do_sample=False,
                assistant_model=assistant,
            )
            return out[0, ids.shape[1] :].tolist(), None

        return run

    def ours(drafter=None):
        def run(ids):
            gen = generate(target, drafter, ids, max_new_tokens=M, num_draft_tokens=K)
            return gen.tokens, gen.stats

        return run

    draft_name = f"trunc-{cfg.draft_layers}" if cfg.draft is None else "draft"
    methods = [
        Method("hf-generate", "-", hf(), baseline="hf-generate"),
        Method("draftsmith", "-", ours(), counterpart="hf-generate", baseline="draftsmith"),
        Method("hf-assisted", draft_name, hf(draft), baseline="hf-generate"),
        Method("draftsmith-spec", draft_name, ours(DraftModelDrafter(draft)), baseline="draftsmith"),
    ]
    methods[3].counterpart = methods[2].key
    if self_draft is not None:
        methods += [
            Method("hf-assisted", "self", hf(self_draft), baseline="hf-generate"),
            Method("draftsmith-spec", "self", ours(DraftModelDrafter(self_draft)), baseline="draftsmith"),
        ]
        methods[5].counterpart = methods[4].key
    return methods


def count_forwards(model, fn):
    """Runs `fn()` and counts `model`'s forward calls (warm-up only: hooks cost time)."""
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        fn()
    finally:
        handle.remove()
    return calls[0]


def bench(cfg: BenchConfig, methods: list[Method], prompts, target, device) -> None:
    # Warm-up: every method once (allocator, kernels, HF's lazy setup); counts target calls.
    for m in methods:
        m.target_forwards = count_forwards(target, lambda: m.run(prompts[0]))
    for r in range(cfg.repeats):
        for m in methods:
            m.seconds.append(0.0)
            m.tokens.append(0)
        for i, ids in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                synchronize(device)
                t0 = time.perf_counter()
                tokens, stats = m.run(ids)
                synchronize(device)
                m.seconds[-1] += time.perf_counter() - t0
                m.tokens[-1] += len(tokens)
                m.outputs.setdefault(i, tokens)
                if stats is not None:
                    m.stats = stats if m.stats is None else m.stats + stats
        print(
            f"  repeat {r + 1}/{cfg.repeats}: "
            + ", ".join(f"{m.key} {m.tok_per_s[-1]:.1f}" for m in methods)
            + " tok/s",
            file=sys.stderr,
            flush=True,
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- report


def report(cfg: BenchConfig, methods: list[Method], header: str, top1: float) -> dict:
    by_key = {m.key: m for m in methods}
    ref = by_key["hf-generate"]
    rows, warnings, results = [], [], {}
    for m in methods:
        diffs = {i: first_difference(ref.outputs[i], out) for i, out in m.outputs.items()}
        diffs = {i: d for i, d in diffs.items() if d is not None}
        same = "ref" if m is ref else ("yes" if not diffs else f"NO ({len(diffs)}/{len(m.outputs)})")
        if diffs:
            i, d = min(diffs.items(), key=lambda kv: kv[1])
            warnings.append(
                f"| WARNING | {m.key} | greedy output differs from hf-generate on {len(diffs)}/"
                f"{len(m.outputs)} prompts (first at new token {d} of prompt {i}) | | | | | | |"
            )
        vs_hf = by_key[m.counterpart].median if m.counterpart else None
        vs_base = by_key[m.baseline].median if m.baseline else None
        st = m.stats
        rows.append(
            "| {} | {} | {:.1f} | {} | {} | {} | {} | {} | {} |".format(
                m.name,
                m.draft,
                m.median,
                f"{m.median / vs_hf:.2f}x" if vs_hf else "",
                f"{m.median / vs_base:.2f}x" if vs_base and m.baseline != m.key else "",
                f"{st.alpha:.3f}" if st and st.num_draft_tokens else "",
                f"{st.tau:.2f}" if st else "",
                m.target_forwards,
                same,
            )
        )
        results[m.key] = {
            "tok_per_s": m.tok_per_s,
            "median_tok_per_s": m.median,
            "seconds": m.seconds,
            "tokens": m.tokens,
            "ratio_vs_hf_counterpart": m.median / vs_hf if vs_hf else None,
            "ratio_vs_target_only": m.median / vs_base if vs_base else None,
            "target_forwards_per_run": m.target_forwards,
            "greedy_equal_to_hf_generate": not diffs,
            "first_difference": diffs,
        }
        if st is not None:
            results[m.key].update(
                alpha=st.alpha,
                alpha_per_position=st.alpha_per_position,
                tau_counting_bonus=st.tau,
                target_calls=st.target_calls,
                drafter_seconds=st.drafter_seconds,
                target_seconds=st.target_seconds,
            )

    print(f"\n{header}\n")
    print("| method | draft | tok/s | vs HF counterpart | vs target-only | alpha | tau | target fwd/run | greedy = hf-generate |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows + warnings))
    print(
        "\ntok/s: median over repeats. vs HF counterpart: draftsmith / hf-generate, draftsmith-spec / "
        "hf-assisted (same draft, same K). vs target-only: over the same implementation's target-only "
        "row. alpha: conditional acceptance over reached positions; tau: tokens per target call, "
        "counting the bonus/correction token (plain decoding = 1.00). target fwd/run: target forward "
        "calls in one warm-up run, prefill included (draftsmith prefills separately: +1)."
    )
    if cfg.target is None:
        print(
            f"Random weights: lm_head scaled x{cfg.head_scale:g} so distributions are peaked "
            f"(mean top-1 probability {top1:.2f} on the prompts); acceptance of a truncated random "
            "model says nothing about a trained draft."
        )
    goals = [("draftsmith", "hf-generate", 1.00)]
    goals += [(m.key, m.counterpart, 1.25) for m in methods if m.name == "draftsmith-spec"]
    print("\nGoals:")
    verdicts = {}
    for ours, theirs, goal in goals:
        ratio = by_key[ours].median / by_key[theirs].median
        met = ratio >= goal
        verdicts[f"{ours} / {theirs}"] = {"ratio": ratio, "goal": goal, "met": met}
        note = " (overhead check: the issue's goal is on the draft pair)" if "(self)" in ours else ""
        print(f"- {ours} / {theirs} = {ratio:.2f}x (goal >= {goal:.2f}x): {'met' if met else 'NOT met'}{note}")
    for m in methods:
        if m.name == "draftsmith-spec" and m.stats is not None:
            st = m.stats
            drafted = max(1, sum(st.proposed))
            c = (st.drafter_seconds / drafted) / (st.target_seconds / max(1, st.target_calls))
            print(
                f"- {m.key}: alpha per position {[round(a, 3) if a is not None else None for a in st.alpha_per_position]}, "
                f"draft/verify cost ratio c ~ {c:.2f} (drafter time per draft token / target time per call)"
            )
    return {"results": results, "goals": verdicts}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    device = torch.device(cfg.device)
    if device.type == "cpu" and cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    target, draft, self_draft, tokenizer, what = load_models(cfg)
    vocab = target.get_output_embeddings().weight.shape[0]
    prompts = make_prompts(cfg, tokenizer, vocab)
    top1 = mean_top1(target, prompts, device)
    methods = build_methods(cfg, target, draft, self_draft)
    print(f"bench: {what}", file=sys.stderr)
    started = time.perf_counter()
    bench(cfg, methods, prompts, target, device)
    header = (
        f"## Decoder bench: {what}. Greedy, batch 1, K={cfg.num_draft_tokens}, "
        f"{cfg.max_new_tokens} new tokens x {len(prompts)} prompts, median of {cfg.repeats} repeats; "
        f"{cfg.device} {cfg.dtype}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    summary = report(cfg, methods, header, top1)
    print(f"\n(bench time {time.perf_counter() - started:.0f} s)")
    if cfg.out:
        summary = {"config": dataclasses.asdict(cfg), "header": header, "mean_top1": top1, **summary}
        tmp = cfg.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, cfg.out)  # never a half-written JSON
        print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
