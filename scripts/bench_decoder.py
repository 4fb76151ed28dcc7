"""Decoder speed: draftsmith's `generate` on its three paths (eager, static cache, compiled)
against Hugging Face `generate`, greedy, batch 1.

    python scripts/bench_decoder.py                      # random Llama pair built in-process (~5 min, 2 CPU cores)
    python scripts/bench_decoder.py --num-draft-tokens 3 --repeats 5 --out bench.json
    python scripts/bench_decoder.py --hidden 512 --layers 8 --draft-layers 2 --max-new-tokens 64
    python scripts/bench_decoder.py --target path/to/target --draft path/to/draft --device cuda
    D=~/.cache/draftsmith; python scripts/bench_decoder.py --target $D/demo-target-cpu/target \\
        --draft $D/demo-target-cpu/draft --medusa $D/demo-heads-cpu/medusa/heads \\
        --eagle $D/demo-heads-cpu/eagle3/head --prompt-lookup --num-draft-tokens 3 \\
        --prompt-file $D/demo-target-cpu/prompts/heldout.jsonl --no-self-draft   # every drafter kind

One process, one target, the same prompts and the same K for every method:

    hf-generate          target.generate(...)                          target only
    hf-assisted          target.generate(assistant_model=draft, ...)   K fixed on the assistant
    draftsmith           generate(target, drafter)                     eager: dynamic KV cache
    draftsmith-static    generate(..., static_cache=True)              preallocated KV cache
    draftsmith-compiled  generate(..., compile=MODE)                   static cache + torch.compile

Every draftsmith path runs target-only and each drafter available: the draft model (the
target truncated to --draft-layers layers, or --draft; on the static and compiled paths the
draft runs on that path too), a self-draft (a copy of the target, alpha = 1 up to round-off:
what differs is decoder overhead), prompt lookup (--prompt-lookup), Medusa heads (--medusa: a chain, and a tree of
--medusa-tree nodes built from the heads' recorded accuracies) and an EAGLE head (--eagle: a
chain, and the EAGLE-2 tree --eagle-tree). The HF rows run on the draft model (--no-hf skips).

Methods are interleaved within every repeat (the order rotates per prompt) so that load from
other work on the machine hits all of them alike; each row reports the median over repeats of
tokens/s, warm-up excluded (compilation happens there and is reported apart), timers
synchronised with the device. EOS is disabled: every run emits exactly --max-new-tokens
tokens. Greedy outputs must be identical across methods; a WARNING row says where they are not.

Costs, measured in the same process: the verify-cost curve v(n) (one target forward over n
tokens at a mid-decode cache length, per path; median over --curve-repeats rounds, one after
each decoding repeat, of blocks of consecutive calls)
and the draft model's one-token step d(1). c = drafting time per drafted token (in the runs) /
v(1); c_step = d(1) / v(1). The analytic speedup of a drafter is
tau * v(1) / (drafting time per call + v(n)) with tau and drafting time measured in the runs
and n the mean tokens fed per call; "of analytic" = measured / analytic speedup, i.e. how much
the decoder loop itself costs on top of the forwards.

Goals: draftsmith target-only >= 1.00x hf-generate, draftsmith speculative >= 1.25x
hf-assisted with the same pair and K; compiled (and static) target-only >= 1.5x eager;
c of the draft model <= 0.25 on the compiled path; the best drafter >= 1.5x target-only and
>= 90% of its analytic speedup.

Without --target, the target is a random Llama (hidden 256, 4 layers, vocab 8192: ~5 ms per
forward on one core, the size class of the project's own small targets) whose output head is
scaled up so that next-token distributions are peaked (as tests/fixtures.py does): with the
default initialisation they are near-uniform and greedy acceptance means nothing. Acceptance
of a random truncated model is near zero and says nothing about trained drafts; it is
reported as measured. The ratios depend on the model size: the bigger the forward, the
smaller the share of decoder overhead (see the third command).
"""

from __future__ import annotations

import argparse
import bisect
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

