"""The decoder benchmark behind `scripts/bench_decoder.py` (its docstring says what it measures).

    cfg = BenchConfig(paths="eager,static", max_new_tokens=32)
    summary = run_bench(cfg)  # prints the tables; the dict is what --out writes

Greedy, batch 1, one process: Hugging Face `generate` (plain and assisted) and draftsmith's
`generate` on its paths (eager, static cache, compiled) for target-only and every drafter.
Methods run interleaved, in an order that rotates per prompt, so load from other work hits
them alike; the cost curves (`CostCurves`, through `measure_verify_curve`) are measured in
rounds between the decoding repeats, so costs and runs see the same load.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import transformers

from draftsmith.decoding import DecodeStats, DraftModelDrafter, PromptLookupDrafter, generate, synchronize
from draftsmith.decoding.compiler import COMPILE_MODES
from draftsmith.decoding.kv import capacity_for, model_cache
from draftsmith.decoding.linears import cpu_linears, in_force
from draftsmith.decoding.loop import DEFAULT_NUM_DRAFT_TOKENS
from draftsmith.distill.chat import resolve_chat_template
from draftsmith.eval.bench_report import ROW_NAMES, report
from draftsmith.eval.drafter_specs import load_checked, parse_drafters
from draftsmith.eval.evaluator import load_prompts
from draftsmith.eval.sweep import measure_verify_curve, typical_context
from draftsmith.heads.draft import DraftBuildError, draft_by_truncation, load_draft
from draftsmith.heads.models import DTYPE_ALIASES, DTYPES, load_causal_lm, load_tokenizer
from draftsmith.heads.registry import RegistryError, RowOptions, get_method
from draftsmith.heads.toy import tiny_model

PATHS = ("eager", "static", "compiled")
CURVE_BLOCK = 5  # consecutive timed forwards per (path, width) and repeat of the cost curve

# Used when the target folder has a tokenizer; otherwise prompts are random token ids.
TEXT_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
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
    """The flags of `scripts/bench_decoder.py`: the comment beside a field is its --help."""

    target: str | None = None  # HF folder; None = a random Llama built in-process
    draft: str | None = None  # HF folder; None = the target truncated to `draft_layers`
    draft_layers: int = 1  # 1 of 4 layers: c ~ 0.3-0.4 on CPU, where per-forward overhead dominates
    drafter: tuple[str, ...] = ()  # KIND[:NAME]=DIR of a trained drafter (repeat it; needs --target): its rows
    tree: tuple[str, ...] = ()  # KIND=SPEC: that kind's tree rows (default: the method's default_tree); KIND= : chains
    tree_nodes: int = 16  # nodes of an "auto" tree (built from the heads' recorded accuracies)
    prompt_lookup: bool = False  # add prompt-lookup rows (n-gram copy from the context, no model)
    prompt_file: str | None = None  # JSONL prompts ("prompt" text or "input_ids"); None = the built-in prompts
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # K, the same for every chain (trees: their own depth)
    max_new_tokens: int = 128  # prefill stays a small share of a run
    prompts: int = 4  # prompts per repeat, every method runs each of them
    prompt_len: int = 32  # random-id prompts only
    repeats: int = 3  # median of >= 3 runs (REFERENCE.md, metric conventions)
    paths: str = "eager,static,compiled"  # draftsmith decoding paths to compare
    compile_mode: str = "default"  # torch.compile mode of the compiled path: default | max-autotune
    curve: str = "1,2,3,4,5,6,8,12,16,24,32"  # widths n of the verify-cost curve v(n); each compiles (compiled path)
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
        if self.tree_nodes < 1:
            raise ValueError(f"--tree-nodes must be >= 1, got {self.tree_nodes}")
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (a median of fewer runs is noise), got {self.repeats}")
        self.drafter, self.tree = tuple(self.drafter or ()), tuple(self.tree or ())
        drafters = parse_drafters(self.drafter)  # a SpecError (a ValueError) names the flag and the value
        if self.draft is not None and self.target is None:
            raise ValueError("--draft needs --target (the random target has no matching draft)")
        if drafters and self.target is None:
            raise ValueError(f"--drafter {self.drafter[0]} needs --target (the random target has no matching head)")
        for flag, path in [("--target", self.target), ("--draft", self.draft)] + [
            (f"--drafter {d.kind}", d.folder) for d in drafters
        ]:
            if path is not None and not os.path.isdir(path):
                raise ValueError(f"{flag} {path!r} is not a folder")
        for kind in self.tree_specs():  # a KIND that decodes no trees is refused there
            if kind not in {d.kind for d in drafters}:
                raise ValueError(f"--tree {kind}=...: give a drafter of that kind (--drafter {kind}=DIR)")
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

    @property
    def path_list(self) -> list[str]:
        return [p.strip() for p in self.paths.split(",") if p.strip()]

    @property
    def curve_widths(self) -> list[int]:
        return sorted({int(n) for n in self.curve.split(",") if n.strip()})

    def tree_specs(self) -> dict[str, str | None]:
        """{kind: tree spec} of the `--tree`s; None (`--tree KIND=`) = chains only."""
        specs = {}
        for value in self.tree:
            kind, sep, spec = value.partition("=")
            if not sep:
                raise ValueError(f"--tree {value!r}: expected KIND=SPEC (KIND= : no tree rows)")
            try:
                method = get_method(kind.strip())
            except RegistryError as err:
                raise ValueError(f"--tree {value}: {err}") from None
            if method.tree_spec is None:
                raise ValueError(f"--tree {value!r}: {method.title} decode chains only")
            specs[method.kind] = spec.strip() or None
        return specs

    @property
    def draft_label(self) -> str:
        """The draft model's name in the rows."""
        return f"trunc-{self.draft_layers}" if self.draft is None else "draft"


