"""Offline hidden states of the target, opt-in.

    draftsmith cache-hidden --target DIR --data DIR --layers 2,mid,-3 --dtype bf16 --out DIR
                            [--max-disk 50GB] [--topk-logits 0]

Training online (the frozen target runs inside the training loop) costs one target forward
per step and no disk. Offline caching pays that forward once and reuses it for every epoch
and every head trained on the same data, at the price of disk: tokens x layers x H x bytes
(a 70B target, 3 layers of H = 8192 in bf16, is 48 KB per token: 1B tokens = 48 TB). So only
the requested layers are written, in the requested dtype, the estimate is printed before
anything runs and a run that would exceed --max-disk (or the free space) is refused.

Layer ids follow HF's `output_hidden_states` numbering, with names for the usual choices:
  i >= 0   hidden_states[i]: 0 = embeddings, i = output of layer i (the input of layer i+1)
  -k       L - k, counted from the top, as in the usual (2, L//2, L-3) of a target of L layers
  mid      L // 2
  last     L: the last layer's output after the final norm (what lm_head reads; the
           feature of a head reading one layer)
  none     no states: with --topk-logits, a cache of the top-k teacher alone (a draft model's)

Layout: `manifest.json` (target fingerprint, layers, dtype, data hash, shard ranges) and
`hidden-00000.safetensors`, ... holding for each sample i of the shard `{i}.hidden`
[num_layers, T, H] and, with --topk-logits k, `{i}.topk_values` [T, k] (float32 logits),
`{i}.topk_ids` [T, k] (int32) and `{i}.topk_tail` [T] (float32 log-sum-exp of the other V - k
logits: the tail's mass, so that a loss on the top k is defined; `distill.losses.topk_divergence`).
Shards are written to a temporary name and renamed; a re-run
skips the complete ones. A trainer opens the cache with the target and layers it expects and
gets an error, not silent garbage, when they differ.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.distill import data as store
from draftsmith.distill.losses import topk_teacher
from draftsmith.heads.artifacts import atomic_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CacheError(ValueError):
    """A hidden-state cache that cannot be made or used; the message says why."""


def resolve_layers(spec, num_layers: int) -> tuple[int, ...]:
    """ "2,mid,-3" (or a sequence of ints/names) -> HF hidden_states indices in [0, L]."""
    if isinstance(spec, str) and spec.strip() == "none":
        return ()
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    if not parts or any(p == "" for p in parts):
        raise CacheError(f"--layers {spec!r}: expected comma-separated layer ids (e.g. 2,mid,-3 or last)")
    resolved = []
    for part in parts:
        if part == "mid":
            index = num_layers // 2
        elif part in ("last", "final"):
            index = num_layers
        else:
            try:
                index = int(part)
            except (TypeError, ValueError):
                raise CacheError(
                    f"--layers: {part!r} is not a layer id (an integer, -k, mid, last; or none alone)"
                ) from None
            if index < 0:
                index = num_layers + index
        if not 0 <= index <= num_layers:
            raise CacheError(
                f"--layers: {part!r} is out of range for a target of {num_layers} layers "
                f"(valid: 0..{num_layers}, -1..-{num_layers}, mid, last)"
            )
        resolved.append(index)
    if len(set(resolved)) != len(resolved):
        raise CacheError(f"--layers {spec!r} names layer {resolved} with repeats")
    return tuple(resolved)


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """ "50GB" / "1.5TiB" / "1000000" -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise CacheError(f"--max-disk {text!r}: expected a size like 500MB, 50GB or 2TB")
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