from draftsmith.eval.runtime import DecodeStats, generate, synchronize
from draftsmith.eval.runtime.drafters import DraftModelDrafter, MedusaDrafter, PromptLookupDrafter
from draftsmith.eval.runtime.eagle import EagleDrafter
from draftsmith.eval.runtime.compiler import COMPILE_MODES
from draftsmith.eval.runtime.kv import capacity_for, model_cache
from draftsmith.eval.medusa_tree import build_medusa_tree
from draftsmith.heads.models import DTYPE_ALIASES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("eager", "static", "compiled")
CURVE_BLOCK = 5  # consecutive timed forwards per (path, width) and repeat of the cost curve
ROW_NAMES = {"eager": "draftsmith", "static": "draftsmith-static", "compiled": "draftsmith-compiled"}

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
    medusa: str | None = None  # Medusa heads folder (needs --target): medusa-chain/-tree rows
    medusa_tree: int = 16  # nodes of the Medusa tree built from the heads' recorded accuracies; 0 = chain only
    eagle: str | None = None  # EAGLE head folder (needs --target): eagle-chain/-tree rows
    eagle_tree: str = "3,4,12"  # EAGLE-2 tree depth,top_k,total_tokens; "" = chain only
    prompt_lookup: bool = False  # add prompt-lookup rows (n-gram copy from the context, no model)
    prompt_file: str | None = None  # JSONL prompts ("prompt" text or "input_ids"); None = the built-in prompts
    num_draft_tokens: int = 4  # K, the same for every chain (trees: their own depth)
    max_new_tokens: int = 128  # prefill stays a small share of a run
    prompts: int = 4  # prompts per repeat, every method runs each of them
    prompt_len: int = 32  # random-id prompts only
    repeats: int = 3  # median of >= 3 runs (REFERENCE.md, metric conventions)
    paths: str = "eager,static,compiled"  # draftsmith decoding paths to compare
    compile_mode: str = "default"  # torch.compile mode of the compiled path: default | max-autotune
    curve: str = "1,2,3,4,5,6,8,12,16,24,32"  # widths n of the verify-cost curve v(n); each is a compile on the compiled path
    curve_repeats: int = 7  # rounds of the cost curve, one after each repeat and the rest at the end (median)
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
    no_hf: bool = False  # skip the Hugging Face rows (hf-generate, hf-assisted)

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available here; use --device cpu")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # bf16 / fp16 / fp32, as the CLI takes them
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)} (or bf16, fp16, fp32), got {self.dtype!r}")
        for name in ("num_draft_tokens", "max_new_tokens", "prompts", "prompt_len", "draft_layers", "curve_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.medusa_tree < 0:
            raise ValueError(f"--medusa-tree must be >= 0 (0 = chain only), got {self.medusa_tree}")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (a median of fewer runs is noise), got {self.repeats}")
        for name in ("draft", "medusa", "eagle"):
            if getattr(self, name) is not None and self.target is None:
                raise ValueError(f"--{name} needs --target (the random target has no matching {name})")
        for name in ("target", "draft", "medusa", "eagle"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"--{name} {path!r} is not a folder")
        if self.prompt_file is not None and not os.path.isfile(self.prompt_file):
            raise ValueError(f"--prompt-file {self.prompt_file!r} is not a file (expected JSONL prompts)")
        unknown = [p for p in self.path_list if p not in PATHS]
        if unknown or not self.path_list:
            raise ValueError(f"--paths must list some of {','.join(PATHS)}, got {self.paths!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"--compile-mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        try:
            widths = self.curve_widths
        except ValueError:
            widths = []
        if not widths or widths[0] != 1 or widths[-1] > 256:
            raise ValueError(f"--curve must be comma-separated widths in 1..256 starting at 1, got {self.curve!r}")
        if self.eagle_tree:
            parts = self.eagle_tree.split(",")
            if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
                raise ValueError(f"--eagle-tree must be depth,top_k,total_tokens (integers >= 1) or '', got {self.eagle_tree!r}")

    @property
    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]

    @property
    def curve_widths(self) -> list[int]:
        return sorted({int(n) for n in self.curve.split(",") if n.strip()})


def parse_args(argv=None) -> BenchConfig:
    """Flags are the fields of `BenchConfig` (`num_draft_tokens` -> `--num-draft-tokens`)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # The help of a flag is the comment beside its field.
    helps = dict(re.findall(r"^    (\w+): [^#\n]*# (.*)$", inspect.getsource(BenchConfig), re.MULTILINE))
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


def load_heads(cfg: BenchConfig, target) -> dict:
    """name -> (drafter factory, K) for the drafters without a
    model of their own: prompt lookup and the Medusa / EAGLE heads given on the command line."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    layers = target.config.get_text_config().num_hidden_layers
    heads = {}
    if cfg.prompt_lookup:
        heads["prompt-lookup"] = (lambda: PromptLookupDrafter(), cfg.num_draft_tokens)  # no model: no fast path
    if cfg.medusa:
        from draftsmith.heads.medusa import load_medusa

        medusa = load_medusa(cfg.medusa, target=target, device=device, dtype=dtype)
        k = min(cfg.num_draft_tokens, medusa.config.num_heads)
        heads["medusa-chain"] = (lambda medusa=medusa: MedusaDrafter(medusa, layers, name="medusa-chain"), k)
        accuracies = medusa.config.head_accuracies
        if cfg.medusa_tree and accuracies:
            tree = build_medusa_tree(accuracies, cfg.medusa_tree)
            depth = max(len(path) for path in tree)
            heads["medusa-tree"] = (
                lambda medusa=medusa, tree=tree: MedusaDrafter(medusa, layers, tree=tree, name="medusa-tree"), depth
            )
        elif cfg.medusa_tree:
            print(f"bench: {cfg.medusa} records no head accuracies: no medusa-tree row", file=sys.stderr)
    if cfg.eagle:
        from draftsmith.heads.eagle import load_eagle

        eagle = load_eagle(cfg.eagle, target=target, device=device, dtype=dtype)
        heads["eagle-chain"] = (lambda eagle=eagle: EagleDrafter(eagle, name="eagle-chain"), cfg.num_draft_tokens)
        if cfg.eagle_tree:
            depth, top_k, total = (int(v) for v in cfg.eagle_tree.split(","))
            settings = {"depth": depth, "top_k": top_k, "total_tokens": total}
            heads["eagle-tree"] = (
                lambda eagle=eagle, settings=settings: EagleDrafter(eagle, tree=settings, name="eagle-tree"), depth + 1
            )
    return heads


def make_prompts(cfg: BenchConfig, tokenizer, vocab_size: int) -> list[torch.Tensor]:
    if cfg.prompt_file is not None:
        from draftsmith.eval.evaluator import load_prompts

        return load_prompts(cfg.prompt_file, tokenizer, limit=cfg.prompts)
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
    name: str  # hf-generate, hf-assisted, draftsmith, draftsmith-static, draftsmith-compiled
    draft: str  # "-" (target only), "trunc-<layers>" / "draft", "self", "medusa-chain", ...
    run: object  # ids [T] -> (new tokens, DecodeStats | None)
    path: str | None = None  # draftsmith's path (eager / static / compiled); None for HF
    counterpart: str | None = None  # the HF row this one is compared with
    baseline: str | None = None  # the target-only row of the same implementation and path
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: DecodeStats | None = None
    outputs: dict[int, list[int]] = field(default_factory=dict)
    target_forwards: int | None = None  # target forward calls in the warm-up run (incl. prefill)
    compile_seconds: float = 0.0  # spent in the warm-up run (target and drafter)

    @property
    def key(self) -> str:
        return self.name if self.draft == "-" else f"{self.name} ({self.draft})"

    @property
    def tok_per_s(self) -> list[float]:
        return [n / s for n, s in zip(self.tokens, self.seconds)]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_per_s)


