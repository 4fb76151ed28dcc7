"""The self-distillation dataset on disk: layout, atomic writes, hashing, loading.

    DIR/provenance.json        what made the data (target, tokenizer, template, source, sampling)
    DIR/shards/shard-00000/    `datasets` Arrow shards, each renamed into place when complete
    DIR/summary.json           written last: statistics and the data hash; its presence = done
    DIR/token_counts.safetensors   frequencies of trained tokens (for a reduced draft vocabulary)

Every row holds `input_ids`, `loss_mask` (1 = a token the drafter learns to predict: the
target's own answer), `length`, `num_trained`, `prompt_length`, `finish_reason` ("stop": the
target ended its turn; "length": cut at --max-new-tokens, kept and flagged), `num_turns`,
`record_index` and `sample_index` (row of the source, and which of --num-samples), and
`token_source` (where the last answer's ids came from: "local" generation, a "server" that
returned them, or its text "retokenized" with the target's tokenizer).

The data hash is a sha256 over the rows' `input_ids` and `loss_mask` in order: everything
trained on this data (vocabulary maps, hidden-state caches, heads) records it, and a consumer
given data with another hash refuses to go on. Recomputing it reads every row, so it is done on
request (`verify_data`, `draftsmith verify-data DIR`). What is checked on every load is cheaper:
each shard's `draftsmith_shard.json` records the size and crc32 of every file of the shard when
it is written, and loading a shard compares them first (~1 GB/s), so a flipped byte or a
truncated file is an error naming the file, never rows that silently differ from the hash.
Folders written before the checksums existed still load, unchecked (said once per folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from draftsmith.heads.artifacts import atomic_file, write_text_atomic

PROVENANCE = "provenance.json"
SUMMARY = "summary.json"
TOKEN_COUNTS = "token_counts.safetensors"
SHARDS = "shards"
SHARD_STATS = "draftsmith_shard.json"  # per-shard statistics, inside the shard folder
COLUMNS = (
    "input_ids",
    "loss_mask",
    "length",
    "num_trained",
    "prompt_length",
    "finish_reason",
    "num_turns",
    "record_index",
    "sample_index",
    "token_source",
)


class DataError(ValueError):
    """A data folder that cannot be used; the message names it and says what to do."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_json_atomic(path: Path, data) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def remove_stale_temporaries(folder: Path) -> None:
    """Leftovers of an interrupted run (names starting with '.') are never reused."""
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith("."):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def _features():
    from datasets import Features, Sequence, Value

    return Features(
        {
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("int8")),
            "length": Value("int32"),
            "num_trained": Value("int32"),
            "prompt_length": Value("int32"),
            "finish_reason": Value("string"),
            "num_turns": Value("int32"),
            "record_index": Value("int64"),
            "sample_index": Value("int32"),
            "token_source": Value("string"),
        }
    )


def write_shard(rows: list[dict], stats: dict, folder: Path) -> None:
    """Save `rows` as a `datasets` folder at `folder`, atomically (temporary folder + rename),
    with `stats` and the size and crc32 of every file in its `draftsmith_shard.json`."""
    from datasets import Dataset

    columns = {name: [row[name] for row in rows] for name in COLUMNS}
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with _quiet_datasets():  # one bar per small shard is noise beside the generation bar
            Dataset.from_dict(columns, features=_features()).save_to_disk(str(tmp))
        files = {p.name: _file_record(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / SHARD_STATS, stats | {"files": files})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700: the data is as readable as any other folder
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_CHUNK = 16 << 20


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def _regenerate_hint(folder: Path) -> str:
    return (
        f"delete {str(folder)!r} and rerun the same `draftsmith generate` command: it remakes this "
        "shard (same seed, same rows) and keeps the others"
    )


def check_shard_files(folder: Path, stats: dict) -> bool:
    """Compare the shard's files with the sizes and crc32s recorded when it was written.
    Returns False for a shard written before checksums were recorded (nothing to compare)."""
    files = stats.get("files")
    if files is None:
        return False
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise DataError(f"data shard file {str(path)!r} is missing: {_regenerate_hint(folder)}")
        size = path.stat().st_size
        if size != want["bytes"]:
            state = "truncated" if size < want["bytes"] else "longer than written"
            raise DataError(
                f"data shard file {str(path)!r} is {state} ({size} of {want['bytes']} bytes): {_regenerate_hint(folder)}"
            )
        crc = _crc32(path)
        if crc != want["crc32"]:
            raise DataError(
                f"data shard file {str(path)!r} is corrupt (crc32 {crc}, {want['crc32']} when written): {_regenerate_hint(folder)}"
            )
    return True


@contextlib.contextmanager
def _quiet_datasets():
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def complete_shards(data_dir: Path) -> list[Path]:
    root = Path(data_dir) / SHARDS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("shard-") and (p / SHARD_STATS).is_file())


_UNCHECKED_NOTED: set[str] = set()