# ----------------------------------------------------------------------------- models


def random_target(cfg: BenchConfig):
    """The random Llama of the flags --hidden/--layers/--vocab/--head-scale (`heads.toy`): one
    attention head per 64 channels, a key/value head per 128, LlamaConfig's initialisation."""
    return tiny_model(
        "llama",
        seed=cfg.seed,
        head_scale=cfg.head_scale,
        hidden=cfg.hidden,
        layers=cfg.layers,
        vocab=cfg.vocab,
        heads=max(1, cfg.hidden // 64),
        kv_heads=max(1, cfg.hidden // 128),
        intermediate=3 * cfg.hidden,
        max_positions=4096,
        init=0.02,
    )


def load_models(cfg: BenchConfig):
    """Returns target, draft, self-draft (or None), tokenizer (or None), a description."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    tokenizer = None
    if cfg.target is None:
        target = random_target(cfg)
        what = (
            f"random Llama target (hidden {cfg.hidden} x {cfg.layers} layers, vocab {cfg.vocab}, "
            f"lm_head x{cfg.head_scale:g} for peaked distributions)"
        )
    else:
        target = load_causal_lm(cfg.target, device=device, dtype=dtype, role="target")
        tokenizer = load_tokenizer(cfg.target)  # optional: without one, prompts are random ids
        what = f"target {cfg.target}"
    target.to(device=device, dtype=dtype)
    if cfg.draft is None:
        try:
            draft = draft_by_truncation(target, cfg.draft_layers)
        except DraftBuildError as err:
            raise ValueError(f"--draft-layers {cfg.draft_layers}: {err}") from None
        what += f"; draft = the target's first {cfg.draft_layers} layers"
    else:
        draft = load_draft(cfg.draft, target, target_tokenizer=tokenizer, device=device, dtype=dtype)
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
    """name -> (drafter factory, K) for the drafters without a model of their own: prompt
    lookup and the trained drafters of --drafter (their method's rows: a chain, and a tree unless
    `--tree KIND=` says none). A chain row drafts min(K, what it can); a tree row its own depth."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    heads = {}
    if cfg.prompt_lookup:
        heads["prompt-lookup"] = (PromptLookupDrafter, cfg.num_draft_tokens)  # no model: no fast path
    trees = cfg.tree_specs()
    for drafter in parse_drafters(cfg.drafter):
        method = drafter.method
        loaded = load_checked(drafter, target, device, dtype)
        tree = trees.get(method.kind, method.default_tree) if method.tree_spec else None
        options = RowOptions(tree=tree, tree_nodes=cfg.tree_nodes)
        try:
            rows = method.rows(loaded, target, drafter.name, options)
        except ValueError as err:
            if method.kind in trees:  # a tree asked for: its error is the user's
                raise ValueError(f"--tree {method.kind}={tree}: {err}") from None
            print(f"bench: {drafter.folder}: {err}: no tree row", file=sys.stderr)
            options = RowOptions(tree_nodes=cfg.tree_nodes)
            rows = method.rows(loaded, target, drafter.name, options)
        for row, made in rows.items():
            depth, k = made.max_depth, cfg.num_draft_tokens
            k = depth if getattr(made, "tree", None) is not None else min(k, depth) if depth else k
            # a fresh drafter per run, as the other rows get
            make = lambda loaded=loaded, name=drafter.name, options=options, row=row, method=method: (  # noqa: E731
                method.rows(loaded, target, name, options)[row]
            )
            heads[row] = (make, k)
    return heads


def make_prompts(cfg: BenchConfig, tokenizer, vocab_size: int) -> list[torch.Tensor]:
    if cfg.prompt_file is not None:
        # conversations go through the target's chat template; plain prompts are read as they are
        return load_prompts(
            cfg.prompt_file, tokenizer, limit=cfg.prompts, template=resolve_chat_template("auto", tokenizer)
        )
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
    draft: str  # "-" (target only), "trunc-<layers>" / "draft", "self", a --drafter's rows (NAME-chain, ...)
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


def path_options(cfg: BenchConfig, path: str) -> dict:
    """`generate`'s keywords for one of draftsmith's paths."""
    return {"eager": {}, "static": {"static_cache": True}, "compiled": {"compile": cfg.compile_mode}}[path]


def build_methods(cfg: BenchConfig, target, draft, self_draft, heads) -> list[Method]:
    K, M = cfg.num_draft_tokens, cfg.max_new_tokens

    def hf(assistant=None):
        def run(ids):
            ids = ids[None].to(target.device)
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=M, do_sample=False, assistant_model=assistant
            )
            return out[0, ids.shape[1] :].tolist(), None

        return run

    def ours(path, make_drafter=lambda: None, k=K):
        options = path_options(cfg, path)

        def run(ids):
            gen = generate(target, make_drafter(), ids, max_new_tokens=M, num_draft_tokens=k, **options)
            return gen.tokens, gen.stats

        return run

    methods = []
    if not cfg.no_hf:
        methods.append(Method("hf-generate", "-", hf(), baseline="hf-generate"))
        methods.append(Method("hf-assisted", cfg.draft_label, hf(draft), baseline="hf-generate"))
        if self_draft is not None:
            methods.append(Method("hf-assisted", "self", hf(self_draft), baseline="hf-generate"))
    models = {cfg.draft_label: draft} | ({"self": self_draft} if self_draft is not None else {})
    for path in cfg.path_list:
        name = ROW_NAMES[path]
        counterpart = None if cfg.no_hf else "hf-generate"
        methods.append(Method(name, "-", ours(path), path=path, baseline=name, counterpart=counterpart))
        for label, model in models.items():
            make = lambda model=model, label=label: DraftModelDrafter(model, name=label)  # noqa: E731
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


def time_methods(cfg: BenchConfig, methods: list[Method], prompts, target, curves: CostCurves) -> None:
    """A warm-up run of every method, then `cfg.repeats` timed repeats over every prompt, the
    methods' order rotating per prompt, and a round of `curves` after each repeat."""
    device = torch.device(cfg.device)
    # Warm-up: every method once (allocator, kernels, HF's lazy setup, compilation).
    for m in methods:
        started = time.perf_counter()
        if m.path is None:
            _, m.target_forwards = count_forwards(target, lambda m=m: m.run(prompts[0]))
        else:  # compiled forwards never call module hooks: count the decoder's own calls
            _, stats = m.run(prompts[0])
            m.target_forwards = stats.target_calls + int(prompts[0].numel() > 1)  # + the prefill
            m.compile_seconds = stats.compile_seconds
        compiling = f" (compiling {m.compile_seconds:.1f} s)" if m.compile_seconds else ""
        print(f"  warm-up {m.key}: {time.perf_counter() - started:.1f} s{compiling}", file=sys.stderr, flush=True)
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
        speeds = ", ".join(f"{m.key} {m.tok_per_s[-1]:.1f}" for m in methods)
        print(f"  repeat {r + 1}/{cfg.repeats}: {speeds} tok/s", file=sys.stderr, flush=True)
    while curves.rounds < cfg.curve_repeats:
        curves.measure()


# --------------------------------------------------------------------------- costs


class CostCurves:
    """v(n) per path: seconds of one target forward over n tokens at a mid-decode cache length
    (mean prompt + max_new_tokens / 2 real tokens), and the draft model's one-token step d(1),
    each on the cache its path decodes with. The static caches are sized and compiled before
    the runs; each `measure()` round times, per (path, model, width) in rotating order, a block
    of CURVE_BLOCK consecutive calls after an untimed one (`measure_verify_curve` of one width:
    single calls interleaved across models and paths measured up to 1.6x slower than the same
    forward inside a decode). `result()`: medians over the rounds."""

    def __init__(self, cfg: BenchConfig, target, draft, prompts, room: int):
        self.cfg, widths = cfg, cfg.curve_widths
        # The mid-decode context and, after it, the widest probe: real tokens of the prompts.
        self.tokens = typical_context(prompts, cfg.max_new_tokens + 2 * widths[-1], widths[-1] + 1)
        self.context = self.tokens.numel() - widths[-1]
        self.jobs, self.compile_seconds = [], {}
        for path in cfg.path_list:
            for role, model, ns in (("target", target, widths), ("draft", draft, [1])):
                # The static caches `generate` uses (shared compiled widths), sized for the whole
                # bench at once: growing later would recompile every width.
                capacity = None if path == "eager" else capacity_for(max(room, self.context + max(ns)))
                mode = cfg.compile_mode if path == "compiled" else False
                if capacity is not None:
                    with cpu_linears(model):  # compiled as a decode runs it
                        seconds = model_cache(model, role, 1, capacity, mode).warm_up(ns)
                    self.compile_seconds[path] = self.compile_seconds.get(path, 0.0) + seconds
                self.jobs += [(path, role, model, capacity, mode, n) for n in ns]
        self.times = {(path, role, n): [] for path, role, _, _, _, n in self.jobs}
        self.rounds = 0

    def measure(self) -> None:
        shift = self.rounds % len(self.jobs)
        for path, role, model, capacity, mode, n in self.jobs[shift:] + self.jobs[:shift]:
            tokens = self.tokens[: self.context + n]  # n probes after `context` cached tokens
            curve = measure_verify_curve(
                model, tokens, [n], repeats=CURVE_BLOCK, role=role, capacity=capacity, compile=mode
            )
            self.times[(path, role, n)].append(curve[n])
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


# ----------------------------------------------------------------------------- the bench


def run_bench(cfg: BenchConfig) -> dict:
    """Load, time every method and the cost curves, print the tables, write `cfg.out` (JSON,
    through a temporary name); returns what the JSON holds."""
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
    room = max(p.numel() for p in prompts) + cfg.max_new_tokens + 64  # the widest call: a tree of < 64 nodes
    curves = CostCurves(cfg, target, draft, prompts, room)
    time_methods(cfg, methods, prompts, target, curves)
    costs = curves.result()
    header = (
        f"## Decoder bench: {what}. Greedy, batch 1, K={cfg.num_draft_tokens}, "
        f"{cfg.max_new_tokens} new tokens x {len(prompts)} prompts, median of {cfg.repeats} repeats; "
        f"paths {cfg.paths} (compile mode {cfg.compile_mode}); "
        f"{cfg.device} {cfg.dtype}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, linears {in_force(cfg.device, DTYPES[cfg.dtype])}"
    )
    summary = report(cfg, methods, costs, header, top1)
    print(f"\n(bench time {time.perf_counter() - started:.0f} s)")
    summary = {"config": dataclasses.asdict(cfg), "header": header, "mean_top1": top1, **summary}
    if cfg.out:
        tmp = cfg.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, cfg.out)  # never a half-written JSON
        print(f"wrote {cfg.out}")
    return summary