def _compile_arg(cfg: BenchConfig, path: str):
    return {"eager": {}, "static": {"static_cache": True}, "compiled": {"compile": cfg.compile_mode}}[path]


def build_methods(cfg: BenchConfig, target, draft, self_draft, heads) -> list[Method]:
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

    def ours(path, make_drafter=lambda: None, k=K):
        fast = _compile_arg(cfg, path)

        def run(ids):
            gen = generate(target, make_drafter(), ids, max_new_tokens=M, num_draft_tokens=k, **fast)
            return gen.tokens, gen.stats

        return run

    draft_name = f"trunc-{cfg.draft_layers}" if cfg.draft is None else "draft"
    methods = []
    if not cfg.no_hf:
        methods.append(Method("hf-generate", "-", hf(), baseline="hf-generate"))
        methods.append(Method("hf-assisted", draft_name, hf(draft), baseline="hf-generate"))
        if self_draft is not None:
            methods.append(Method("hf-assisted", "self", hf(self_draft), baseline="hf-generate"))
    models = {draft_name: draft} | ({"self": self_draft} if self_draft is not None else {})
    for path in cfg.path_list:
        name = ROW_NAMES[path]
        fast = _compile_arg(cfg, path)
        methods.append(Method(name, "-", ours(path), path=path, baseline=name,
                              counterpart=None if cfg.no_hf else "hf-generate"))
        for label, model in models.items():
            make = lambda model=model, label=label: DraftModelDrafter(model, name=label)
            counterpart = None if cfg.no_hf else f"hf-assisted ({label})"
            methods.append(Method(name, label, ours(path, make), path=path, baseline=name, counterpart=counterpart))
        for label, (make, k) in heads.items():
            methods.append(Method(name, label, ours(path, make, k), path=path, baseline=name))
    return methods