def load_shard(folder: Path):
    """One shard as a `datasets.Dataset`, its files checked against their checksums first."""
    import pyarrow as pa
    from datasets import Dataset, load_from_disk

    folder = Path(folder)
    stats = read_json(folder / SHARD_STATS, "shard statistics")
    if not check_shard_files(folder, stats):
        data_dir = str(folder.parent.parent)
        if data_dir not in _UNCHECKED_NOTED:
            _UNCHECKED_NOTED.add(data_dir)
            print(
                f"note: data folder {data_dir!r} was written without shard checksums (an older draftsmith): "
                f"its shards load unchecked; `draftsmith verify-data {data_dir}` recomputes its data hash",
                file=sys.stderr,
            )
    if stats.get("samples") == 0:  # every prompt of the shard was skipped: `datasets` saves no table
        return Dataset.from_dict({name: [] for name in COLUMNS}, features=_features())
    try:
        with _quiet_datasets():
            return load_from_disk(str(folder))
    except (OSError, ValueError, IndexError, KeyError, pa.ArrowException) as err:
        raise DataError(
            f"data shard {str(folder)!r} cannot be read ({type(err).__name__}: {err}): {_regenerate_hint(folder)}"
        ) from None


def hash_rows(datasets_in_order) -> str:
    """sha256 over (input_ids, loss_mask) of every row, in order, lengths included."""
    digest = hashlib.sha256()
    for ds in datasets_in_order:
        table = ds.with_format("numpy", columns=["input_ids", "loss_mask"])
        for row in table:
            ids = np.asarray(row["input_ids"], dtype="<i4")
            mask = np.asarray(row["loss_mask"], dtype="i1")
            digest.update(np.int64(len(ids)).tobytes())
            digest.update(ids.tobytes())
            digest.update(mask.tobytes())
    return digest.hexdigest()


def count_trained_tokens(datasets_in_order, vocab_size: int) -> torch.Tensor:
    """int64[vocab_size]: how often each token id is a trained (loss-masked) token."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ds in datasets_in_order:
        for row in ds.with_format("numpy", columns=["input_ids", "loss_mask"]):
            ids = np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]).astype(bool)]
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def save_token_counts(path: Path, counts: torch.Tensor, data_hash: str) -> None:
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file({"counts": counts.contiguous()}, tmp, metadata={"data_hash": data_hash})


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{what}: {str(path)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{what}: {str(path)!r} is not valid JSON ({err})") from None


class DistillData:
    """A finished `draftsmith generate` folder: rows, provenance, summary and data hash."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        if not self.dir.is_dir():
            raise DataError(f"data folder {str(self.dir)!r} does not exist (make one with `draftsmith generate`)")
        if not (self.dir / SUMMARY).is_file():
            if (self.dir / PROVENANCE).is_file():
                raise DataError(
                    f"data folder {str(self.dir)!r} is incomplete (no {SUMMARY}): rerun the same "
                    "`draftsmith generate` command to finish it; complete shards are kept"
                )
            raise DataError(f"{str(self.dir)!r} is not a draftsmith data folder (no {SUMMARY} or {PROVENANCE})")
        self.summary = read_json(self.dir / SUMMARY, "data summary")
        self.provenance = read_json(self.dir / PROVENANCE, "data provenance")
        self.data_hash: str = self.summary["data_hash"]
        self._shards = complete_shards(self.dir)
        if len(self._shards) != self.summary["num_shards"]:
            raise DataError(
                f"data folder {str(self.dir)!r}: summary lists {self.summary['num_shards']} shards, "
                f"found {len(self._shards)} complete ones; the folder was changed after generation"
            )
        self._dataset = None
        self._lengths = None

    @property
    def dataset(self):
        """All rows as one `datasets.Dataset` (memory-mapped Arrow, not loaded into RAM)."""
        if self._dataset is None:
            from datasets import concatenate_datasets

            parts = [load_shard(p) for p in self._shards]
            self._dataset = concatenate_datasets(parts) if parts else None
        return self._dataset

    def __len__(self) -> int:
        return self.summary["samples"]

    def lengths(self):
        """[rows] int64 numpy: each row's token count (prompt and answer)."""
        if self._lengths is None:
            self._lengths = self.dataset.with_format("numpy", columns=["length"])["length"]
        return self._lengths

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is out of range: {self.dir} has {len(self)} rows")
        return self.dataset[index % len(self)]

    def token_counts(self) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path = self.dir / TOKEN_COUNTS
        if not path.is_file():
            raise DataError(f"{str(path)!r} is missing: the data folder is incomplete")
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = (f.metadata() or {}).get("data_hash")
                counts = f.get_tensor("counts")
        except (SafetensorError, OSError) as err:
            raise DataError(
                f"{str(path)!r} cannot be read ({err}): rerun the same `draftsmith generate` command, which rewrites it"
            ) from None
        if stored != self.data_hash:
            raise DataError(f"{str(path)!r} was counted on data {stored}, the folder holds data {self.data_hash}")
        return counts

    def verify(self) -> dict:
        """Everything the folder can be checked for: every shard file against its checksum, the
        data hash recomputed from the rows, the token counts' recorded hash. Returns a summary."""
        with_checksums = sum("files" in read_json(p / SHARD_STATS, "shard statistics") for p in self._shards)
        self.verify_hash()
        self.token_counts()
        return {
            "shards": len(self._shards),
            "with_checksums": with_checksums,
            "samples": len(self),
            "data_hash": self.data_hash,
        }

    def verify_hash(self) -> None:
        """Recompute the data hash from the rows (reads all shards, their checksums checked)."""
        actual = hash_rows(load_shard(p) for p in self._shards)
        if actual != self.data_hash:
            raise DataError(
                f"data folder {str(self.dir)!r}: rows hash to {actual}, {SUMMARY} says {self.data_hash}: the data "
                "changed after generation; regenerate it with the `draftsmith generate` command that made it"
            )
