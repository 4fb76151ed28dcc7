"""The self-distillation dataset on disk: layout, atomic writes, hashing, loading.

    DIR/provenance.json        what made the data (target, tokenizer, template, source, sampling)
    DIR/shards/shard-00000/    `datasets` Arrow shards, each renamed into place when complete
    DIR/summary.json           written last: statistics and the data hash; its presence = done
    DIR/token_counts.safetensors   frequencies of trained tokens (for EAGLE-3's draft vocabulary)

Every row holds `input_ids`, `loss_mask` (1 = a token the drafter learns to predict: the
target's own answer), `length`, `num_trained`, `prompt_length`, `finish_reason` ("stop": the
target ended its turn; "length": cut at --max-new-tokens, kept and flagged), `num_turns`,
`record_index` and `sample_index` (row of the source, and which of --num-samples), and
`token_source` (where the last answer's ids came from: "local" generation, a "server" that
returned them, or its text "retokenized" with the target's tokenizer).

The data hash is a sha256 over the rows' `input_ids` and `loss_mask` in order: everything
trained on this data (vocabulary maps, hidden-state caches, heads) records it, and a consumer
given data with another hash refuses to go on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
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
    "input_ids", "loss_mask", "length", "num_trained", "prompt_length",
    "finish_reason", "num_turns", "record_index", "sample_index", "token_source",
)  # fmt: skip


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


def write_shard(rows: list[dict], stats: dict, folder: Path) -> None:
    """Save `rows` as a `datasets` folder at `folder`, atomically (temporary folder + rename)."""
    from datasets import Dataset, Features, Sequence, Value

    features = Features({
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
    })  # fmt: skip
    columns = {name: [row[name] for row in rows] for name in COLUMNS}
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with _quiet_datasets():  # one bar per small shard is noise beside the generation bar
            Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
        write_json_atomic(tmp / SHARD_STATS, stats)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def load_shard(folder: Path):
    from datasets import load_from_disk

    return load_from_disk(str(folder))


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

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is out of range: {self.dir} has {len(self)} rows")
        return self.dataset[index % len(self)]

    def token_counts(self) -> torch.Tensor:
        from safetensors import safe_open

        path = self.dir / TOKEN_COUNTS
        if not path.is_file():
            raise DataError(f"{str(path)!r} is missing: the data folder is incomplete")
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get("data_hash")
            if stored != self.data_hash:
                raise DataError(f"{str(path)!r} was counted on data {stored}, the folder holds data {self.data_hash}")
            return f.get_tensor("counts")

    def verify_hash(self) -> None:
        """Recompute the data hash from the rows (reads all shards)."""
        actual = hash_rows(load_shard(p) for p in self._shards)
        if actual != self.data_hash:
            raise DataError(f"data folder {str(self.dir)!r}: rows hash to {actual}, summary says {self.data_hash}")
