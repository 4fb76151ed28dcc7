"""Batched speculative decoding: B prompts of different lengths decode together, each row
accepting its own number of drafts per target call (ragged), each row lossless on its own.

    from draftsmith.eval.batched import BatchedDraftModel, generate_batch
    result = generate_batch(target, prompts, BatchedDraftModel(draft), num_draft_tokens=4,
                            max_new_tokens=128, sampling=SamplingConfig(1.0), seed=0)
    result.tokens[b]                 # row b's new tokens
    result.stats.tau                 # pooled over rows and calls; counts the bonus token
    result.rows[b].alpha_per_position

Every call feeds [last, x_1..x_K] of every active row to the target in ONE forward; row b
keeps `last` and its n_b accepted drafts and emits one more token (the correction at its
first rejection, or the bonus), exactly as `eval/decoder.py` does for one sequence. The
acceptance rule is `verify_chain`, called per row with the row's own generator.

Cache layout (target, draft model and EAGLE head alike): ONE KV cache per model shared by the
batch, [B, heads, S, head_dim]. Column s of row b holds a real token of that row or a hole;
`RaggedCache.valid[b, s]` says which. Each forward gets a float additive 4-D mask built from it
(a new token sees its row's real columns and the real tokens fed before it) and explicit
per-row positions (= the number of the row's real tokens before it). No row is ever cut to
another's length:
- prompts are right-aligned: a shorter prompt's left padding is holes;
- after a verification row b keeps columns [0, n_b] of the K+1 it was fed; the others turn into
  holes, and the columns that NO row keeps (the common tail, past max_b n_b) are cut at once;
- when holes fill a quarter of the columns (`COMPACT_WHEN`), every row's real columns are
  gathered to the right end (one gather per layer). Keys are cached after RoPE, so a key
  keeps its position wherever its column moves;
- finished rows (eos, or max_new_tokens) LEAVE the batch: their cache rows are dropped, so they
  cost nothing afterwards (on the static path below they stay, as padding rows).
Caches must be full-attention `DynamicLayer`s (a sliding window would drop states by column,
not by the row's own positions), and attention must accept a 4-D float mask (eager or sdpa,
not flash-attention).

Static path (`static_cache=True`, or `compile=`): each model cache (target, draft model) is a
`StaticRaggedCache`, one HF `StaticCache` [B, kv_heads, capacity, head_dim] per layer,
allocated once per model, batch size and capacity and reused by the next call (as in
`heads/static_target.py`, weights may change in place, the modules and config may not), with capacity
= longest prompt + max_new_tokens + K + 1 rounded up to `CAPACITY_STEP`. Columns are written
at a pointer: a tail cut moves it back, a compaction is an in-place gather, nothing grows.
Before a call that would not fit, the cache compacts (its longest row then holds at most
longest prompt + max_new_tokens - 2 columns), so the capacity never overflows. The mask
[B, 1, fed, capacity] is built inside the step from tensors (valid [B, capacity], the pointer,
each row's fed span). The batch keeps its B rows: a finished row stays as a padding row
(token 0, no real column, it sees only itself; outputs dropped, stats untouched), since a
fixed shape is what lets `compile=` `torch.compile` each step once: the target's
verification at width K + 1 (1 target-only), the draft model's at widths 1 and 2 (a draft
step; a catch-up), narrower calls padded up; prefills run uncompiled. Compilation happens
before the clock starts (`BatchResult.compile_seconds`). The price: a finished row still costs
its share of every later forward, and attention reads all `capacity` columns. The EAGLE
head keeps its dynamic `EagleCache` (finished rows leave it); Medusa has no cache.

Drafters (chains only; trees and Medusa's lossy typical acceptance are batch-1 only):
- `BatchedDraftModel(model)`: a small causal LM with its own ragged cache; it samples with the
  target's settings and returns the exact q it sampled from.
- `BatchedMedusa(heads)`: the argmax of each head on the target's last
  hidden state, taken from the verification forward (no extra target pass); deterministic,
  so q is one-hot on each token and the rule stays lossless at any temperature.
- `BatchedEagle(head)`: an EAGLE-1/3 chain; the head's own ragged cache holds only real
  (token, target feature) pairs, as in `eval/eagle.py`.
- None: target-only batched decoding (the speedup baseline at batch B), the same loop.
`as_batched` turns the batch-1 `DraftModelDrafter`, `MedusaDrafter` and `EagleDrafter` (chain,
lossless) into these.

Randomness: row b draws from its own generator seeded with `row_seed(seed, b)`, and makes the
same calls in the same order as `generate(..., seed=row_seed(seed, b))` of `eval/decoder.py`;
so a row's output never depends on the other rows (up to float round-off of batched vs
unbatched forwards), and is distributed exactly as the target's.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from draftsmith.eval.decoder import DecodeStats, eos_set, synchronize
from draftsmith.eval.drafters import Drafter, DraftModelDrafter, MedusaDrafter
from draftsmith.eval.sampling import SamplingConfig, draw, verify_chain
from draftsmith.heads.static_target import CAPACITY_STEP, Compiler, StaticCacheOverflow, compile_mode
from draftsmith.heads.target import CausalLMAdapter, ForwardResult

#: Compact a ragged cache when its holes (columns past the longest row's real count) make up at
#: least this fraction of it. Attention then never reads more than 1 / (1 - 0.25) = 4/3 of the
#: live cache, and a compaction (one gather of K and V per layer, about one attention pass of
#: memory traffic) happens at most once every few calls. 0 compacts whenever there is a hole.
COMPACT_WHEN = 0.25

_MAX_SEED = 2**32  # row_seed packs (seed, row) into one 64-bit generator seed


def row_seed(seed: int, row: int) -> int:
    """Seed of row `row`'s generator: distinct for every (seed, row), so batches run with
    different seeds share no stream, and row b of a batch draws exactly what batch-1
    `generate(..., seed=row_seed(seed, b))` draws."""
    return seed * _MAX_SEED + row


# ------------------------------------------------------------------------- the ragged cache


class RaggedCache:
    """Which columns of a batch-shared KV cache are real, per row; and the moves on it.

    `cache` is a `transformers.DynamicCache` of full-attention layers, or an `EagleCache`: both
    hold keys/values [B, heads, S, head_dim] that the model appends to. The owner calls
    `mask` before a forward, then `append` with what each row keeps of the fed columns.
    Per-row counts live on the host, so no operation here waits on the device.
    """

    def __init__(self, cache, batch: int, device: torch.device):
        self.cache = cache
        self.device = device
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.counts = [0] * batch  # real columns per row

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def _holders(self) -> list:
        """Objects with `.keys` / `.values` [B, ..., S, D] (layers that hold nothing skipped)."""
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # an EagleCache: one layer
            return [self.cache] if self.cache.keys is not None else []
        return [layer for layer in layers if layer.is_initialized and layer.keys is not None and layer.keys.numel()]

    def mask(self, fed: int, lo: list[int] | None, hi: list[int] | None, dtype: torch.dtype) -> torch.Tensor:
        """Float additive mask [B, 1, fed, S + fed] for `fed` new columns of which row b's
        real ones are [lo_b, hi_b) (None: all): each sees its row's real cache columns and the
        real new columns up to itself. A padding column sees itself, so no query row is fully
        blocked (its output is never read)."""
        batch = self.valid.shape[0]
        new_real = _spans(fed, lo, hi, batch, self.device)  # [B, fed]
        causal = torch.ones(fed, fed, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(fed, dtype=torch.bool, device=self.device)
        new = (causal[None] & new_real[:, None, :]) | eye[None]  # [B, fed(query), fed(key)]
        past = self.valid[:, None, :].expand(batch, fed, self.length)
        allowed = torch.cat([past, new], dim=-1)[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    def append(self, fed: int, lo: list[int] | None = None, hi: list[int] | None = None) -> None:
        """The last forward added `fed` columns; row b keeps [lo_b, hi_b) of them (None: all).
        Columns past max_b hi_b are kept by no row and are cut right away."""
        batch = self.valid.shape[0]
        lo = [0] * batch if lo is None else lo
        hi = [fed] * batch if hi is None else hi
        self._check_length(self.length + fed)
        width = max(hi, default=0)
        self.valid = torch.cat([self.valid, _spans(width, lo, hi, batch, self.device)], dim=1)
        self.counts = [c + max(0, h - l) for c, l, h in zip(self.counts, lo, hi)]
        if width < fed:
            self._cut(self.length)

    def retain(self, start: int, keep: list[int]) -> None:
        """Of the columns from `start` on, all appended whole (every row real), row b keeps the
        first keep_b; the rest become holes, and the common tail is cut."""
        batch, width = self.valid.shape[0], self.length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        cut = start + max(keep, default=0)
        self.valid = torch.cat([self.valid[:, :start], _spans(cut - start, None, keep, batch, self.device)], dim=1)
        self.counts = [c - width + k for c, k in zip(self.counts, keep)]
        self._cut(cut)

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        """Keep only the batch rows `rows` (device tensor; `kept` the same indices on the host)."""
        for holder in self._holders():
            holder.keys = holder.keys.index_select(0, rows.to(holder.keys.device))
            holder.values = holder.values.index_select(0, rows.to(holder.values.device))
        self.valid = self.valid.index_select(0, rows.to(self.device))
        self.counts = [self.counts[i] for i in kept]

    def compact_if_wasteful(self) -> bool:
        """Gather every row's real columns to the right end when the holes are worth it."""
        length, live = self.length, max(self.counts, default=0)
        waste = length - live
        if waste <= 0 or waste < COMPACT_WHEN * length:
            return False
        # A stable sort of 0/1 puts each row's holes first and its real columns after them, in
        # order: the last `live` sorted columns are the compacted (right-aligned) row.
        order = torch.sort(self.valid.to(torch.int32), dim=1, stable=True)
        index = order.indices[:, length - live :]
        self.valid = order.values[:, length - live :].bool()
        for holder in self._holders():
            for name in ("keys", "values"):
                x = getattr(holder, name)
                shape = (x.shape[0],) + (1,) * (x.dim() - 3) + (live, 1)
                gather = index.to(x.device).view(shape).expand(*x.shape[:-2], live, x.shape[-1])
                setattr(holder, name, x.gather(-2, gather))
        return True

    def _cut(self, length: int) -> None:
        for holder in self._holders():
            holder.keys = holder.keys[..., :length, :]
            holder.values = holder.values[..., :length, :]
        self.valid = self.valid[:, :length]

    def _check_length(self, expected: int) -> None:
        for holder in self._holders():
            if holder.keys.shape[-2] != expected:
                raise RuntimeError(
                    f"ragged cache out of step: the model cache holds {holder.keys.shape[-2]} columns, "
                    f"the bookkeeping expects {expected} (was the cache fed outside `generate_batch`?)"
                )


