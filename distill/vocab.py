"""A head's reduced draft vocabulary (recipe key `draft_vocab_size` or `vocab_map`), built from
what the target actually says.

A drafter head over a 128k vocabulary spends most of its cost in the output projection, yet
the target's answers use a small part of it. A reduced vocabulary keeps the `draft_vocab_size`
tokens most frequent in the target's own generations (under the loss mask) and maps them back:

    d2t: int64[draft_vocab]   target_id = draft_id + d2t[draft_id]   (draft ids in target-id order)
    t2d: bool[target_vocab]   t2d[target_id] = the token is in the draft vocabulary

These are the tensors vLLM and SGLang read. The coverage (share of trained target tokens the
draft vocabulary can produce) bounds the acceptance of any head using it, so it is reported.
A map is stored with the data hash it was counted on; loading it for other data is an error,
since a stale map silently reused is a known way to train a head that serves at alpha ~ 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.heads.artifacts import atomic_file
from draftsmith.heads.vocab_map import VocabMap, VocabMapError, check_consistent


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int, data_hash: str) -> VocabMap:
    """Keep the `draft_vocab_size` most frequent tokens (ties: lower id first).

    When the data uses fewer distinct tokens than asked for, the rest are filled with the
    lowest unused ids, so the draft vocabulary always has the requested size (what the
    exported config declares).
    """
    counts = counts.to(torch.int64).reshape(-1)
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise VocabMapError(f"draft vocabulary size {draft_vocab_size}: expected 1..{vocab} (the target vocabulary)")
    # Stable sort by descending count = ties keep ascending id order.
    order = torch.sort(-counts, stable=True).indices
    keep = torch.sort(order[:draft_vocab_size]).values  # target ids, ascending
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    d2t = keep - torch.arange(draft_vocab_size)
    total = int(counts.sum())
    coverage = float(counts[keep].sum()) / total if total else 0.0
    return VocabMap(d2t=d2t, t2d=t2d, coverage=coverage, data_hash=data_hash)


def save_vocab_map(vmap: VocabMap, path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    meta = {"data_hash": vmap.data_hash, "coverage": repr(vmap.coverage), "format": "draftsmith vocab map v1"}
    with atomic_file(path) as tmp:
        save_file({"d2t": vmap.d2t.contiguous(), "t2d": vmap.t2d.contiguous()}, tmp, metadata=meta)
    return path


def load_vocab_map(path, *, expected_data_hash: str | None = None, target_vocab_size: int | None = None) -> VocabMap:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise VocabMapError(f"vocabulary map {str(path)!r} does not exist (build it with `draftsmith vocab-map`)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        if not {"d2t", "t2d"} <= keys or "data_hash" not in meta:
            raise VocabMapError(f"{str(path)!r} is not a draftsmith vocabulary map (needs d2t, t2d and a data_hash)")
        vmap = VocabMap(f.get_tensor("d2t"), f.get_tensor("t2d"), float(meta.get("coverage", "nan")), meta["data_hash"])
    if expected_data_hash is not None and vmap.data_hash != expected_data_hash:
        raise VocabMapError(
            f"vocabulary map {str(path)!r} was built from data {vmap.data_hash[:12]}, but the training data is "
            f"{expected_data_hash[:12]}: rebuild it with `draftsmith vocab-map --data <that data>`"
        )
    if target_vocab_size is not None and vmap.target_vocab_size != target_vocab_size:
        raise VocabMapError(
            f"vocabulary map {str(path)!r} covers {vmap.target_vocab_size} target tokens, the target has {target_vocab_size}"
        )
    check_consistent(vmap)
    return vmap