@dataclass(frozen=True)
class Estimate:
    tokens: int
    layers: int
    hidden: int
    bytes_per_value: int
    topk: int

    @property
    def bytes_per_token(self) -> int:
        # top-k: a float32 logit and an int32 id per kept entry, and the tail's float32 log-sum-exp
        return self.layers * self.hidden * self.bytes_per_value + (self.topk * 8 + 4 if self.topk else 0)

    @property
    def total(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        text = f"{self.tokens:,} tokens x {self.layers} layers x H {self.hidden} x {self.bytes_per_value} B"
        if self.topk:
            text += f" + top-{self.topk} logits (8 B each) and their tail (4 B)"
        return f"{text} = {human_bytes(self.total)} ({self.bytes_per_token:,} B/token)"


def shard_file(index: int) -> str:
    return f"hidden-{index:05d}.safetensors"


@torch.inference_mode()
def extract(model, rows: list[list[int]], layers: tuple[int, ...], *, topk: int = 0, pad_id: int = 0):
    """Hidden states of `layers` (and the top-k logits) for a batch of token lists.

    Right padding with a 2-D attention mask: under causal attention a real token never sees
    the pads after it, and each row is cut back to its own length, so a sample's values do not
    depend on what it was batched with (tested against one-at-a-time extraction).
    """
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
    out = model(
        input_ids=input_ids.to(model.device),
        attention_mask=attention.to(model.device),
        output_hidden_states=bool(layers),
        use_cache=False,
        logits_to_keep=0 if topk else 1,
    )
    stacked = torch.stack([out.hidden_states[i] for i in layers], dim=1) if layers else None  # [B, n_layers, T, H]
    results = []
    for r, ids in enumerate(rows):
        item = {} if stacked is None else {"hidden": stacked[r, :, : len(ids)]}
        if topk:
            item["topk_values"], item["topk_ids"], item["topk_tail"] = topk_teacher(out.logits[r, : len(ids)], topk)
        results.append(item)
    return results


def _write_safetensors_atomic(tensors: dict, path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def cache_hidden_states(
    model,
    data: store.DistillData,
    out_dir,
    *,
    layers_spec,
    dtype: torch.dtype,
    max_disk: int | None = None,
    batch_size: int = 8,
    topk: int = 0,
    shard_size: int = 256,
    target_path: str = "",
    progress: bool = True,
    log=print,
) -> dict:
    """Write (or finish) the cache of `data`'s rows in `out_dir`; returns the manifest."""
    from draftsmith.heads.models import describe_model

    out = Path(out_dir)
    text_config = model.config.get_text_config()
    layers = resolve_layers(layers_spec, text_config.num_hidden_layers)
    vocab = model.get_output_embeddings().weight.shape[0]
    if not 0 <= topk <= vocab:
        raise CacheError(f"--topk-logits {topk}: expected 0 (off) .. {vocab} (the vocabulary)")
    if not layers and not topk:
        raise CacheError("--layers none without --topk-logits would cache nothing: name layers or give --topk-logits K")
    estimate = Estimate(
        data.summary["tokens"], len(layers), text_config.hidden_size, torch.finfo(dtype).bits // 8, topk
    )
    log(f"disk estimate: {estimate.describe()}")
    if max_disk is not None and estimate.total > max_disk:
        raise CacheError(
            f"the cache needs {human_bytes(estimate.total)} but --max-disk is {human_bytes(max_disk)}: "
            "cache fewer layers, use --dtype bf16, cache a subset of the data, or raise --max-disk "
            "(or train online, which needs no cache)"
        )
    target = describe_model(target_path, model)
    manifest = {
        "kind": "draftsmith hidden-state cache",
        "format_version": FORMAT_VERSION,
        "target": target,
        "layers": list(layers),
        "layers_spec": layers_spec if isinstance(layers_spec, str) else ",".join(map(str, layers_spec)) or "none",
        "dtype": str(dtype).removeprefix("torch."),
        "model_dtype": str(model.dtype).removeprefix("torch."),  # the forward's: states stored in it are unrounded
        "topk_logits": topk,
        "topk_tail": bool(topk),  # caches made before the tail was stored lack it: no loss is defined on them
        "data": str(data.dir.resolve()),
        "data_hash": data.data_hash,
        "samples": len(data),
        "tokens": estimate.tokens,
        "hidden_size": text_config.hidden_size,
        "bytes_per_token": estimate.bytes_per_token,
        "shard_size": shard_size,
        "complete": False,
    }
    if out.exists() and not out.is_dir():
        raise CacheError(f"--out {str(out)!r} exists and is not a folder")
    if (out / MANIFEST).is_file():
        old = store.read_json(out / MANIFEST, "cache manifest")
        keys = ("target", "layers", "dtype", "topk_logits", "topk_tail", "data_hash", "shard_size")
        differ = [k for k in keys if old.get(k) != manifest.get(k)]
        if differ:
            raise CacheError(
                f"--out {str(out)!r} holds a cache made with other {', '.join(differ)}; choose a new --out"
            )
        if old.get("complete"):
            log(f"{out} is already complete")
            return old
    elif out.exists() and any(out.iterdir()):
        raise CacheError(f"--out {str(out)!r} exists and is not a hidden-state cache; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    store.remove_stale_temporaries(out)
    free = shutil.disk_usage(out).free
    existing = sum(p.stat().st_size for p in out.glob("hidden-*.safetensors"))
    if estimate.total - existing > free:
        raise CacheError(
            f"the cache needs {human_bytes(estimate.total - existing)} more but {out} has {human_bytes(free)} free"
        )
    store.write_json_atomic(out / MANIFEST, manifest)

    num_shards = (len(data) + shard_size - 1) // shard_size
    todo = [k for k in range(num_shards) if not (out / shard_file(k)).is_file()]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(min(shard_size, len(data) - k * shard_size) for k in todo), desc="cache-hidden", unit="sample"
        )
    import time

    start = time.perf_counter()
    cached_tokens, forward_seconds = 0, 0.0  # forward: the target's alone (the trainers' yardstick), no disk
    try:
        for k in todo:
            lo, hi = k * shard_size, min(len(data), (k + 1) * shard_size)
            rows = data.dataset.select(range(lo, hi))["input_ids"]
            # Sorted by length within the shard: batches pad little; results go back by index.
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
            tensors = {}
            for b in range(0, len(order), batch_size):
                batch = order[b : b + batch_size]
                t0 = time.perf_counter()
                items = extract(model, [rows[i] for i in batch], layers, topk=topk, pad_id=pad_id)
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                forward_seconds += time.perf_counter() - t0
                for i, item in zip(batch, items):
                    if layers:
                        tensors[f"{lo + i}.hidden"] = item["hidden"].to(dtype).cpu().contiguous()
                    if topk:
                        tensors[f"{lo + i}.topk_values"] = item["topk_values"].cpu().contiguous()
                        tensors[f"{lo + i}.topk_ids"] = item["topk_ids"].cpu().contiguous()
                        tensors[f"{lo + i}.topk_tail"] = item["topk_tail"].cpu().contiguous()
                    cached_tokens += len(rows[i])
                if bar is not None:
                    bar.update(len(batch))
            _write_safetensors_atomic(
                tensors, out / shard_file(k), {"first": str(lo), "last": str(hi - 1), "data_hash": data.data_hash}
            )
    finally:
        if bar is not None:
            bar.close()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    manifest["complete"] = True
    manifest["num_shards"] = num_shards
    manifest["bytes"] = sum(p.stat().st_size for p in out.glob("hidden-*.safetensors"))
    manifest["last_run"] = {
        "tokens": cached_tokens,
        "seconds": seconds,
        "tokens_per_second": cached_tokens / seconds if seconds else None,
        # the target's forward (and its top-k with --topk-logits) alone, real tokens per second: what a head
        # trainer's train_tokens_per_second from this cache compares with
        "forward_seconds": forward_seconds,
        "forward_tokens_per_second": cached_tokens / forward_seconds if forward_seconds else None,
        "device": str(model.device),
    }
    store.write_json_atomic(out / MANIFEST, manifest)
    return manifest


class HiddenStateCache:
    """Read side of a finished cache. `check` it against what the trainer is about to use."""

    def __init__(self, cache_dir):
        self.dir = Path(cache_dir)
        if not (self.dir / MANIFEST).is_file():
            raise CacheError(
                f"{str(self.dir)!r} is not a hidden-state cache (no {MANIFEST}; make one with `draftsmith cache-hidden`)"
            )
        self.manifest = store.read_json(self.dir / MANIFEST, "cache manifest")
        if not self.manifest.get("complete"):
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} is incomplete: rerun the same `draftsmith cache-hidden` command to finish it"
            )
        self.layers = tuple(self.manifest["layers"])
        self.shard_size = self.manifest["shard_size"]
        self._open = {}

    def check(
        self,
        *,
        target_fingerprint: str | None = None,
        layers=None,
        data_hash: str | None = None,
        hidden_size: int | None = None,
    ) -> None:
        """Raise CacheError when the cache was made from another target or data, or lacks one of `layers`
        (it may hold more: one cache of (2, L//2, L-3, last) serves the heads that read several
        target layers and those that read the last)."""
        m = self.manifest
        if target_fingerprint is not None and m["target"]["fingerprint"] != target_fingerprint:
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} was made with another target "
                f"({m['target']['name_or_path']}, fingerprint {m['target']['fingerprint'][:12]}; "
                f"this target's is {target_fingerprint[:12]})"
            )
        if hidden_size is not None and m["hidden_size"] != hidden_size:
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} holds hidden size {m['hidden_size']}, expected {hidden_size}"
            )
        missing = [i for i in layers if i not in self.layers] if layers is not None else []
        if missing:  # a superset is fine: a trainer reads the layers it needs by id (`layer_index`)
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} holds layers {list(self.layers)}, "
                f"the trainer needs {list(layers)} (missing {missing}): rerun `draftsmith cache-hidden` "
                "with --layers naming them all"
            )
        if data_hash is not None and m["data_hash"] != data_hash:
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} was made from data {m['data_hash'][:12]}, the trainer reads data {data_hash[:12]}"
            )

    def layer_index(self, layers) -> list[int]:
        """Where each of `layers` (HF hidden_states ids, `check`ed to be cached) sits along a sample's `hidden`."""
        return [self.layers.index(i) for i in layers]

    def __len__(self) -> int:
        return self.manifest["samples"]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range: the cache holds {len(self)}")
        k = index // self.shard_size
        if k not in self._open:
            self._open[k] = safe_open(str(self.dir / shard_file(k)), framework="pt")
        f = self._open[k]
        item = {"hidden": f.get_tensor(f"{index}.hidden")} if self.layers else {}
        if self.manifest["topk_logits"]:
            item["topk_values"] = f.get_tensor(f"{index}.topk_values")
            item["topk_ids"] = f.get_tensor(f"{index}.topk_ids")
            if self.manifest.get("topk_tail"):
                item["topk_tail"] = f.get_tensor(f"{index}.topk_tail")
        return item

    def top1_is_argmax(self, dtype) -> bool:
        """Whether the cached top-1 ids are the argmax of lm_head(stored last state) computed in `dtype`,
        as a trainer would compute it: the cache holds top-k logits, its states are stored in the dtype
        the forward ran in (unrounded) and that is `dtype`. A rounded state (a float32 forward stored in
        bf16) moves the argmax of near-ties (0.4% of positions on a random 30-layer target)."""
        m = self.manifest
        return bool(m["topk_logits"]) and m.get("model_dtype") == m["dtype"] == str(dtype).removeprefix("torch.")

    def require_topk(self) -> int:
        """The k of a cache a trainer reads top-k teacher logits from; CacheError when it holds
        none, or holds them without the tail (an older cache-hidden), so no loss is defined."""
        m, k = self.manifest, self.manifest["topk_logits"]
        again = (
            f"draftsmith cache-hidden --target {m['target']['name_or_path']} --data {m['data']} "
            f"--layers {m['layers_spec']} --topk-logits {k or 'K'} --out NEW_DIR"
        )
        if not k:
            raise CacheError(f"hidden-state cache {str(self.dir)!r} holds no top-k teacher logits: rerun {again}")
        if not m.get("topk_tail"):
            raise CacheError(
                f"hidden-state cache {str(self.dir)!r} holds top-{k} logits without their tail log-sum-exp "
                f"(made by an older cache-hidden), so no loss is defined on them: rerun {again}"
            )
        return k