def _spans(width: int, lo: list[int] | None, hi: list[int] | None, batch: int, device) -> torch.Tensor:
    """Bool [B, width]: True on columns [lo_b, hi_b) of row b (None: 0 / width)."""
    cols = torch.arange(width, device=device)[None]
    out = torch.ones(batch, width, dtype=torch.bool, device=device)
    if lo is not None:
        out &= cols >= torch.tensor(lo, device=device)[:, None]
    if hi is not None:
        out &= cols < torch.tensor(hi, device=device)[:, None]
    return out


def _right_aligned(pieces: list[list[int]], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token lists placed at the right end of a block as wide as the longest: ids [B, W],
    positions [B, W] (start_b, start_b + 1, ... on the real columns; 0 on padding) and the
    first real column lo_b of each row (real columns are [lo_b, W))."""
    width = max(len(p) for p in pieces)
    lo = [width - len(p) for p in pieces]
    ids = [[0] * l + p for l, p in zip(lo, pieces)]
    positions = [[0] * l + list(range(s, s + len(p))) for l, s, p in zip(lo, starts, pieces)]
    shape = (len(pieces), width)
    return (
        torch.tensor(ids, dtype=torch.long, device=device).view(shape),
        torch.tensor(positions, dtype=torch.long, device=device).view(shape),
        lo,
    )


def _right_align(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Move row b's first counts_b columns of x [B, T, ...] to the right end of a block of width
    max(counts); returns the block and each row's first real column."""
    width = max(counts)
    lo = [width - c for c in counts]
    src = torch.arange(width, device=x.device)[None] - torch.tensor(lo, device=x.device)[:, None]
    src = src.clamp(min=0).view(*src.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x[:, :width].gather(1, src), lo


def _max_positions(config) -> int | None:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def _check_dynamic_layers(cache, what: str) -> None:
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        raise ValueError(
            f"batched decoding needs full-attention caches, but the {what}'s cache has {', '.join(odd)} layers: "
            "a ragged batch keeps holes between real columns, which a sliding window would count as tokens. "
            "Decode this model with eval/decoder.py `generate` (batch 1)."
        )



# ------------------------------------------------------------------ the static ragged cache


def _static_ragged_mask(valid, start, lo, hi, fed: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, fed, capacity] of `fed` new columns written at `start` (0-d
    long) over a preallocated cache: new column j of row b is real when lo_b <= j < hi_b
    (lo, hi: [B] long). A new column sees its row's real columns before `start` (`valid`
    [B, capacity] bool), the real new columns up to itself, and itself (so no query row is
    fully blocked: padding columns and padding rows see only themselves); every slot past the
    new columns is junk and blocked. Pure tensor code: it runs inside the compiled step."""
    capacity = valid.shape[1]
    device = valid.device
    cols = torch.arange(fed, device=device)
    new_real = (cols[None] >= lo[:, None]) & (cols[None] < hi[:, None])  # [B, fed]
    causal = torch.ones(fed, fed, dtype=torch.bool, device=device).tril()
    eye = torch.eye(fed, dtype=torch.bool, device=device)
    allowed = (causal[None] & new_real[:, None, :]) | eye[None]  # [B, fed(query), fed(key)]
    rel = torch.arange(capacity, device=device) - start  # slot - start
    sees = allowed.index_select(2, rel.clamp(0, fed - 1))  # [B, fed, capacity]
    past = (valid & (rel < 0)[None])[:, None, :]
    ok = past | (((rel >= 0) & (rel < fed))[None, None] & sees)
    return torch.where(ok, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def _make_ragged_step(model: PreTrainedModel, cache: StaticCache, hidden_layers: tuple[int, ...], last_only: bool):
    """The one forward of a static ragged cache (compiled or not). Inputs: ids [B, W],
    positions [B, W], valid [B, capacity] bool, start (0-d long: the first slot written),
    lo [B] / hi [B] long (the real span of each row's fed columns). Returns (logits, hidden
    states of `hidden_layers`); `last_only`: the logits of the last column only."""
    layers = list(cache.layers)
    dtype = model.dtype

    def step(ids, positions, valid, start, lo, hi):
        # HF's StaticLayer writes at its cumulative length: point every layer at `start`.
        for layer in layers:
            layer.cumulative_length.copy_(start)
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=_static_ragged_mask(valid, start, lo, hi, ids.shape[1], dtype),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1 if last_only else 0,
        )
        hidden = tuple(out.hidden_states[i] for i in hidden_layers) if hidden_layers else ()
        return out.logits, hidden

    return step


class StaticRaggedCache(RaggedCache):
    """A `RaggedCache` over a preallocated HF `StaticCache` of `capacity` columns per row
    ([B, kv_heads, capacity, head_dim] per layer), with the forward that writes into it.

    Columns [0, length) are in use; a forward writes its fed columns at `length` (the pointer),
    so cutting the common tail moves the pointer back, and a compaction gathers every row's real
    columns into [0, live) in place. Nothing grows per step and nothing is concatenated. The
    additive mask is built INSIDE the step from tensors (valid [B, capacity], the pointer, each
    row's fed span), so every call of a width has the same shapes: `warm_up` compiles the step
    for given widths (`heads.static_target.Compiler`: a warning and the uncompiled step when
    compilation is unavailable or fails), and a narrower call is padded up to the nearest
    compiled width (padding columns lie past every row's span: holes no one keeps).

    The B physical rows stay for the whole request: `select` only remaps the caller's rows
    (`rows[i]`: the physical row of row i), and a dropped row becomes a padding row (token 0, no
    real column, it sees only itself; its outputs are dropped). Callers pass and get tensors
    of their own (fewer) rows; the forward scatters them into the B-row batch and gathers back.
    """

    def __init__(
        self, model: PreTrainedModel, batch: int, capacity: int, *, compile: bool | str = False, owner: str = "the target"
    ):
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
        if odd:
            raise ValueError(
                f"the static cache needs full-attention layers, but {owner} has {', '.join(odd)} layers (a sliding "
                "window is a ring buffer that cannot hold a ragged batch's holes). Decode it with static_cache=False."
            )
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.device = model.device
        cache.early_initialization(batch, kv_heads, head_dim, model.dtype, self.device)
        self.cache, self.model, self.owner = cache, model, owner
        self.batch, self.capacity = batch, capacity
        self.compiler = Compiler(compile, self.device, owner)
        self._eager: dict[tuple, object] = {}  # (hidden_layers, last_only) -> uncompiled step
        self._compiled: dict[tuple, object] = {}  # (hidden_layers, width) -> compiled all-logits step
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Empty, every row in use (the buffers and the compiled steps stay: a new request)."""
        self._length = 0
        self._valid.zero_()
        self.rows = list(range(self.batch))
        self._rows = None  # the same as a device tensor; None while it is the identity
        self.counts = [0] * self.batch

    @property
    def length(self) -> int:
        return self._length

    @property
    def valid(self) -> torch.Tensor:
        """[rows in use, length] (a copy once rows were dropped)."""
        valid = self._valid[:, : self._length]
        return valid if self._rows is None else valid.index_select(0, self._rows)

    def _physical(self, values: list[int] | None, default: int) -> list[int]:
        """Per physical row: values[i] at row rows[i], `default` (None: 0) for the others."""
        values = [default] * len(self.rows) if values is None else values
        out = [0] * self.batch
        for r, v in zip(self.rows, values):
            out[r] = v
        return out

    # --------------------------------------------------------------------- the moves

    def mask(self, fed, lo, hi, dtype) -> torch.Tensor:
        """The step's mask [rows, 1, fed, capacity] (see `_static_ragged_mask`), for inspection."""
        ids = torch.zeros(len(self.rows), fed, dtype=torch.long)
        mask = _static_ragged_mask(*self._inputs(ids, None, lo, hi)[2:], fed, dtype)
        return mask if self._rows is None else mask.index_select(0, self._rows)

    def append(self, fed: int, lo: list[int] | None = None, hi: list[int] | None = None) -> None:
        start = self._length
        if start + fed > self.capacity:
            raise RuntimeError(f"static ragged cache out of step: {fed} columns appended at {start} of {self.capacity}")
        lo, hi = self._physical(lo, 0), self._physical(hi, fed)
        self._valid[:, start : start + fed] = _spans(fed, lo, hi, self.batch, self.device)
        self.counts = [self.counts[i] + max(0, hi[r] - lo[r]) for i, r in enumerate(self.rows)]
        self._length = start + max(hi, default=0)  # the common tail: the pointer moves back over it

    def retain(self, start: int, keep: list[int]) -> None:
        width = self._length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        self._valid[:, start : self._length] = _spans(width, None, self._physical(keep, 0), self.batch, self.device)
        self.counts = [c - width + k for c, k in zip(self.counts, keep)]
        self._length = start + max(keep, default=0)

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        """Keep rows `kept` (indices into the rows in use); the others turn into padding rows."""
        dropped = sorted(set(self.rows) - {self.rows[i] for i in kept})
        if dropped:
            self._valid[torch.tensor(dropped, device=self.device)] = False
        self.rows = [self.rows[i] for i in kept]
        self._rows = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        self.counts = [self.counts[i] for i in kept]

    def compact_if_wasteful(self) -> bool:
        waste = self._length - max(self.counts, default=0)
        if waste <= 0 or waste < COMPACT_WHEN * self._length:
            return False
        self._compact()
        return True

    def reserve(self, fed: int) -> None:
        """Make room for `fed` more columns, compacting when they would not fit; raise
        `StaticCacheOverflow` (nothing written) when even the compacted cache cannot hold them."""
        if self._length + fed <= self.capacity:
            return
        self._compact()
        if self._length + fed > self.capacity:
            raise StaticCacheOverflow(
                f"static KV cache overflow ({self.owner}): a row holds {self._length} real tokens and {fed} more "
                f"columns were asked for, but the cache was preallocated for {self.capacity}. Nothing was written; "
                "size the cache for the longest prompt + max_new_tokens + K + 1."
            )

    def _compact(self) -> None:
        """Every row's real columns, in order, to [0, live) (right-aligned in it): one gather per
        layer, written over the same buffers (gather first: source and destination overlap)."""
        length, live = self._length, max(self.counts, default=0)
        # A stable sort of 0/1 puts each row's holes first and its real columns after them, in order.
        order = torch.sort(self._valid[:, :length].to(torch.int32), dim=1, stable=True)
        index = order.indices[:, length - live :]
        for holder in self._holders():
            for x in (holder.keys, holder.values):
                gather = index.view(x.shape[0], 1, live, 1).expand(x.shape[0], x.shape[1], live, x.shape[-1])
                x[..., :live, :] = x.gather(-2, gather)
        self._valid[:, :live] = order.values[:, length - live :].bool()
        self._valid[:, live:length] = False
        self._length = live

    # ------------------------------------------------------------------- the forward

    def _step(self, key: tuple):
        if key not in self._eager:
            self._eager[key] = _make_ragged_step(self.model, self.cache, *key)
        return self._eager[key]

    def _inputs(self, ids, positions, lo, hi):
        """The step's inputs over the B physical rows, from the rows in use (padding rows: token
        0 at position 0, no real column)."""
        width = ids.shape[1]
        ids = ids.to(self.device)
        positions = torch.zeros_like(ids) if positions is None else positions.to(self.device)
        if self._rows is not None:
            ids = ids.new_zeros(self.batch, width).index_copy_(0, self._rows, ids)
            positions = positions.new_zeros(self.batch, width).index_copy_(0, self._rows, positions)
        lo = torch.tensor(self._physical(lo, 0), dtype=torch.long, device=self.device)
        hi = torch.tensor(self._physical(hi, width), dtype=torch.long, device=self.device)
        start = torch.tensor(self._length, dtype=torch.long, device=self.device)
        return ids, positions, self._valid, start, lo, hi

    @torch.inference_mode()
    def warm_up(self, widths, hidden_layers: tuple[int, ...] = ()) -> float:
        """Compile the all-logits step of `hidden_layers` for each width and run it once (every
        row a padding row, written past the pointer: the cache content is unchanged). Returns
        the seconds spent compiling; 0 without compilation."""
        hidden_layers = tuple(hidden_layers)
        before = self.compiler.seconds
        for width in sorted(set(widths)):
            if not self.compiler.enabled:  # off, or a failed compile turned it off
                break
            if (hidden_layers, width) in self._compiled:
                continue
            self.reserve(width)
            ids = torch.zeros(len(self.rows), width, dtype=torch.long, device=self.device)
            inputs = self._inputs(ids, None, None, [0] * len(self.rows))
            # One eager call first: HF installs its hidden-state capturing hooks lazily, under a
            # lock dynamo cannot trace (as `StaticCausalLMAdapter.warm_up`).
            self._step((hidden_layers, False))(*inputs)
            compiled = self.compiler.wrap(self._step((hidden_layers, False)))
            if self.compiler.first_calls(f"width {width}", compiled, *inputs):
                self._compiled[(hidden_layers, width)] = compiled
        return self.compiler.seconds - before

    @torch.inference_mode()
    def forward(self, ids, positions, lo=None, hi=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """Write `ids [rows, n]` at the pointer and return their logits (`logits_to_keep`: 0 all,
        1 the last column), with row i's real columns [lo_i, hi_i) (None: all). The bookkeeping
        is the caller's: `append` / `retain` afterwards, as for `RaggedCache`. Runs the smallest
        compiled width >= n that fits (padded), else the uncompiled step at width n."""
        n = ids.shape[1]
        hidden_layers = tuple(hidden_layers)
        fits = [w for (k, w) in self._compiled if k == hidden_layers and n <= w and self._length + w <= self.capacity]
        width = min(fits) if fits else n
        if self._length + width > self.capacity:
            raise StaticCacheOverflow(
                f"static KV cache overflow ({self.owner}): {self._length} columns in use and {width} more were fed, "
                f"but it was preallocated for {self.capacity}; nothing was written (call reserve first)"
            )
        if width > n:  # padding columns: past every row's span, they see only themselves
            ids = torch.nn.functional.pad(ids, (0, width - n))
            positions = torch.nn.functional.pad(positions, (0, width - n))
        if fits:
            logits, hidden = self._compiled[(hidden_layers, width)](*self._inputs(ids, positions, lo, hi))
            if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
                logits, hidden = logits.clone(), tuple(h.clone() for h in hidden)
            logits = logits[:, n - 1 : n] if logits_to_keep == 1 else logits[:, :n]
        else:
            logits, hidden = self._step((hidden_layers, logits_to_keep == 1))(*self._inputs(ids, positions, lo, hi))
        hidden = {i: h[:, :n] for i, h in zip(hidden_layers, hidden)}
        if self._rows is not None:  # back to the rows in use
            logits = logits.index_select(0, self._rows)
            hidden = {i: h.index_select(0, self._rows) for i, h in hidden.items()}
        return ForwardResult(logits=logits, hidden_states=hidden)


#: Per model, role ("target", "draft"), compile mode and batch size, its static ragged cache:
#: the next `generate_batch` of that batch size reuses it (its compiled steps are the expensive
#: part) when it holds enough columns, and replaces it with a larger one when not. A sweep over
#: batch sizes keeps one per size. A role of its own keeps a model used as its own draft apart.
#: So a model decodes one static-path request at a time (no two threads).
_STATIC_CACHES: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()


def static_ragged_cache(model: PreTrainedModel, role: str, batch: int, capacity: int, compile: bool | str) -> StaticRaggedCache:
    """A static ragged cache of `model` in `role` for `batch` rows of at least `capacity`
    columns, made once (grown when too small), reset."""
    slots = _STATIC_CACHES.setdefault(model, {})
    key = (role, compile_mode(compile), batch)
    kv = slots.get(key)
    if kv is None or kv.capacity < capacity:
        kv = slots[key] = StaticRaggedCache(model, batch, capacity, compile=compile, owner=f"the {role}")
    kv.reset()
    return kv


def _ragged_forward(kv: RaggedCache, adapter: CausalLMAdapter, ids, positions, lo, hi, **kwargs) -> ForwardResult:
    """One forward of a ragged batch on either cache: the static one builds its mask inside its
    step, the dynamic one gets a float mask over its live columns."""
    if isinstance(kv, StaticRaggedCache):
        return kv.forward(ids, positions, lo, hi, **kwargs)
    mask = kv.mask(ids.shape[1], lo, hi, adapter.model.dtype)
    return adapter.forward(ids, position_ids=positions, attention_mask=mask, **kwargs)



# ----------------------------------------------------------------------------- drafters


@dataclass
class BatchProposal:
    tokens: torch.Tensor  # [B, K] long (any device); row b's drafts are its first counts[b]
    counts: list[int]  # drafts proposed per row (<= what was asked of that row)
    probs: torch.Tensor | None = None  # [B, K, V] what each token was drawn from; None = deterministic


class BatchedDrafter:
    """What proposes chains for a batch. The decoder drives it:

        drafter.prepare(batch, capacity, compile)      before the clock: capacity (columns per
                                                       row) is None on the dynamic path; returns
                                                       the seconds spent compiling
        drafter.start(prompts, prefill, vocab_size)    prefill: {layer: [B, P, H]} of the
                                                       target's prefill (rows right-aligned)
        proposal = drafter.propose(contexts, num_tokens, sampling, generators)
        drafter.select(rows, kept)                     rows that finished left the batch
        drafter.accepted(num_accepted, committed, hidden)

    `contexts[b]`: row b's tokens so far (host list). `num_tokens[b]`: the most drafts row b
    may get. `committed [B, W]`: row b's tokens emitted this call (its n_b accepted drafts,
    then the correction/bonus token) in its first n_b + 1 columns. `hidden[layer] [B, K+1, H]`:
    the target's states of the fed [last, x_1..x_K]; row b's committed ones are its first n_b + 1.
    """

    name = "drafter"
    #: Target hidden-state ids (HF numbering: 0 = embeddings, L = last layer after the final norm).
    target_layers: tuple[int, ...] = ()

    def max_positions(self) -> int | None:
        """Longest prompt + new tokens the drafter can place (None = no limit of its own)."""
        return None

    def prepare(self, batch: int, capacity: int | None, compile: bool | str) -> float:
        """Set up for the next request (static caches, compilation); the default has none."""
        return 0.0

    def start(self, prompts: list[list[int]], prefill: dict[int, torch.Tensor], vocab_size: int) -> None:
        raise NotImplementedError

    def propose(self, contexts, num_tokens, sampling, generators) -> BatchProposal:
        raise NotImplementedError

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        raise NotImplementedError

    def accepted(self, num_accepted: list[int], committed: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError


class BatchedDraftModel(BatchedDrafter):
    """A small causal LM sharing the target's vocabulary, over its own ragged cache.

    Same bookkeeping as `DraftModelDrafter`: before drafting, each row feeds the tokens its
    cache lacks (the whole prompt at first, then the correction token, or the last draft and
    the bonus); the drafts x_1..x_{K-1} enter the cache while drafting, and after verification
    row b keeps the first n_b of them. Logits are aligned to the target's vocabulary (padded
    with -inf, or cut) so that q and p cover the same tokens. On the static path the cache is a
    `StaticRaggedCache` (set up by `prepare`), and with `compile` its width-1 and width-2 steps
    (a draft step; a catch-up after a correction or a bonus) run compiled.
    """

    def __init__(self, model: PreTrainedModel, name: str = "draft"):
        self.adapter = CausalLMAdapter(model)
        self.name = name
        self.kv: RaggedCache | None = None
        self._static: StaticRaggedCache | None = None  # set by `prepare` on the static path
        self.vocab_size = self.adapter.vocab_size
        self._spec_start = 0  # first cache column of this call's drafts

    def max_positions(self) -> int | None:
        return _max_positions(self.adapter.config)

    def prepare(self, batch, capacity, compile) -> float:
        if capacity is None:
            self._static = None
            return 0.0
        self._static = static_ragged_cache(self.adapter.model, "draft", batch, capacity, compile)
        return self._static.warm_up([1, 2])

    def start(self, prompts, prefill, vocab_size) -> None:
        self.vocab_size = vocab_size
        if self._static is not None:
            self.kv = self._static
            self.kv.reset()
            return
        cache = DynamicCache(config=self.adapter.config)
        _check_dynamic_layers(cache, "draft model")
        self.adapter.cache = cache
        self.kv = RaggedCache(cache, len(prompts), self.adapter.device)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[..., : self.vocab_size] if extra < 0 else logits

    def _forward(self, ids, positions, lo=None, logits_to_keep=0):
        out = _ragged_forward(self.kv, self.adapter, ids, positions, lo, None, logits_to_keep=logits_to_keep)
        self.kv.append(ids.shape[1], lo, None)
        return out.logits[:, -1]

    def propose(self, contexts, num_tokens, sampling, generators) -> BatchProposal:
        device = self.adapter.device
        counts = self.kv.counts
        # Catch up: the tokens each row's cache lacks, right-aligned so the last is column -1.
        ids, positions, lo = _right_aligned([c[n:] for c, n in zip(contexts, counts)], counts, device)
        width = max(num_tokens)
        if isinstance(self.kv, StaticRaggedCache):  # room for the catch-up and the drafts: no compaction between
            self.kv.reserve(ids.shape[1] + width - 1)
        logits = self._forward(ids, positions, lo, logits_to_keep=1)
        self._spec_start = self.kv.length
        base = torch.tensor(self.kv.counts, device=device)  # position of each row's first draft
        tokens, probs = [], []
        for i in range(width):
            logits = self._aligned(logits.float())
            if sampling.greedy:
                token = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # [B, V]: exactly what row b's token is drawn from
                probs.append(q)
                # Per row, the very call DraftModelDrafter makes; rows past their budget take the
                # argmax (never verified) and leave their generator untouched.
                token = torch.stack([
                    draw(q[b].to(g.device), g).reshape(()).to(device) if i < num_tokens[b] else q[b].argmax()
                    for b, g in enumerate(generators)
                ])  # fmt: skip
            tokens.append(token)
            if i + 1 < width:
                logits = self._forward(token[:, None], (base + i)[:, None])
        return BatchProposal(
            tokens=torch.stack(tokens, dim=1),
            counts=list(num_tokens),
            probs=torch.stack(probs, dim=1) if probs else None,
        )

    def select(self, rows, kept) -> None:
        self.kv.select(rows, kept)

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The cache holds each row's context + x_1..x_{K-1}: keep the accepted ones.
        fed = self.kv.length - self._spec_start
        self.kv.retain(self._spec_start, [min(n, fed) for n in num_accepted])
        self.kv.compact_if_wasteful()


class BatchedMedusa(BatchedDrafter):
    """Medusa heads as a chain: head j's argmax on the target's last (post-norm) hidden state
    of each row's last committed token proposes draft j + 1 (`MedusaDrafter` with tree=None).
    The state comes from the verification forward that committed the token: no extra pass.
    A row whose prompt is one token has no state before its first call and proposes nothing.
    """

    def __init__(self, heads: torch.nn.Module, target_num_layers: int | None = None, name: str = "medusa"):
        self.heads = heads
        self.num_heads = int(heads.config.num_heads)
        if target_num_layers is None:  # recorded by MedusaHeads.for_target
            target_num_layers = getattr(heads.config, "target_num_layers", None)
        if target_num_layers is None:
            raise ValueError(
                "BatchedMedusa needs the target's number of layers (the heads read its last, post-norm hidden "
                "state): pass target_num_layers, the heads' config does not record it"
            )
        self.target_layers = (int(target_num_layers),)
        self.name = name
        self._h: torch.Tensor | None = None  # [B, H] state of each row's last committed token
        self._has: list[bool] = []

    def start(self, prompts, prefill, vocab_size) -> None:
        self._has = [len(p) >= 2 for p in prompts]
        states = prefill.get(self.target_layers[0])
        self._h = states[:, -1] if states is not None else None  # right-aligned: column -1 is real

    def propose(self, contexts, num_tokens, sampling, generators) -> BatchProposal:
        counts = [min(k, self.num_heads) if has else 0 for k, has in zip(num_tokens, self._has)]
        depth = max(counts)
        if depth == 0:  # also when no row has a state yet (every prompt one token long)
            return BatchProposal(tokens=torch.zeros(len(counts), 0, dtype=torch.long), counts=counts)
        param = next(self.heads.parameters(), None)
        h = self._h if param is None else self._h.to(device=param.device, dtype=param.dtype)
        logits = self.heads(h, num_heads=depth)  # [depth, B, V]: head j proposes draft j + 1
        return BatchProposal(tokens=logits.argmax(-1).T.to(self._h.device), counts=counts)

    def select(self, rows, kept) -> None:
        self._h = self._h.index_select(0, rows.to(self._h.device)) if self._h is not None else None
        self._has = [self._has[i] for i in kept]

    def accepted(self, num_accepted, committed, hidden) -> None:
        states = hidden[self.target_layers[0]]  # [B, K+1, H]
        rows = torch.arange(states.shape[0], device=states.device)
        self._h = states[rows, torch.tensor(num_accepted, device=states.device)]
        self._has = [True] * states.shape[0]


class BatchedEagle(BatchedDrafter):
    """An EAGLE-1/EAGLE-3 chain (`EagleDrafter` with tree=None) for a batch.

    Pair t of a row is (token_{t+1}, f_t) at position t, f_t the target's feature at t
    (`head.project` of the concatenated `aux_layer_ids` states). The head's ragged cache holds
    the row's REAL pairs only: the pairs of the tokens a verification committed are fed at
    the next `propose` (their features arrive with the verification), then the chain drafts
    with the head's own g as the feature, and those speculative columns are cut again. The
    head's cache stays a dynamic `EagleCache` on the static path too (it is not a HF cache).
    """

    def __init__(self, head: torch.nn.Module, name: str = "eagle"):
        self.head = head
        self.target_layers = tuple(int(i) for i in head.config.aux_layer_ids)
        if not self.target_layers:
            raise ValueError("head.config.aux_layer_ids is empty: the EAGLE head must name the target layers it reads")
        self.name = name
        self.kv: RaggedCache | None = None
        self._pending = None  # (ids, features, positions, lo) of the pairs not yet fed
        self._real: list[int] = []  # real pairs per row
        self._root = None  # (g [B, H], logits [B, Vd]) of each row's last real pair
        self._has: list[bool] = []

    def max_positions(self) -> int | None:
        return _max_positions(self.head.config)

    def _param(self) -> torch.Tensor:
        return next(self.head.parameters())

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        param = self._param()
        aux = torch.cat([hidden[i].to(device=param.device, dtype=param.dtype) for i in self.target_layers], dim=-1)
        return self.head.project(aux)

    def start(self, prompts, prefill, vocab_size) -> None:
        from draftsmith.heads.eagle import EagleCache  # imported late: the head is optional

        batch, device = len(prompts), self._param().device
        self.kv = RaggedCache(EagleCache(), batch, device)
        self._real, self._has, self._root = [0] * batch, [False] * batch, None
        self._pending = None
        if prefill:  # pair t = (prompt[t + 1], f_t): the prefill's own layout, one token on
            ids, positions, lo = _right_aligned([p[1:] for p in prompts], [0] * batch, device)
            self._pending = (ids, self._features(prefill), positions, lo)

    def _feed(self, ids, features, positions, lo):
        mask = self.kv.mask(ids.shape[1], lo, None, self._param().dtype)
        out, logits = self.head(ids, features, position_ids=positions, attention_mask=mask, cache=self.kv.cache)
        self.kv.append(ids.shape[1], lo, None)
        return out[:, -1], logits[:, -1]

    def propose(self, contexts, num_tokens, sampling, generators) -> BatchProposal:
        device = self._param().device
        if self._pending is not None:
            ids, features, positions, lo = self._pending
            g, logits = self._feed(ids, features, positions, lo)
            fed = [ids.shape[1] - l for l in lo]
            if self._root is None:
                self._root = (g, logits)
            else:  # a row with no new pair keeps its old root
                got = torch.tensor([f > 0 for f in fed], device=device)[:, None]
                self._root = (torch.where(got, g, self._root[0]), torch.where(got, logits, self._root[1]))
            self._real = [r + f for r, f in zip(self._real, fed)]
            self._has = [h or f > 0 for h, f in zip(self._has, fed)]
            self._pending = None
        counts = [k if has else 0 for k, has in zip(num_tokens, self._has)]
        width = max(counts)
        if width == 0:
            return BatchProposal(tokens=torch.zeros(len(counts), 0, dtype=torch.long, device=device), counts=counts)
        start = self.kv.length
        base = torch.tensor(self._real, device=device)
        g, logits = self._root
        drafted = []
        for i in range(width):
            token = self.head.draft_to_target(logits.argmax(-1))  # the head reads target ids
            drafted.append(token)
            if i + 1 < width:  # the next position: the drafted token with the head's own g
                g, logits = self._feed(token[:, None], g[:, None], (base + i)[:, None], None)
        self.kv.retain(start, [0] * len(counts))  # only real pairs stay
        self.kv.compact_if_wasteful()
        return BatchProposal(tokens=torch.stack(drafted, dim=1), counts=counts)

    def select(self, rows, kept) -> None:
        self.kv.select(rows, kept)
        self._real = [self._real[i] for i in kept]
        self._has = [self._has[i] for i in kept]
        if self._root is not None:
            self._root = tuple(x.index_select(0, rows.to(x.device)) for x in self._root)
        self.kv.compact_if_wasteful()

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The pairs of the committed tokens: (token after each fed column, that column's feature)
        # for the fed last token and the n_b accepted drafts.
        counts = [n + 1 for n in num_accepted]
        device = self._param().device
        ids, lo = _right_align(committed.to(device), counts)
        features, _ = _right_align(self._features(hidden), counts)
        width = ids.shape[1]
        offsets = torch.arange(width, device=device)[None] - torch.tensor(lo, device=device)[:, None]
        positions = torch.where(offsets >= 0, torch.tensor(self._real, device=device)[:, None] + offsets, 0)
        self._pending = (ids, features, positions, lo)


def as_batched(drafter: Drafter | BatchedDrafter) -> BatchedDrafter:
    """The batched version of a batch-1 chain drafter (draft model, Medusa, EAGLE)."""
    if isinstance(drafter, BatchedDrafter):
        return drafter
    from draftsmith.eval.eagle import EagleDrafter

    if getattr(drafter, "typical", None) is not None:
        raise ValueError(
            f"drafter {drafter.name!r} uses Medusa's typical acceptance (lossy): batched decoding is lossless "
            "only; build it with typical=None"
        )
    if isinstance(drafter, DraftModelDrafter):
        return BatchedDraftModel(drafter.adapter.model, name=drafter.name)
    if isinstance(drafter, (MedusaDrafter, EagleDrafter)):
        if drafter.tree is not None:
            raise ValueError(
                f"drafter {drafter.name!r} proposes trees: batched decoding verifies chains only; build it with tree=None"
            )
        if isinstance(drafter, MedusaDrafter):
            return BatchedMedusa(drafter.heads, drafter.target_layers[0], name=drafter.name)
        return BatchedEagle(drafter.head, name=drafter.name)
    raise TypeError(
        f"no batched version of {type(drafter).__name__}: pass a BatchedDrafter (BatchedDraftModel, BatchedMedusa, "
        "BatchedEagle), a DraftModelDrafter, or a chain MedusaDrafter / EagleDrafter"
    )


# ------------------------------------------------------------------------------ results


@dataclass
class BatchResult:
    """What `generate_batch` returns; rows are in the order of the prompts.

    `rows[b]` holds row b's counters in `DecodeStats` conventions (proposed/accepted per call
    the row took part in, reached/accepted_at per draft position, new_tokens), and its times:
    `ttft_seconds` (start -> its first new token), `total_seconds` (start -> it finished),
    `target_seconds` / `drafter_seconds` (the calls it waited through), `prefill_seconds`.
    Batch timers: `call_seconds[j]` the verification of call j (target forward + acceptance),
    `drafter_seconds[j]` the drafting before it and the drafter's update after it,
    `call_rows[j]` the rows still decoding at call j. All timers are device-synchronised.
    `compile_seconds`: the warm-up compilation of the static path, before the clock started
    (never part of `total_seconds`).
    """

    tokens: list[list[int]]
    rows: list[DecodeStats]
    stopped: list[str]  # per row: "eos" or "length"
    call_seconds: list[float] = field(default_factory=list)
    drafter_seconds: list[float] = field(default_factory=list)
    call_rows: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    compile_seconds: float = 0.0

    @property
    def target_calls(self) -> int:
        return len(self.call_seconds)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def ttft_seconds(self) -> list[float]:
        return [r.ttft_seconds for r in self.rows]

    @property
    def finish_seconds(self) -> list[float]:
        return [r.total_seconds for r in self.rows]

    @property
    def stats(self) -> DecodeStats:
        """Every row's counters pooled (tau, alpha per position over all rows' calls, as batch-1
        stats of the same rows summed), with the batch's own timers: target/drafter seconds
        are the sums of the per-call lists, ttft the earliest row's."""
        total = DecodeStats()
        for row in self.rows:
            total = total + row
        total.target_seconds = sum(self.call_seconds)
        total.drafter_seconds = sum(self.drafter_seconds)
        total.prefill_seconds = self.prefill_seconds
        total.ttft_seconds = min(self.ttft_seconds, default=0.0)
        total.total_seconds = self.total_seconds
        total.compile_seconds = self.compile_seconds
        return total


# ------------------------------------------------------------------------------ decoding


def _check_prompts(prompts) -> list[torch.Tensor]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of 1-D LongTensors, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for b, prompt in enumerate(prompts):
        if not isinstance(prompt, torch.Tensor) or prompt.dtype != torch.long:
            raise ValueError(f"prompts[{b}] must be a LongTensor, got {getattr(prompt, 'dtype', type(prompt).__name__)}")
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompts[{b}] must be a non-empty 1-D (or [1, T]) tensor, got shape {list(prompt.shape)}")
        out.append(prompt)
    return out


@torch.inference_mode()
def generate_batch(
    target: PreTrainedModel | CausalLMAdapter,
    prompts: list[torch.Tensor],
    drafter: BatchedDrafter | Drafter | None = None,
    *,
    num_draft_tokens: int = 4,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int = 0,
    static_cache: bool = False,
    compile: bool | str = False,
) -> BatchResult:
    """Decode every prompt up to `max_new_tokens` (or its first eos), all rows in one batch.

    Each call drafts up to K = `num_draft_tokens` tokens per row (fewer near a row's budget),
    verifies every row's [last, x_1..x_K] in ONE target forward, and lets each row keep its own
    accepted prefix. Lossless per row: greedy equals the target's greedy decoding; with
    sampling each row is distributed as the target's sampling under `sampling`. K = 0 or no
    drafter: target-only decoding through the same loop.

    `static_cache=True`: the target's and a draft model's KV caches are preallocated
    (`StaticRaggedCache`, capacity = longest prompt + max_new_tokens + K + 1 rounded up to
    `CAPACITY_STEP`; it cannot overflow: a call that would not fit compacts first) and finished
    rows stay in the batch as padding rows. `compile=True` (or a mode of
    `heads.static_target.COMPILE_MODES`; implies the static cache): the target's verification
    (width K + 1, or 1) and the draft model's steps (widths 1, 2) are `torch.compile`d before
    the clock starts (`compile_seconds`), and reused by later calls of the same batch size
    and capacity; without a working compiler it warns and runs uncompiled. Same tokens as the
    default path (greedy), same law (sampling).
    """
    prompts = _check_prompts(prompts)
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens (K) must be an integer >= 0 (0 = target only), got {num_draft_tokens!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = SamplingConfig() if sampling is None else sampling  # None: greedy
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    adapter = target if isinstance(target, CausalLMAdapter) else CausalLMAdapter(target)
    if drafter is not None:
        drafter = as_batched(drafter)
    k_max = num_draft_tokens if drafter is not None else 0
    if k_max == 0:
        drafter = None
    limits = [("target", _max_positions(adapter.config))]
    if drafter is not None:
        limits.append((f"drafter {drafter.name!r}", drafter.max_positions()))
    for b, prompt in enumerate(prompts):
        for what, limit in limits:
            if limit is not None and prompt.numel() + max_new_tokens > limit:
                raise ValueError(
                    f"prompts[{b}] has {prompt.numel()} tokens; with max_new_tokens={max_new_tokens} the row reaches "
                    f"{prompt.numel() + max_new_tokens} positions, more than the {what}'s max_position_embeddings={limit}"
                )
    layers = drafter.target_layers if drafter is not None else ()
    num_layers = adapter.num_layers
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"drafter {drafter.name!r} reads target layers {layers}; the target has 0..{num_layers}")

    static = static_cache or compile not in (False, None)
    device = adapter.device
    eos = eos_set(eos_token_id)
    batch = len(prompts)
    generators = [torch.Generator(device=device).manual_seed(row_seed(seed, b)) for b in range(batch)]
    contexts = [p.tolist() for p in prompts]  # prompt + emitted, per row, on the host
    new: list[list[int]] = [[] for _ in range(batch)]
    stats = [DecodeStats(num_draft_tokens=k_max) for _ in range(batch)]
    stopped = ["length"] * batch
    result = BatchResult(tokens=new, rows=stats, stopped=stopped)

    def now() -> float:
        synchronize(device)
        return time.perf_counter()

    capacity = None
    if static:
        # Room for every row's prompt, its new tokens and the widest call (K + 1 columns);
        # `reserve` compacts when the pointer gets there, so it never overflows.
        longest = max(len(c) for c in contexts)
        capacity = -(-(longest + max_new_tokens + k_max + 1) // CAPACITY_STEP) * CAPACITY_STEP
        kv = static_ragged_cache(adapter.model, "target", batch, capacity, compile)
        result.compile_seconds = kv.warm_up([k_max + 1], hidden_layers=layers)
    if drafter is not None:  # before the clock: compilation is never part of the decoding time
        result.compile_seconds += drafter.prepare(batch, capacity, compile)
    start = now()
    if not static:
        cache = DynamicCache(config=adapter.config)
        _check_dynamic_layers(cache, "target")
        adapter.cache = cache
        kv = RaggedCache(cache, batch, device)
    # Prefill: every prompt token but the last (the first call feeds it with the drafts).
    prefill = {}
    if max(len(c) for c in contexts) > 1:
        ids, positions, lo = _right_aligned([c[:-1] for c in contexts], [0] * batch, device)
        out = _ragged_forward(kv, adapter, ids, positions, lo, None, hidden_layers=layers, logits_to_keep=1)
        kv.append(ids.shape[1], lo, None)
        prefill = out.hidden_states
    if drafter is not None:
        drafter.start(contexts, prefill, adapter.vocab_size)
    result.prefill_seconds = now() - start
    for row in stats:
        row.prefill_seconds = result.prefill_seconds

    active = list(range(batch))  # original index of each row still decoding
    while active:
        size = len(active)
        budget = [min(k_max, max_new_tokens - len(new[r]) - 1) for r in active]  # never draft past the budget
        t0 = now()
        proposal = None
        if drafter is not None and max(budget) > 0:
            proposal = drafter.propose([contexts[r] for r in active], budget, sampling, [generators[r] for r in active])
            budget = [min(k, c) for k, c in zip(budget, proposal.counts)]
        t1 = now()
        ks = budget  # drafts per row this call
        width = max(ks)
        drafts = proposal.tokens[:, :width].to(device) if width else torch.zeros(size, 0, dtype=torch.long, device=device)
        last = torch.tensor([contexts[r][-1] for r in active], device=device)
        fed = torch.cat([last[:, None], drafts], dim=1)
        before = torch.tensor([len(contexts[r]) - 1 for r in active], device=device)  # real tokens before `last`
        positions = before[:, None] + torch.arange(width + 1, device=device)[None]
        if static:
            kv.reserve(k_max + 1)  # the widest call (compiled calls are padded to it)
        out = _ragged_forward(kv, adapter, fed, positions, None, [k + 1 for k in ks], hidden_layers=layers)
        probs = proposal.probs if proposal is not None else None
        accepted, emitted = _verify(out.logits, drafts, ks, probs, sampling, [generators[r] for r in active])
        kv.append(width + 1, None, [n + 1 for n in accepted])  # row b keeps last + its n_b drafts
        # Cut each row's output at its first eos; finished rows leave the batch.
        hits = [next((j for j, t in enumerate(tokens) if t in eos), None) for tokens in emitted]
        for r, tokens, hit in zip(active, emitted, hits):
            new[r].extend(tokens if hit is None else tokens[: hit + 1])
            contexts[r].extend(tokens)
        alive = [i for i, (r, hit) in enumerate(zip(active, hits)) if hit is None and len(new[r]) < max_new_tokens]
        staying = set(alive)
        index = torch.tensor(alive, dtype=torch.long, device=device)
        if alive and len(alive) < size:
            kv.select(index, alive)  # static: they stay as padding rows
        kv.compact_if_wasteful()
        t2 = now()

        for i, r in enumerate(active):
            row, k, n = stats[r], ks[i], accepted[i]
            row.proposed.append(k)
            row.accepted.append(n)
            for j in range(min(n + 1, k)):  # position j + 1 reached; accepted when j < n
                row.reached[j] += 1
                row.accepted_at[j] += int(j < n)
            row.target_seconds += t2 - t1
            if row.ttft_seconds == 0.0:
                row.ttft_seconds = t2 - start
            if i not in staying:
                stopped[r] = "eos" if hits[i] is not None else "length"
                row.new_tokens = len(new[r])
                row.total_seconds = t2 - start
        if alive and drafter is not None:
            if len(alive) < size:
                drafter.select(index, alive)
            width_out = max(accepted[i] for i in alive) + 1
            committed = torch.tensor(
                [emitted[i] + [0] * (width_out - len(emitted[i])) for i in alive], dtype=torch.long, device=device
            ).view(len(alive), width_out)
            hidden = out.hidden_states
            if len(alive) < size:
                hidden = {j: h.index_select(0, index.to(h.device)) for j, h in hidden.items()}
            drafter.accepted([accepted[i] for i in alive], committed, hidden)
        t3 = now()
        result.call_seconds.append(t2 - t1)
        result.call_rows.append(size)
        result.drafter_seconds.append((t1 - t0) + (t3 - t2) if drafter is not None else 0.0)
        for r in active:
            stats[r].drafter_seconds += result.drafter_seconds[-1]
        active = [active[i] for i in alive]

    result.total_seconds = now() - start
    return result


def _verify(logits, drafts, ks, probs, sampling, generators) -> tuple[list[int], list[list[int]]]:
    """Per row b: n_b accepted of its ks[b] drafts, and the tokens it emits (the n_b drafts, then
    the correction or bonus). One device->host copy for the whole batch."""
    width = drafts.shape[1]
    if sampling.greedy:
        # Keep the drafts that equal the target's argmax, then emit the argmax at the first
        # mismatch (or the bonus): `verify_chain_greedy`, on host lists.
        ids = torch.cat([logits.argmax(-1), drafts], dim=1).tolist()
        accepted, emitted = [], []
        for row, k in zip(ids, ks):
            n = 0
            while n < k and row[width + 1 + n] == row[n]:
                n += 1
            accepted.append(n)
            emitted.append(row[: n + 1])  # drafts[:n] == argmax[:n]
        return accepted, emitted
    # Speculative sampling per row, with the row's generator, exactly as batch-1 calls it:
    #   accept x_i with prob min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from
    #   norm(max(0, p_i - q_i)); after K acceptances sample the bonus from p_K.
    # q = None (deterministic drafts) means q one-hot on x_i. Every emitted token ~ p.
    p = sampling.probs(logits.float())  # [B, K+1, V]
    parts = []
    for b, (k, g) in enumerate(zip(ks, generators)):
        q = probs[b : b + 1, :k].to(p.device) if probs is not None and k else None
        n, nxt = verify_chain(p[b : b + 1, : k + 1], drafts[b : b + 1, :k], q, g)
        parts += [n.to(p.device), nxt.to(p.device)]
    flat = torch.cat(parts + [drafts.flatten()]).tolist()
    draft_rows = flat[2 * len(ks) :]
    accepted, emitted = [], []
    for b in range(len(ks)):
        n, nxt = flat[2 * b], flat[2 * b + 1]
        accepted.append(n)
        emitted.append(draft_rows[b * width : b * width + n] + [nxt])
    return accepted, emitted
