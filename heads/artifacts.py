"""Writing files and artifact folders atomically: readers never see half a file, and a folder
is never written over a stranger."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file


@contextlib.contextmanager
def atomic_file(path, suffix: str = ""):
    """Yield a temporary path beside `path`; when the block ends without error it is renamed to
    `path` (with the usual permissions, 0666 minus the umask), otherwise removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks."""
    import hashlib

    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_sha256(folder) -> dict[str, str]:
    """{relative path: sha256} of every file below `folder`, in path order."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def write_text_atomic(path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_folder_atomic(out_dir, write, *, overwrite: bool, may_replace=None, error=ValueError) -> Path:
    """Run `write(tmp_dir)` in a temp folder beside `out_dir`, then rename it into place.

    An existing non-empty `out_dir` is replaced only with `overwrite` or when `may_replace(out_dir)`
    says it holds an artifact of the same kind; a failure leaves `out_dir` as it was. Errors are
    raised as `error` (the caller's error class)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise error(f"{str(out_dir)!r} exists and is not a directory")
    occupied = out_dir.is_dir() and any(out_dir.iterdir())
    if occupied and not overwrite and not (may_replace and may_replace(out_dir)):
        raise error(f"{str(out_dir)!r} is not empty; choose a new folder or pass overwrite=True")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        if out_dir.exists():
            out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except OSError:
            if old.exists():
                old.rename(out_dir)  # put the previous artifact back
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def has_model_type(folder: Path, model_type: str) -> bool:
    """True when `folder/config.json` declares `model_type`."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == model_type
    except (OSError, ValueError):
        return False


def read_config(path, what: str, error=ValueError) -> tuple[Path, dict]:
    """(folder, its config.json as a dict) of an artifact folder; `error` names what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise error(f"{what} folder {str(path)!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise error(f"{what} folder {str(path)!r} has no config.json")
    try:
        return path, json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise error(f"{str(config_file)!r} is not valid JSON: {err}") from None


def load_pretrained(cls, path, what: str, error=ValueError, dtype=None):
    """`cls.from_pretrained(path)` (in `dtype`, when given) of a draftsmith folder; a folder it
    cannot read raises `error` naming it as `what` (e.g. "the heads")."""
    try:
        return cls.from_pretrained(path, **({"dtype": dtype} if dtype is not None else {}))
    except (OSError, ValueError) as err:
        raise error(f"cannot load {what} from {str(path)!r}: {err}") from None


def read_weights(file, what: str, error=ValueError) -> dict:
    """The tensors of the safetensors `file` ({name: tensor}, on CPU); a missing or unreadable file
    raises `error` naming it as `what` (e.g. "the head weights")."""
    file = Path(file)
    if not file.is_file():
        raise error(f"{what} {str(file)!r} are missing")
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as err:
        raise error(f"cannot read {what} {str(file)!r}: {err}") from None


def check_safetensors(path, what: str, error=ValueError) -> None:
    """Every `*.safetensors` file of the folder `path` (or the file itself) is whole: its header
    parses and the file is as long as the tensors the header lists. Cheap (reads the headers
    only), and it names the file, where a truncated download otherwise ends in a raw loader error."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.is_file() else []
    for file in files:
        size = file.stat().st_size
        file_name = f"the {what} file {str(file)!r}"
        hint = "copy or download it again"
        with file.open("rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                raise error(f"{file_name} is truncated or corrupt ({size} bytes, too few for its header): {hint}")
            try:
                header = json.loads(fh.read(length))
                end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError):
                raise error(f"{file_name} is corrupt (no valid safetensors header): {hint}") from None
        if 8 + length + end > size:
            raise error(f"{file_name} is truncated ({size} bytes; its header lists {8 + length + end}): {hint}")


def check_finite_weights(module, where, what: str, error=ValueError) -> None:
    """Every parameter of `module` is finite: NaN or inf weights decode garbage (alpha 0, a NaN
    KL, answers of token 0) without failing, so they are refused with the first bad tensor's name."""
    import torch

    for name, tensor in module.named_parameters():
        if not tensor.is_floating_point() or not tensor.numel() or tensor.device.type == "meta":
            continue
        # a float32 sum is finite exactly when every element is: the element-wise count runs on failure only
        if torch.isfinite(tensor.sum(dtype=torch.float32)) or bool(torch.isfinite(tensor).all()):
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        hint = "the checkpoint is corrupt (train or export it again)"
        if tensor.dtype == torch.float16:
            hint = "a bfloat16 checkpoint loaded as float16 overflows past 65504: try --dtype bfloat16"
        raise error(
            f"{what} {str(where)!r} has non-finite weights: {name!r} holds {bad} NaN/inf of {tensor.numel()} "
            f"values (loaded as {str(tensor.dtype).removeprefix('torch.')}); {hint}"
        )


def check_writable_folder(out, flag: str, error=ValueError) -> Path:
    """`out` is a folder, or can be made one, that this process can write, checked before anything
    slow runs (a probe file is made and removed in its nearest existing folder; nothing is
    created). `flag` names it as the user gave it ("--out", "out")."""
    out = Path(out)
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise error(f"{flag} {str(out)!r} cannot be made: {str(base)!r} is a file, not a folder: choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".draftsmith-probe-", dir=base)
    except OSError as err:
        raise error(
            f"{flag} {str(out)!r} is not writable ({str(base)!r}: {err.strerror or err}): choose another {flag}"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return out