def count_forwards(model, fn):
    """Runs `fn()` and counts `model`'s forward calls (warm-up only: hooks cost time)."""
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        return fn(), calls[0]
    finally:
        handle.remove()


def bench(cfg: BenchConfig, methods: list[Method], prompts, target, device, curves: CostCurves) -> None:
    # Warm-up: every method once (allocator, kernels, HF's lazy setup, compilation).
    for m in methods:
        started = time.perf_counter()
        if m.path is None:
            _, m.target_forwards = count_forwards(target, lambda: m.run(prompts[0]))
        else:  # compiled forwards never call module hooks: count the decoder's own calls
            _, stats = m.run(prompts[0])
            m.target_forwards = stats.target_calls + int(prompts[0].numel() > 1)  # + the prefill
            m.compile_seconds = stats.compile_seconds
        print(f"  warm-up {m.key}: {time.perf_counter() - started:.1f} s"
              + (f" (compiling {m.compile_seconds:.1f} s)" if m.compile_seconds else ""), file=sys.stderr, flush=True)
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
        curves.measure()
        print(
            f"  repeat {r + 1}/{cfg.repeats}: "
            + ", ".join(f"{m.key} {m.tok_per_s[-1]:.1f}" for m in methods)
            + " tok/s",
            file=sys.stderr,
            flush=True,
        )
    while curves.rounds < cfg.curve_repeats:
        curves.measure()


# --------------------------------------------------------------------------- costs


