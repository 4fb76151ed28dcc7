"""The embedded default target: a small Llama trained here on the Python standard library.

    draftsmith build-target --preset cpu                       # or: python scripts/build_demo_target.py
    draftsmith demo                                            # builds it when not cached

A build, top to bottom (the corpus, tokenizer and prompts come from `draftsmith.distill.corpus`,
the measurements and the model card from `draftsmith.train.demo_card`):
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

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.distill.corpus import (
    SPECIAL_TOKENS,
    Corpus,
    CorpusError,
    extract_prompts,
    stdlib_corpus,
    token_stream,
    train_tokenizer,
    write_jsonl,
)
from draftsmith.train.demo_card import cpu_decode_threads, model_card, quality_report, repetition_line, stage_summary

CACHE_ENV = "DRAFTSMITH_CACHE"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # bump when the layout or the build recipe changes: old caches rebuild (2: repetition share)


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
    repetition_prompts: int = 32  # held-out prompts whose greedy answers are checked for loops
    repetition_new_tokens: int = 96

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
        # 1200 * 8 * 256 = 2.5M tokens (~1.1 epochs). Measured here (fp32, 1 thread): against 600 steps of
        # 16 rows at lr 3e-3, the same tokens in twice the steps reached held-out perplexity 77.7 vs 83.1 and
        # repeated 49% vs 47% of greedy 4-grams; the budget, not the schedule, is what limits this target.
        target_steps=1200,
        draft_steps=1000,  # 2M tokens; the small draft trains ~4.5x faster per token
        batch_size=8,
        seq_len=256,  # prompts (<= ~150 tokens) + 64-96 new tokens fit in the trained context
        target_lr=2e-3,
        draft_lr=3e-3,  # smaller model, higher lr
        warmup_steps=60,
        bf16=True,  # ~1.7x faster than fp32 on a CPU with AMX; off where the CPU has no bf16 units
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
        repetition_prompts=4,
        repetition_new_tokens=16,
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DemoTargetError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]



def demo_corpus(preset: Preset) -> Corpus:
    """The stdlib corpus of `preset` (its held-out share and size cap)."""
    try:
        return stdlib_corpus(preset.heldout_every, preset.max_corpus_bytes)
    except CorpusError as err:
        raise DemoTargetError(str(err)) from None


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
    corpus = demo_corpus(preset)
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
    from draftsmith.train.lm import LMTrainConfig, bf16_is_fast, train_lm

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
    bf16 = preset.bf16 and bf16_is_fast(device)
    if preset.bf16 and not bf16:
        log(f"bf16 autocast off: {device} has no bf16 units (AMX / AVX512-BF16 on a CPU), where fp32 is faster")
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
            bf16=bf16,
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
        quality = quality_report(
            models["target"], models["draft"], tokenizer, heldout_rows,
            num_prompts=preset.quality_prompts, k=preset.quality_k, new_tokens=preset.quality_new_tokens,
            repetition_prompts=preset.repetition_prompts, repetition_new_tokens=preset.repetition_new_tokens,
        )  # fmt: skip
    timings["quality_checks_s"] = time.perf_counter() - t
    log(
        f"acceptance at K={preset.quality_k}: self-draft {quality['self_draft_greedy']['alpha']:.3f} (must be 1.0), "
        f"small draft greedy {quality['small_draft_greedy']['alpha']:.3f}, T=1 {quality['small_draft_t1']['alpha']:.3f}; "
        f"{repetition_line(quality['repetition'])}"
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


def build_demo_target(
    preset: str = "cpu",
    *,
    cache_dir: str | Path | None = None,
    force: bool = False,
    device: str = "auto",
    progress: bool = True,
    log=print,
) -> DemoTarget:
    """`draftsmith build-target`: the cached build (built when needed), summarised in a few lines."""
    from draftsmith.heads.models import resolve_device

    built = ensure_demo_target(preset, cache_dir=cache_dir, force=force, device=resolve_device(device), progress=progress, log=log)
    log(stage_summary(built.manifest))
    log(f"target: {built.target}\ndraft: {built.draft}\nprompts: {built.heldout_prompts}\nmodel card: {built.model_card}")
    return built

