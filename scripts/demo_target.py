"""The embedded default target: a small Llama trained here on the Python standard library.

    python scripts/build_demo_target.py --preset cpu          # or: draftsmith build-target
    draftsmith demo                                            # builds it when not cached

A build, top to bottom:
  1. corpus  - the running interpreter's stdlib `.py` sources (tests, idlelib, lib2to3,
               turtledemo, site-packages and the data modules encodings/ and pydoc_data/
               excluded), sorted by path; every `heldout_every`-th file is held out;
  2. tokenizer - byte-level BPE trained with `tokenizers` on the training files, saved as an
               HF tokenizer (<pad>, <s>, </s>);
  3. target  - a Llama trained from scratch (`draftsmith.train.lm`);
  4. draft   - an independent smaller Llama, same data, same tokenizer (the classic
               "small model of the same family" baseline of speculative sampling);
  5. prompts - code prefixes (signature / docstring / first body line, with the lines before
               them as context): `prompts/train.jsonl` from training files,
               `prompts/heldout.jsonl` from held-out files;
  6. quality - held-out perplexity, greedy samples, acceptance of a self-draft (must be 1.0)
               and of the small draft at greedy and T = 1; into MODEL_CARD.md;
  7. manifest.json, written last: preset, a hash of the config and the corpus file list, and
               a sha256 per file. A folder without a valid manifest is never used.

The cache lives in `--cache-dir`, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith, one
folder per preset (`demo-target-<preset>`). A build is written to a temporary folder beside
it and renamed into place, so an interrupted build leaves no folder that could be loaded.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CACHE_ENV = "DRAFTSMITH_CACHE"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1  # bump when the layout or the build recipe changes: old caches rebuild
# Tests (and idlelib, lib2to3, turtledemo: apps and demos) are excluded as in most code corpora;
# `encodings` (13% of the bytes: codec tables of hex literals) and `pydoc_data` (7%: English
# help text in one string) are data, not code, and only teach the target to predict tables.
EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data",
}  # fmt: skip
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


class DemoTargetError(RuntimeError):
    """A demo target that cannot be built or loaded; the message says why and what to do."""


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def __post_init__(self):
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) < 1:
            raise ValueError(f"model shape sizes must be >= 1: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must divide by heads {self.heads}, heads by kv_heads {self.kv_heads}")


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    target: ModelShape
    draft: ModelShape
    target_steps: int
    draft_steps: int
    batch_size: int
    seq_len: int
    target_lr: float
    draft_lr: float
    warmup_steps: int
    bf16: bool
    max_corpus_bytes: int | None = None  # None = the whole stdlib
    heldout_every: int = 20  # 1 file in 20 held out (~5% of the text)
    num_train_prompts: int = 2000
    num_heldout_prompts: int = 200
    prompt_context_chars: int = 300  # lines before the def kept as context (<= ~95 tokens)
    prompt_max_head_chars: int = 300  # prompt <= ~190 tokens: + 64 new tokens fits in seq_len 256
    quality_prompts: int = 8  # held-out prompts for the acceptance checks in the model card
    quality_new_tokens: int = 48
    quality_k: int = 3

    def __post_init__(self):
        checks = {
            "vocab_size": self.vocab_size >= 300,  # 256 bytes + specials + some merges
            "target_steps": self.target_steps >= 1,
            "draft_steps": self.draft_steps >= 1,
            "batch_size": self.batch_size >= 1,
            "seq_len": self.seq_len >= 16,
            "heldout_every": self.heldout_every >= 2,
            "warmup_steps": 0 <= self.warmup_steps <= min(self.target_steps, self.draft_steps),
            "target_lr": self.target_lr > 0,
            "draft_lr": self.draft_lr > 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"preset {self.name!r}: invalid {', '.join(bad)}")


PRESETS: dict[str, Preset] = {
    # 2 CPU cores, <= 15 min in all (measured: see README "draftsmith demo").
    "cpu": Preset(
        name="cpu",
        # 4096, not 8192: 3.24 vs 3.49 bytes/token (7% more tokens) but half the embedding and
        # output head, which are ~1/3 of the target's and ~2/3 of the draft's FLOPs per token:
        # more tokens seen in the same budget and a cheaper draft.
        vocab_size=4096,
        target=ModelShape(hidden=256, layers=4, heads=4, kv_heads=4, intermediate=688),  # 4.2M: the largest that sees ~1 epoch in 10 min
        draft=ModelShape(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=344),  # ~0.9M: cheap, but c ~ 0.5 on CPU (fixed per-call cost)
        target_steps=600,  # 600 * 16 * 256 = 2.5M tokens (~0.75 epoch): ~7 min at ~5.7k tok/s on 2 free cores
        draft_steps=500,  # 2M tokens; the small draft trains ~3x faster per token
        batch_size=16,
        seq_len=256,  # prompts (<= ~150 tokens) + 64-96 new tokens fit in the trained context
        target_lr=1e-3,
        draft_lr=2e-3,  # smaller model, higher lr
        warmup_steps=40,
        bf16=True,  # ~1.7x faster than fp32 on this CPU (AMX)
    ),
    # One H200, <= 5 min: ~105M parameters. The stdlib is ~3M tokens, so this sees it ~6 times.
    "gpu": Preset(
        name="gpu",
        vocab_size=8192,  # on a GPU the head is cheap; 8k packs 8% more text per token
        target=ModelShape(hidden=768, layers=14, heads=12, kv_heads=4, intermediate=2048),  # ~105M
        draft=ModelShape(hidden=256, layers=4, heads=4, kv_heads=4, intermediate=688),  # ~5M: c << 0.1 in FLOPs
        target_steps=600,  # 600 * 64 * 512 = 20M tokens (~6 epochs: more overfits the stdlib)
        draft_steps=600,
        batch_size=64,
        seq_len=512,
        target_lr=6e-4,  # GPT-2-small-like
        draft_lr=1e-3,
        warmup_steps=60,
        bf16=True,
    ),
    # Tests and `draftsmith demo --quick`: seconds, a flat model; exercises the pipeline only.
    "micro": Preset(
        name="micro",
        vocab_size=512,
        target=ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=128),
        draft=ModelShape(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64),
        target_steps=60,
        draft_steps=40,
        batch_size=8,
        seq_len=128,
        target_lr=3e-3,
        draft_lr=3e-3,
        warmup_steps=5,
        bf16=False,  # at this size autocast casts cost more than they save
        max_corpus_bytes=400_000,  # a few dozen files: tokenizer + training in seconds
        heldout_every=5,  # enough held-out files for prompts from a small corpus
        num_train_prompts=64,
        num_heldout_prompts=32,
        quality_prompts=2,
        quality_new_tokens=12,
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DemoTargetError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    root: Path
    train_files: list[str]  # paths relative to root, posix
    heldout_files: list[str]

    def text(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")

    def fingerprint(self) -> str:
        """Hash of the file list with sizes: a different Python gives a different target."""
        h = hashlib.sha256()
        for split, files in (("train", self.train_files), ("heldout", self.heldout_files)):
            for rel in files:
                h.update(f"{split}:{rel}:{(self.root / rel).stat().st_size}\n".encode())
        return h.hexdigest()

    def num_bytes(self, files: list[str]) -> int:
        return sum((self.root / rel).stat().st_size for rel in files)


def stdlib_corpus(preset: Preset) -> Corpus:
    """The interpreter's stdlib sources, sorted by path; every `heldout_every`-th file is
    held out (so both splits sample all of the library); capped at `max_corpus_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    )
    if preset.max_corpus_bytes is not None:
        kept, total = [], 0
        for rel in files:
            size = (root / rel).stat().st_size
            if size > preset.max_corpus_bytes // 20 or total + size > preset.max_corpus_bytes:
                continue  # no single file dominates a small corpus; keep filling with smaller ones
            kept.append(rel)
            total += size
        files = kept
    if len(files) < 2 * preset.heldout_every:
        raise DemoTargetError(f"found only {len(files)} stdlib .py files under {root}: too few to build a target")
    heldout = [f for i, f in enumerate(files) if i % preset.heldout_every == preset.heldout_every // 2]
    held = set(heldout)
    return Corpus(root, [f for f in files if f not in held], heldout)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Byte-level BPE on the training files, wrapped as an HF fast tokenizer that adds <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator((corpus.text(rel) for rel in corpus.train_files), trainer=trainer)
    # Every sequence starts with <s>, in training and at inference (prompts are tokenized
    # by this same tokenizer), so the model never sees a sequence without it.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=1_000_000
    )


def token_stream(tokenizer, corpus: Corpus, files: list[str]) -> torch.Tensor:
    """All files as one stream: <s> file </s> <s> file </s> ... (int32)."""
    texts = [corpus.text(rel) for rel in files]
    encoded = tokenizer.backend_tokenizer.encode_batch(texts)  # the Rust tokenizer: parallel, fast
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in encoded:
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- prompts


def extract_prompts(corpus: Corpus, files: list[str], limit: int, context_chars: int, max_head_chars: int) -> list[dict]:
    """Code prefixes ending at a function's signature, its docstring or its first body line
    (rotating), preceded by up to `context_chars` of whole lines before the def.

    A prompt ends at the end of a line, without the newline: in byte-level BPE the newline
    and the next line's indentation form one token, which the model should predict itself.
    Functions are taken in file order and thinned evenly to `limit` (deterministic); those
    whose prefix is longer than `max_head_chars` (long docstrings) are skipped."""
    found = []
    for rel in files:
        source = corpus.text(rel)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                found.append((rel, node, lines))
    found.sort(key=lambda t: (t[0], t[1].lineno))
    stride = max(1, len(found) // max(1, limit))
    rows = []
    for rel, node, lines in found[::stride]:
        if len(rows) >= limit:
            break
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body0 = node.body[0]
        has_doc = isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str)
        kind = ("signature", "docstring" if has_doc else "first-line", "first-line")[len(rows) % 3]
        if kind == "signature":
            end = max(node.lineno, body0.lineno - 1)  # 1-based, inclusive
        elif kind == "docstring":
            end = body0.end_lineno
        else:  # the first statement after the docstring, if any
            end = (node.body[1] if has_doc and len(node.body) > 1 else body0).lineno
        head = "".join(lines[first - 1 : end]).rstrip()
        if not head or len(head) > max_head_chars:
            continue
        before = "".join(lines[: first - 1])
        context = before[-context_chars:]
        if len(before) > context_chars and "\n" in context:
            context = context[context.index("\n") + 1 :]  # whole lines only
        rows.append({"prompt": context + head, "file": rel, "line": node.lineno, "kind": kind})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# --------------------------------------------------------------------------- models


def llama_config(shape: ModelShape, preset: Preset, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4 * preset.seq_len,  # trained on seq_len; room for long decodes
        rope_theta=10000.0,
        tie_word_embeddings=True,  # halves the embedding cost of a tiny model
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def new_model(shape: ModelShape, preset: Preset, tokenizer, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama_config(shape, preset, tokenizer), dtype=torch.float32)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- cache


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """--cache-dir, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "draftsmith"


def target_dir(preset: Preset, cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / f"demo-target-{preset.name}"


def build_key(preset: Preset, corpus: Corpus) -> str:
    """What the cached folder must have been built from: recipe version, preset, corpus."""
    blob = json.dumps({"format": FORMAT_VERSION, "preset": asdict(preset), "corpus": corpus.fingerprint()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_cached(folder: Path, key: str) -> str | None:
    """None when `folder` is a complete build for `key`; else why it cannot be used."""
    if not folder.exists():
        return "not built yet"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"{folder} has no {MANIFEST} (an interrupted or foreign build)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        built_key = manifest["build_key"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({err})"
    if built_key != key:
        return f"{folder} was built from another preset, recipe version or Python stdlib"
    for rel, digest in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != digest:
            return f"{path} does not match its checksum (corrupted or edited)"
    return None


def _check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".write-test.", delete=True)
        probe.close()
    except OSError as err:
        raise DemoTargetError(
            f"cache folder {str(root)!r} is not writable ({err.strerror or err}); "
            f"pass --cache-dir DIR or set {CACHE_ENV} to a writable folder"
        ) from None


# --------------------------------------------------------------------------- quality


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


def quality_report(target, draft, tokenizer, heldout_rows: list[dict], preset: Preset) -> dict:
    """The numbers of the model card: samples, self-draft and small-draft acceptance."""
    from draftsmith.eval.runtime.drafters import DraftModelDrafter

    texts = [r["prompt"] for r in heldout_rows[: preset.quality_prompts]]
    prompts = [torch.tensor(tokenizer(t).input_ids) for t in texts]
    opts = dict(k=preset.quality_k, new_tokens=preset.quality_new_tokens)
    return {
        "samples": greedy_samples(target, tokenizer, texts[:3], preset.quality_new_tokens),
        # The target drafting for itself: every draft must be accepted (alpha = 1.0), or
        # the decoder, the cache handling or the drafter is broken.
        "self_draft_greedy": measure_acceptance(target, DraftModelDrafter(target), prompts, temperature=0.0, **opts),
        "small_draft_greedy": measure_acceptance(target, DraftModelDrafter(draft), prompts, temperature=0.0, **opts),
        "small_draft_t1": measure_acceptance(target, DraftModelDrafter(draft), prompts, temperature=1.0, **opts),
    }


# --------------------------------------------------------------------------- build


@dataclass
class DemoTarget:
    """A complete cached build: where its parts are and what its manifest says."""

    folder: Path
    manifest: dict = field(default_factory=dict)

    @property
    def target(self) -> Path:
        return self.folder / "target"

    @property
    def draft(self) -> Path:
        return self.folder / "draft"

    @property
    def train_prompts(self) -> Path:
        return self.folder / "prompts" / "train.jsonl"

    @property
    def heldout_prompts(self) -> Path:
        return self.folder / "prompts" / "heldout.jsonl"

    @property
    def model_card(self) -> Path:
        return self.folder / "MODEL_CARD.md"


def ensure_demo_target(
    preset: str | Preset = "cpu",
    *,
    cache_dir: str | Path | None = None,
    force: bool = False,
    device: torch.device | str | None = None,
    progress: bool = True,
    log=print,
) -> DemoTarget:
    """The cached build for `preset`, built first when missing, stale or corrupt (or `force`)."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    corpus = stdlib_corpus(preset)
    key = build_key(preset, corpus)
    folder = target_dir(preset, cache_dir)
    problem = "--force" if force else check_cached(folder, key)
    if problem is None:
        log(f"using the cached demo target {folder}")
        return DemoTarget(folder, json.loads((folder / MANIFEST).read_text(encoding="utf-8")))
    if folder.exists() and not force:
        log(f"rebuilding the demo target: {problem}")
    _check_writable(folder.parent)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building.", dir=folder.parent))
    try:
        manifest = build_into(tmp, preset, corpus, key, device=device, progress=progress, log=log)
        if folder.exists():  # stale, corrupt or --force: move aside, then delete
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            folder.rename(old / "x")
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(folder)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DemoTargetError(f"building the demo target in {str(folder.parent)!r} failed: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted build leaves nothing behind
        raise
    log(f"built the demo target in {folder}")
    return DemoTarget(folder, manifest)


def build_into(out: Path, preset: Preset, corpus: Corpus, key: str, *, device: torch.device, progress: bool, log=print) -> dict:
    """Every stage of the build into `out`; the manifest is written last."""
    from draftsmith.train.lm import LMTrainConfig, train_lm

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    log(
        f"building the '{preset.name}' demo target on {device}: {len(corpus.train_files)} train / "
        f"{len(corpus.heldout_files)} held-out stdlib files ({corpus.num_bytes(corpus.train_files) / 1e6:.1f} MB train)"
    )
    tokenizer = train_tokenizer(corpus, preset.vocab_size)
    train_ids = token_stream(tokenizer, corpus, corpus.train_files)
    heldout_ids = token_stream(tokenizer, corpus, corpus.heldout_files)
    timings["tokenizer_and_corpus_s"] = time.perf_counter() - t0
    log(
        f"tokenizer: {len(tokenizer)} tokens; {train_ids.numel():,} train / {heldout_ids.numel():,} held-out tokens "
        f"({corpus.num_bytes(corpus.train_files) / train_ids.numel():.2f} bytes/token)"
    )

    t = time.perf_counter()
    train_rows = extract_prompts(corpus, corpus.train_files, preset.num_train_prompts, preset.prompt_context_chars, preset.prompt_max_head_chars)
    heldout_rows = extract_prompts(corpus, corpus.heldout_files, preset.num_heldout_prompts, preset.prompt_context_chars, preset.prompt_max_head_chars)
    if not heldout_rows:
        raise DemoTargetError("no functions found in the held-out files to make prompts from")
    write_jsonl(out / "prompts" / "train.jsonl", train_rows)
    write_jsonl(out / "prompts" / "heldout.jsonl", heldout_rows)
    timings["prompts_s"] = time.perf_counter() - t

    results = {}
    models = {}
    for role, shape, steps, lr, seed in (
        ("target", preset.target, preset.target_steps, preset.target_lr, 0),
        ("draft", preset.draft, preset.draft_steps, preset.draft_lr, 1),  # independent init and data order
    ):
        model = new_model(shape, preset, tokenizer, seed=seed)
        cfg = LMTrainConfig(
            steps=steps,
            batch_size=preset.batch_size,
            seq_len=preset.seq_len,
            lr=lr,
            warmup_steps=preset.warmup_steps,
            bf16=preset.bf16,
            seed=seed,
        )
        log(f"{role}: Llama {shape.hidden}x{shape.layers}, {num_params(model) / 1e6:.2f}M parameters, {steps} steps of {preset.batch_size}x{preset.seq_len} tokens")
        result = train_lm(model, train_ids, heldout_ids, cfg, device=device, desc=f"train {role}", progress=progress)
        timings[f"{role}_training_s"] = result.seconds
        log(
            f"{role}: final train loss {result.final_train_loss:.3f}, held-out perplexity {result.heldout_perplexity:.2f} "
            f"({result.tokens_per_second:,.0f} tok/s{f', {result.num_threads} CPU threads' if device.type == 'cpu' else ''})"
        )
        results[role] = {
            "parameters": num_params(model),
            "shape": asdict(shape),
            "train": {**asdict(cfg), "betas": list(cfg.betas)},
            "tokens_seen": result.tokens_seen,
            "final_train_loss": result.final_train_loss,
            "heldout_loss": result.heldout_loss,
            "heldout_perplexity": result.heldout_perplexity,
            "tokens_per_second": result.tokens_per_second,
            "cpu_threads": result.num_threads if device.type == "cpu" else None,
            "loss_curve": result.losses[:: max(1, len(result.losses) // 50)],
        }
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        models[role] = model

    t = time.perf_counter()
    with cpu_decode_threads(device):
        quality = quality_report(models["target"], models["draft"], tokenizer, heldout_rows, preset)
    timings["quality_checks_s"] = time.perf_counter() - t
    log(
        f"acceptance at K={preset.quality_k}: self-draft {quality['self_draft_greedy']['alpha']:.3f} (must be 1.0), "
        f"small draft greedy {quality['small_draft_greedy']['alpha']:.3f}, T=1 {quality['small_draft_t1']['alpha']:.3f}"
    )

    for role, model in models.items():
        model.save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
    timings["total_s"] = time.perf_counter() - t0
    manifest = {
        "format": FORMAT_VERSION,
        "build_key": key,
        "preset": asdict(preset),
        "corpus": {
            "source": "Python standard library sources of the interpreter that built it",
            "root": str(corpus.root),
            "python": platform.python_version(),
            "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files),
            "train_bytes": corpus.num_bytes(corpus.train_files),
            "heldout_bytes": corpus.num_bytes(corpus.heldout_files),
            "train_tokens": train_ids.numel(),
            "heldout_tokens": heldout_ids.numel(),
            "fingerprint": corpus.fingerprint(),
            "heldout_file_list": corpus.heldout_files,
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer), "special_tokens": SPECIAL_TOKENS},
        "models": results,
        "prompts": {"train": len(train_rows), "heldout": len(heldout_rows)},
        "quality": quality,
        "timings": timings,
        "device": str(device),
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / "MODEL_CARD.md").write_text(model_card(manifest), encoding="utf-8")
    (out / "target" / "README.md").write_text(model_card(manifest), encoding="utf-8")
    manifest["files"] = {p.relative_to(out).as_posix(): _sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    # Last: only a folder with this file is ever loaded.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


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
        f"bf16 autocast: {p['bf16']}, on {m['device']} (torch {m['torch']}).",
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
    lines += ["", "## Greedy samples (held-out prompts)", ""]
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


def stage_summary(manifest: dict) -> str:
    """A few lines for the terminal after a build or a cache hit."""
    models = manifest["models"]
    q = manifest["quality"]
    return (
        f"target {models['target']['parameters'] / 1e6:.2f}M params, held-out ppl {models['target']['heldout_perplexity']:.2f}; "
        f"draft {models['draft']['parameters'] / 1e6:.2f}M, ppl {models['draft']['heldout_perplexity']:.2f}; "
        f"self-draft alpha {q['self_draft_greedy']['alpha']:.3f}; small-draft alpha greedy "
        f"{q['small_draft_greedy']['alpha']:.3f}, T=1 {q['small_draft_t1']['alpha']:.3f}"
    )


def _main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="build_demo_target.py", description="Build (or reuse) the demo target and its small draft.")
    add_build_args(parser)
    args = parser.parse_args(argv)
    return run_build(args)


def add_build_args(parser) -> None:
    parser.add_argument("--preset", default="cpu", help=f"one of {', '.join(PRESETS)} (default cpu)")
    parser.add_argument("--cache-dir", help=f"cache folder (default ${CACHE_ENV}, else ~/.cache/draftsmith)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a valid cached build exists")
    parser.add_argument("--device", default="auto", help="torch device for training (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_build(args) -> int:
    """`draftsmith build-target` and scripts/build_demo_target.py."""
    from draftsmith.heads.models import ModelLoadError, resolve_device

    try:
        device = resolve_device(args.device)
        built = ensure_demo_target(args.preset, cache_dir=args.cache_dir, force=args.force, device=device, progress=not args.no_progress)
    except (DemoTargetError, ModelLoadError) as err:
        print(f"draftsmith build-target: error: {err}", file=sys.stderr)
        return 2
    print(stage_summary(built.manifest))
    print(f"target: {built.target}\ndraft: {built.draft}\nprompts: {built.heldout_prompts}\nmodel card: {built.model_card}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