class CostCurves:
    """v(n) per path: seconds of one target forward over n tokens with `context` tokens cached,
    and the draft model's one-token step d(1). Set up (and compiled) before the runs; each
    `measure()` round times a block of consecutive calls per (path, model, width), the blocks
    in rotating order, and `bench` runs one round after every decoding repeat, so that the
    costs and the runs see the same load. `result()`: medians over the rounds."""

    def __init__(self, cfg: BenchConfig, target, draft, context: int, room: int, device):
        self.cfg, self.context, self.device = cfg, context, device
        widths = cfg.curve_widths
        gen = torch.Generator().manual_seed(cfg.seed + 2)
        vocab = min(target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0])
        self.ctx = torch.randint(3, vocab, (1, context), generator=gen).to(device)
        self.probes = {n: torch.randint(3, vocab, (1, n), generator=gen).to(device) for n in widths}
        self.jobs, self.compile_seconds = [], {}
        for path in cfg.path_list:
            for role, model, ns in (("target", target, widths), ("draft", draft, [1])):
                # The static caches `generate` uses (shared compiled widths), sized for the whole
                # bench at once: growing later would recompile every width.
                capacity = None if path == "eager" else capacity_for(max(room, context + max(ns)))
                mode = cfg.compile_mode if path == "compiled" else False
                if capacity is not None:
                    seconds = model_cache(model, role, 1, capacity, mode).warm_up(ns)
                    self.compile_seconds[path] = self.compile_seconds.get(path, 0.0) + seconds
                self.jobs += [(path, role, (model, capacity, mode), n) for n in ns]
        self.times = {(path, role, n): [] for path, role, _, n in self.jobs}
        self.rounds = 0

    @torch.inference_mode()
    def measure(self) -> None:
        caches, positions = {}, torch.arange(self.context + max(self.probes), device=self.device)[None]
        for _, role, (model, capacity, mode), _ in self.jobs:  # `generate` ran on the shared caches since
            if (role, capacity) not in caches:
                kv = caches[(role, capacity)] = model_cache(model, role, 1, capacity, mode)
                kv.forward(model, self.ctx, positions[:, : self.context])
                kv.commit_spans(self.context)
        shift = self.rounds % len(self.jobs)
        for path, role, (model, capacity, _), n in self.jobs[shift:] + self.jobs[:shift]:
            kv = caches[(role, capacity)]
            # A block of consecutive calls, as in decoding (the model's weights and the
            # allocator's blocks stay warm); single calls interleaved across models and paths
            # measured up to 1.6x slower than the same forward inside a decode.
            block = []
            for _ in range(CURVE_BLOCK + 1):
                synchronize(self.device)
                t0 = time.perf_counter()
                kv.forward(model, self.probes[n], positions[:, self.context : self.context + n])
                synchronize(self.device)
                block.append(time.perf_counter() - t0)
                kv.commit_spans(n, None, [0])  # kept by no row: cut again
            self.times[(path, role, n)].append(statistics.median(block[1:]))  # the first call warms up
        self.rounds += 1

    def result(self) -> dict:
        """{"verify": {path: {n: s}}, "draft_step": {path: s}, "compile_seconds": {path: s}}."""
        paths, widths = self.cfg.path_list, self.cfg.curve_widths
        return {
            "verify": {p: {n: statistics.median(self.times[(p, "target", n)]) for n in widths} for p in paths},
            "draft_step": {p: statistics.median(self.times[(p, "draft", 1)]) for p in paths},
            "compile_seconds": self.compile_seconds,
            "rounds": self.rounds,
            "context": self.context,
        }


def interpolate(curve: dict[int, float], n: float) -> float:
    """v(n) by linear interpolation between measured widths (extrapolated past the ends)."""
    xs = sorted(curve)
    i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return curve[x0] + (curve[x1] - curve[x0]) * (n - x0) / (x1 - x0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- report


def spec_costs(m: Method, costs: dict) -> dict | None:
    """c, the mean tokens fed per call and the analytic speedup of a speculative row."""
    st = m.stats
    if m.path is None or st is None or not st.num_draft_tokens or not st.target_calls:
        return None
    v = costs["verify"][m.path]
    fed = 1 + sum(st.proposed) / st.target_calls  # last token + the proposal, per call
    draft_call = st.drafter_seconds / st.target_calls
    analytic = st.tau * v[1] / (draft_call + interpolate(v, fed))
    return {
        "c": st.drafter_seconds / max(1, sum(st.proposed)) / v[1],
        "draft_ms_per_call": 1000 * draft_call,
        "fed_per_call": fed,
        "verify_ratio": interpolate(v, fed) / v[1],
        "analytic_speedup": analytic,
    }


def report(cfg: BenchConfig, methods: list[Method], costs: dict, header: str, top1: float) -> dict:
    by_key = {m.key: m for m in methods}
    ref = by_key.get("hf-generate") or by_key[f"{ROW_NAMES[cfg.path_list[0]]}"]
    eager = by_key.get("draftsmith")
    rows, warnings, results = [], [], {}
    for m in methods:
        diffs = {i: first_difference(ref.outputs[i], out) for i, out in m.outputs.items()}
        diffs = {i: d for i, d in diffs.items() if d is not None}
        same = "ref" if m is ref else ("yes" if not diffs else f"NO ({len(diffs)}/{len(m.outputs)})")
        if diffs:
            i, d = min(diffs.items(), key=lambda kv: kv[1])
            warnings.append(
                f"| WARNING | {m.key} | greedy output differs from {ref.key} on {len(diffs)}/"
                f"{len(m.outputs)} prompts (first at new token {d} of prompt {i}) | | | | | | | | | |"
            )
        vs_hf = by_key[m.counterpart].median if m.counterpart in by_key else None
        vs_base = by_key[m.baseline].median if m.baseline else None
        vs_eager = eager.median if eager is not None and m.path is not None else None
        st, sc = m.stats, spec_costs(m, costs)
        measured = m.median / vs_base if vs_base and m.baseline != m.key else None
        rows.append(
            "| {} | {} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                m.name,
                m.draft,
                m.median,
                f"{m.median / vs_hf:.2f}x" if vs_hf else "",
                f"{measured:.2f}x" if measured else "",
                f"{m.median / vs_eager:.2f}x" if vs_eager and m is not eager else "",
                f"{st.alpha:.3f}" if st and st.num_draft_tokens else "",
                f"{st.tau:.2f}" if st else "",
                f"{sc['c']:.2f}" if sc else "",
                f"{sc['analytic_speedup']:.2f}x ({measured / sc['analytic_speedup']:.0%})" if sc and measured else "",
                m.target_forwards,
                same,
            )
        )
        results[m.key] = {
            "path": m.path,
            "tok_per_s": m.tok_per_s,
            "median_tok_per_s": m.median,
            "seconds": m.seconds,
            "tokens": m.tokens,
            "ratio_vs_hf_counterpart": m.median / vs_hf if vs_hf else None,
            "ratio_vs_target_only": m.median / vs_base if vs_base else None,
            "ratio_vs_eager_target_only": m.median / vs_eager if vs_eager else None,
            "target_forwards_per_run": m.target_forwards,
            "compile_seconds": m.compile_seconds,
            "greedy_equal_to_reference": not diffs,
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
        if sc is not None:
            results[m.key].update(sc)

    print(f"\n{header}\n")
    print(
        "| method | draft | tok/s | vs HF counterpart | vs target-only | vs eager target-only | alpha | tau "
        "| c | analytic (measured share) | target fwd/run | greedy = ref |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows + warnings))
    print(
        f"\ntok/s: median over repeats. vs HF counterpart: over hf-generate / hf-assisted (same draft, "
        "same K). vs target-only: over the target-only row of the same path. alpha: conditional "
        "acceptance over reached positions; tau: tokens per target call, counting the bonus/correction "
        "token (plain decoding = 1.00). c: drafting time per drafted token / v(1) of the same path. "
        "analytic: tau * v(1) / (drafting time per call + v(tokens fed per call)), and the measured "
        f"speedup as a share of it. target fwd/run: target forward calls in one warm-up run, prefill "
        f"included. greedy = ref: the tokens equal {ref.key}'s."
    )
    if cfg.target is None:
        print(
            f"Random weights: lm_head scaled x{cfg.head_scale:g} so distributions are peaked "
            f"(mean top-1 probability {top1:.2f} on the prompts); acceptance of a truncated random "
            "model says nothing about a trained draft."
        )

    # Costs: the verify curve and the draft step, per path.
    widths = cfg.curve_widths
    print("\nVerify-cost curve v(n) / v(1) (one target forward over n tokens; v(1) in ms):\n")
    print("| path | v(1) ms | " + " | ".join(f"n={n}" for n in widths[1:]) + " | draft d(1) ms | c_step = d(1)/v(1) | compile s |")
    print("|---|---:|" + "---:|" * (len(widths) - 1) + "---:|---:|---:|")
    for path in cfg.path_list:
        v = costs["verify"][path]
        print(
            f"| {path} | {1000 * v[1]:.2f} | "
            + " | ".join(f"{v[n] / v[1]:.2f}" for n in widths[1:])
            + f" | {1000 * costs['draft_step'][path]:.2f} | {costs['draft_step'][path] / v[1]:.2f} | "
            + f"{costs['compile_seconds'].get(path, 0.0):.0f} |"
        )
    spec_rows = [(m, spec_costs(m, costs)) for m in methods]
    spec_rows = [(m, sc) for m, sc in spec_rows if sc is not None]
    if spec_rows:
        print(
            "\nPer target call, in the runs: tokens fed, drafting time, target time (forward and "
            "acceptance), and the curve's v(fed) (ms):\n"
        )
        print("| method | draft | fed | drafting | target (in run) | v(fed) (curve) | c | analytic | measured |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for m, sc in spec_rows:
            st, v = m.stats, costs["verify"][m.path]
            print(
                f"| {m.name} | {m.draft} | {sc['fed_per_call']:.1f} | {sc['draft_ms_per_call']:.2f} | "
                f"{1000 * st.target_seconds / st.target_calls:.2f} | {1000 * interpolate(v, sc['fed_per_call']):.2f} | "
                f"{sc['c']:.2f} | {sc['analytic_speedup']:.2f}x | {m.median / by_key[m.baseline].median:.2f}x |"
            )
    compile_total = {p: sum(m.compile_seconds for m in methods if m.path == p) for p in cfg.path_list}
    if any(compile_total.values()):
        print(
            "\nCompilation (warm-up, outside every timed run): "
            + ", ".join(f"{p} {s:.0f} s" for p, s in compile_total.items() if s)
            + f" for the decodes, plus the curve's widths above (mode {cfg.compile_mode})."
        )

    verdicts = {}
    print("\nGoals:")

    def goal(name, value, target, met_if_ge=True, note=""):
        met = value >= target if met_if_ge else value <= target
        verdicts[name] = {"value": value, "goal": target, "met": met}
        sign = ">=" if met_if_ge else "<="
        print(f"- {name} = {value:.2f} (goal {sign} {target:.2f}): {'met' if met else 'NOT met'}{note}")

    if not cfg.no_hf and eager is not None:
        goal("draftsmith / hf-generate", eager.median / by_key["hf-generate"].median, 1.00)
        for m in methods:
            if m.path == "eager" and m.counterpart in by_key and m.draft != "-":
                note = " (overhead check: the issue's goal is on the draft pair)" if m.draft == "self" else ""
                goal(f"{m.key} / {m.counterpart}", m.median / by_key[m.counterpart].median, 1.25, note=note)
    if eager is not None:
        for path in ("static", "compiled"):
            if ROW_NAMES[path] in by_key:
                goal(f"{ROW_NAMES[path]} / draftsmith (target-only)", by_key[ROW_NAMES[path]].median / eager.median, 1.5)
    if "compiled" in cfg.path_list:
        draft_label = f"trunc-{cfg.draft_layers}" if cfg.draft is None else "draft"
        sc = spec_costs(by_key[f"draftsmith-compiled ({draft_label})"], costs)
        if sc is not None:
            goal("c of the draft model on the compiled path", sc["c"], 0.25, met_if_ge=False)
    spec = [m for m in methods if m.path is not None and m.draft not in ("-", "self") and m.stats is not None]
    if spec:
        best = max(spec, key=lambda m: m.median / by_key[m.baseline].median)
        measured = best.median / by_key[best.baseline].median
        goal(f"best drafter {best.key} / its path's target-only", measured, 1.5)
        sc = spec_costs(best, costs)
        if sc is not None:
            goal(f"{best.key}: measured / analytic speedup", measured / sc["analytic_speedup"], 0.9)
    for m in spec:
        st = m.stats
        print(
            f"- {m.key}: alpha per position "
            f"{[round(a, 3) if a is not None else None for a in st.alpha_per_position]}"
        )
    return {"results": results, "costs": costs, "goals": verdicts}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    device = torch.device(cfg.device)
    if device.type == "cpu" and cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    target, draft, self_draft, tokenizer, what = load_models(cfg)
    heads = load_heads(cfg, target)
    vocab = target.get_output_embeddings().weight.shape[0]
    prompts = make_prompts(cfg, tokenizer, vocab)
    top1 = mean_top1(target, prompts, device)
    methods = build_methods(cfg, target, draft, self_draft, heads)
    print(f"bench: {what}", file=sys.stderr)
    started = time.perf_counter()
    context = round(statistics.mean(p.numel() for p in prompts)) + cfg.max_new_tokens // 2  # mid-decode
    room = max(p.numel() for p in prompts) + cfg.max_new_tokens + 64  # the widest call: a tree of < 64 nodes
    curves = CostCurves(cfg, target, draft, context, room, device)
    bench(cfg, methods, prompts, target, device, curves)
    costs = curves.result()
    header = (
        f"## Decoder bench: {what}. Greedy, batch 1, K={cfg.num_draft_tokens}, "
        f"{cfg.max_new_tokens} new tokens x {len(prompts)} prompts, median of {cfg.repeats} repeats; "
        f"paths {cfg.paths} (compile mode {cfg.compile_mode}); "
        f"{cfg.device} {cfg.dtype}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    summary = report(cfg, methods, costs, header, top1)
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
