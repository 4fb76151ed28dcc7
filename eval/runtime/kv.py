"""The one KV cache of the decoding runtime: B ragged rows over one batch-shared cache per model.

Column s of row b holds a real token of that row or a hole; `valid[b, s]` says which. Every
forward feeds W new columns per row with explicit positions (= the number of the row's real
tokens before it, plus the depth inside a tree) and `attend [B, W, W]` (bool: which fed columns
each fed column sees; a chain is causal over the row's real span, a tree sees its ancestors).
The model gets a float additive 4-D mask built from `valid` and `attend`; afterwards `commit`
says which fed columns each row keeps (a chain: the last token and its accepted drafts; a tree:
the root and the accepted path, wherever its nodes sit). Keys are cached after RoPE, so a kept
column keeps its position, and a tree node's keys, computed seeing only its ancestors, are
exactly what sequential decoding of the path computes. No row is cut to another's length:
- prompts are right-aligned: a shorter prompt's left padding is holes;
- columns that no row keeps (the common tail) are cut at once;
- when holes fill a quarter of the columns (`COMPACT_WHEN`), every row's real columns are
  gathered to the right end (one gather per layer).
Per-row counts live on the host, so no bookkeeping waits on the device.

Two stores, chosen by a setting, behind the same moves:
- `RaggedCache` (growing): a `transformers.DynamicCache` (or the EAGLE head's `EagleCache`);
  finished rows leave the batch (`select` drops their rows).
- `StaticRaggedCache` (preallocated, compile-friendly): one HF `StaticCache`
  [B, kv_heads, capacity, head_dim] per layer, written at a pointer; a tail cut moves the
  pointer back, compaction is an in-place gather, nothing grows. The mask is built INSIDE the
  one step function from tensors (valid, pointer, attend), so every call of a width has the
  same shapes and `warm_up` can `torch.compile` it per width (a narrower call is padded up).
  The B physical rows stay: a finished row becomes a padding row (token 0, no real column, it
  sees only itself; its outputs are dropped).
Sliding-window layers (Mistral, Qwen2's `use_sliding_window`, Gemma-2/3, gpt-oss) keep every
column too: HF's own sliding layers drop states by column, which would count a row's holes as
tokens. The cache keeps each column's position instead, and a sliding layer's mask also blocks
the keys `window` or more positions behind the query (HF takes {"full_attention": mask,
"sliding_attention": mask} for a model with both kinds). Attention must take a 4-D float mask
(eager or sdpa).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from draftsmith.eval.runtime.compiler import CAPACITY_STEP, Compiler, StaticCacheOverflow, compile_mode
from draftsmith.eval.runtime.masks import attention_of, chain_attend, layer_masks, spans, static_mask

#: Compact when holes (columns past the longest row's real count) make up at least this share:
#: attention then never reads more than 4/3 of the live cache, and a compaction (one gather of
#: K and V per layer, about one attention pass of memory traffic) happens once every few calls.
COMPACT_WHEN = 0.25


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [B, n, V] for the fed tokens (or the last `logits_to_keep`)
    hidden_states: dict[int, torch.Tensor]  # layer index (HF numbering: 0 = embeddings) -> [B, n, H]


def capacity_for(columns: int) -> int:
    """A static cache's capacity for `columns`: rounded up so similar requests share one cache
    (and one set of compiled graphs)."""
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


# ----------------------------------------------------------------------- the growing store


class RaggedCache:
    """Which columns of a batch-shared KV cache are real, per row; and the moves on it.

    `cache` is a `transformers.DynamicCache` of full-attention layers, or an `EagleCache`: both
    hold keys/values [B, heads, S, head_dim] that the model appends to. The owner runs a
    forward with `mask` (or through `forward` for a HF model), then `commit`s what each row keeps.
    """

    def __init__(self, cache, batch: int, device: torch.device, window: int | None = None, mixed: bool = False):
        self.cache = cache
        self.device = device
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.counts = [0] * batch  # real columns per row
        self.window, self.mixed = window, mixed
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)  # per column (sliding windows)
        self._fed = None  # positions of the last forward's columns, until `commit`

    @classmethod
    def for_model(cls, model: PreTrainedModel, batch: int, owner: str) -> RaggedCache:
        window, mixed = attention_of(model, owner)
        cache = DynamicCache(config=model.config)
        cache.layers = [DynamicLayer() for _ in cache.layers]  # sliding ones too: the mask applies the window
        return cls(cache, batch, model.device, window, mixed)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    @property
    def dense(self) -> bool:
        """No holes: every row's columns are all real (then a causal forward needs no mask)."""
        return all(c == self.length for c in self.counts)

    def _holders(self) -> list:
        """Objects with `.keys` / `.values` [B, ..., S, D] (layers that hold nothing skipped)."""
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # an EagleCache: one layer
            return [self.cache] if self.cache.keys is not None else []
        return [layer for layer in layers if layer.is_initialized and layer.keys is not None and layer.keys.numel()]

    def mask(self, attend: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None):
        """Float additive mask [B, 1, W, S + W]: a fed column sees its row's real cache columns
        and the fed columns `attend [B, W, W]` marks (and, with a sliding window, those within it
        of the fed `positions [B, W]`; `layer_masks`)."""
        batch, width = attend.shape[0], attend.shape[1]
        past = self.valid[:, None, :].expand(batch, width, self.length)
        allowed = torch.cat([past, attend.to(self.device)], dim=-1)[:, None]
        keys = None if self.window is None else torch.cat([self.positions, positions], dim=1)
        return layer_masks(allowed, dtype, self.window, self.mixed, positions, keys)

    @torch.inference_mode()
    def forward(self, model, ids, positions, attend=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """`model` (a HF causal LM over `self.cache`) on ids [B, W] at positions [B, W];
        `attend=None`: every fed column is real and causal (no mask at all while the cache is
        dense). The bookkeeping is the caller's: `commit` afterwards."""
        mask = None
        if self.window is not None:
            self._fed = positions.to(self.device)
        if attend is not None or not self.dense or self.window is not None:
            if attend is None:
                attend = chain_attend(ids.shape[1], None, None, ids.shape[0], self.device)
            mask = self.mask(attend, model.dtype, self._fed)
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=logits_to_keep,
        )
        hidden = {i: out.hidden_states[i] for i in hidden_layers}
        return ForwardResult(logits=out.logits, hidden_states=hidden)

    def reserve(self, fed: int) -> None:
        """Room for `fed` more columns (the growing store always has it)."""

    def commit(self, keep: torch.Tensor) -> None:
        """The last forward added W columns; row b keeps those `keep [B, W]` marks. Columns kept
        by no row (past the last kept one) are cut right away."""
        width = keep.shape[1]
        self._check_length(self.length + width)
        used = self._count(keep)
        self.valid = torch.cat([self.valid, keep[:, :used].to(self.device)], dim=1)
        if self.window is not None:
            self.positions = torch.cat([self.positions, self._fed[:, :used]], dim=1)
        if used < width:
            self._cut(self.length)

    def _count(self, keep: torch.Tensor) -> int:
        """Add `keep`'s columns to the per-row counts; returns the columns up to the last kept
        one. Read on the host (a mask built there costs no device wait)."""
        host = keep.cpu()
        self.counts = [c + k for c, k in zip(self.counts, host.sum(1).tolist())]
        kept = host.any(0).nonzero()
        return int(kept[-1]) + 1 if kept.numel() else 0

    def commit_spans(self, width: int, lo: list[int] | None = None, hi: list[int] | None = None) -> None:
        """`commit` of the fed columns [lo_b, hi_b) (None: all)."""
        self.commit(spans(width, lo, hi, len(self.counts), "cpu"))

    def retain(self, start: int, keep: list[int]) -> None:
        """Of the columns from `start` on (all committed whole), row b keeps the first keep_b;
        the rest become holes, and the common tail is cut."""
        width = self.length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        cut = start + max(keep, default=0)
        self.valid = torch.cat([self.valid[:, :start], spans(cut - start, None, keep, len(keep), self.device)], 1)
        self.counts = [c - width + k for c, k in zip(self.counts, keep)]
        self._cut(cut)

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        """Keep only the batch rows `rows` (device tensor; `kept` the same indices on the host)."""
        for holder in self._holders():
            holder.keys = holder.keys.index_select(0, rows.to(holder.keys.device))
            holder.values = holder.values.index_select(0, rows.to(holder.values.device))
        self.valid = self.valid.index_select(0, rows.to(self.device))
        self.positions = self.positions.index_select(0, rows.to(self.device))
        self.counts = [self.counts[i] for i in kept]

    @staticmethod
    def _order(valid: torch.Tensor, length: int, live: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of `valid`, the columns of its compacted (right-aligned) form and their
        validity: a stable sort of 0/1 puts each row's holes first and its real columns after
        them, in order, so the last `live` sorted columns are the row compacted."""
        order = torch.sort(valid[:, :length].to(torch.int32), dim=1, stable=True)
        return order.indices[:, length - live :], order.values[:, length - live :].bool()

    def compact_if_wasteful(self) -> bool:
        """Gather every row's real columns to the right end when the holes are worth it."""
        waste = self.length - max(self.counts, default=0)
        if waste <= 0 or waste < COMPACT_WHEN * self.length:
            return False
        self._compact()
        return True

    def _compact(self) -> None:
        length, live = self.length, max(self.counts, default=0)
        index, self.valid = self._order(self.valid, length, live)
        if self.window is not None:
            self.positions = self.positions.gather(1, index)
        for holder in self._holders():
            for name in ("keys", "values"):
                x = getattr(holder, name)
                shape = (x.shape[0],) + (1,) * (x.dim() - 3) + (live, 1)
                gather = index.to(x.device).view(shape).expand(*x.shape[:-2], live, x.shape[-1])
                setattr(holder, name, x.gather(-2, gather))

    def _cut(self, length: int) -> None:
        for holder in self._holders():
            holder.keys = holder.keys[..., :length, :]
            holder.values = holder.values[..., :length, :]
        self.valid, self.positions = self.valid[:, :length], self.positions[:, :length]

    def _check_length(self, expected: int) -> None:
        for holder in self._holders():
            if holder.keys.shape[-2] != expected:
                raise RuntimeError(
                    f"ragged cache out of step: the model cache holds {holder.keys.shape[-2]} columns, "
                    f"the bookkeeping expects {expected} (was the cache fed outside the decoder?)"
                )


# ------------------------------------------------------------------- the preallocated store


def make_step(model: PreTrainedModel, kv: StaticRaggedCache, hidden_layers: tuple[int, ...], last_only: bool):
    """The one forward of a static cache, compiled or not: (ids [B, W], positions [B, W], valid
    [B, capacity], slots [B, capacity] (positions of the columns), start 0-d long, attend
    [B, W, W]) -> (logits, hidden states of `hidden_layers`); `last_only`: the last column's
    logits only."""
    layers, cache = list(kv.cache.layers), kv.cache
    dtype, window, mixed = model.dtype, kv.window, kv.mixed

    def step(ids, positions, valid, slots, start, attend):
        for layer in layers:  # HF's StaticLayer writes at its cumulative length: point it at `start`
            layer.cumulative_length.copy_(start)
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=static_mask(valid, slots, start, attend, positions, dtype, window, mixed),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits, tuple(out.hidden_states[i] for i in hidden_layers)

    return step


def make_chain(step, width: int, num_tokens: int, logits: bool):
    """A greedy draft chain over a static cache's `step` (its last-logits variant), as one
    function: (ids [B, p], positions, valid, slots, start, attend, keep [B, p], bias [V]) ->
    (tokens [B, k], then with `logits` their logits [B, k, V]). It feeds the p catch-up columns
    (`keep`: the real ones), then k - 1 times the argmax of (logits + bias) at the next
    position and slot; `bias` is -inf on ids the target lacks. Pure tensor code: `valid` and
    `slots` are updated functionally, the host's bookkeeping follows (`StaticRaggedCache.chain`)."""

    def chain(ids, positions, valid, slots, start, attend, keep, bias):
        out, _ = step(ids, positions, valid, slots, start, attend)
        rel = torch.arange(valid.shape[1], device=valid.device)[None] - start  # slot - start
        fed = (rel >= 0) & (rel < width)
        # The catch-up's real columns, then every later slot: a step sees only slots before its own.
        valid = torch.where(fed, keep.index_select(1, rel[0].clamp(0, width - 1)), valid) | (rel >= width)
        slots = torch.where(fed, positions.index_select(1, rel[0].clamp(0, width - 1)), slots)
        slots = torch.where(rel >= width, positions[:, -1:] + 1 + rel - width, slots)
        one = torch.ones(ids.shape[0], 1, 1, dtype=torch.bool, device=ids.device)
        tokens, raw = [], []
        for i in range(num_tokens):
            raw.append(out[:, -1])
            tokens.append((raw[-1].float() + bias).argmax(-1))
            if i + 1 < num_tokens:
                out, _ = step(tokens[-1][:, None], positions[:, -1:] + 1 + i, valid, slots, start + width + i, one)
        return (torch.stack(tokens, 1), torch.stack(raw, 1)) if logits else (torch.stack(tokens, 1),)

    return chain


class StaticRaggedCache(RaggedCache):
    """A `RaggedCache` over a preallocated HF `StaticCache` (module docstring), with its forward.

    Callers pass and get tensors of the rows in use; `rows[i]` is the physical row of row i.
    """

    def __init__(self, model: PreTrainedModel, batch: int, capacity: int, *, compile=False, owner: str = "the target"):
        self.window, self.mixed = attention_of(model, owner)
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        cache.layers = [StaticLayer(max_cache_len=capacity) for _ in cache.layers]  # sliding ones: by the mask
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
        self._chains: dict[tuple, object] = {}  # (width, tokens, logits) -> compiled greedy draft chain
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self._slots = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)  # each column's position
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
    def dense(self) -> bool:
        return False  # the mask is always built (in the step)

    @property
    def valid(self) -> torch.Tensor:
        """[rows in use, length] (a copy once rows were dropped)."""
        valid = self._valid[:, : self._length]
        return valid if self._rows is None else valid.index_select(0, self._rows)

    def _physical(self, x: torch.Tensor, fill) -> torch.Tensor:
        """x [rows in use, ...] scattered into the B physical rows (`fill` on padding rows)."""
        if self._rows is None:
            return x
        out = fill(self.batch, *x.shape[1:]).to(device=x.device, dtype=x.dtype)
        return out.index_copy_(0, self._rows.to(x.device), x)

    def mask(self, attend, dtype, positions=None):
        """The step's mask(s) [rows, 1, W, capacity], for inspection."""
        if positions is None:  # only a sliding window reads them
            positions = torch.zeros(attend.shape[:2], dtype=torch.long)
        start, attend = torch.tensor(self._length, device=self.device), self._attend(attend)
        positions = self._physical(positions.to(self.device), torch.zeros)
        mask = static_mask(self._valid, self._slots, start, attend, positions, dtype, self.window, self.mixed)
        rows = (lambda m: m) if self._rows is None else (lambda m: m.index_select(0, self._rows))  # noqa: E731
        return {k: rows(m) for k, m in mask.items()} if isinstance(mask, dict) else rows(mask)

    def _attend(self, attend: torch.Tensor) -> torch.Tensor:
        width = attend.shape[-1]
        eye = lambda b, *_: torch.eye(width, dtype=torch.bool).expand(b, width, width).clone()  # noqa: E731
        return self._physical(attend.to(self.device), eye)

    def commit(self, keep: torch.Tensor) -> None:
        width, start = keep.shape[1], self._length
        if start + width > self.capacity:
            raise RuntimeError(
                f"static ragged cache out of step: {width} columns committed at {start} of {self.capacity}"
            )
        used = self._count(keep)
        self._valid[:, start : start + width] = self._physical(keep.to(self.device), torch.zeros)
        self._length = start + used  # the common tail: the pointer moves back

    def retain(self, start: int, keep: list[int]) -> None:
        width = self._length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        kept = spans(width, None, keep, len(keep), self.device)
        self._valid[:, start : self._length] = self._physical(kept, torch.zeros)
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

    def reserve(self, fed: int) -> None:
        """Room for `fed` more columns, compacting when they would not fit; `StaticCacheOverflow`
        (nothing written) when even the compacted cache cannot hold them."""
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
        layer over the same buffers (gather first: source and destination overlap)."""
        length, live = self._length, max(self.counts, default=0)
        index, valid = self._order(self._valid, length, live)  # every physical row
        for holder in self._holders():
            for x in (holder.keys, holder.values):
                gather = index.view(x.shape[0], 1, live, 1).expand(x.shape[0], x.shape[1], live, x.shape[-1])
                x[..., :live, :] = x.gather(-2, gather)
        self._slots[:, :live] = self._slots.gather(1, index)
        self._valid[:, :live] = valid
        self._valid[:, live:length] = False
        self._length = live

    # ------------------------------------------------------------------- the forward

    def _step(self, key: tuple):
        if key not in self._eager:
            self._eager[key] = make_step(self.model, self, *key)
        return self._eager[key]

    def _inputs(self, ids, positions, attend):
        """The step's inputs; the fed columns' positions go into `slots` (read by later calls)."""
        ids, positions = ids.to(self.device), positions.to(self.device)
        start = torch.tensor(self._length, dtype=torch.long, device=self.device)
        ids, positions = self._physical(ids, torch.zeros), self._physical(positions, torch.zeros)
        if self.window is not None:
            self._slots[:, self._length : self._length + positions.shape[1]] = positions
        return ids, positions, self._valid, self._slots, start, self._attend(attend)

    @torch.inference_mode()
    def warm_up(self, widths, hidden_layers: tuple[int, ...] = (), *, chain: int = 0, vocab: int = 0,
                logits: bool = False) -> float:  # fmt: skip
        """Compile the all-logits step of `hidden_layers` for each width (with `chain` = k > 0:
        the greedy draft chain of k tokens after a catch-up of each width, `make_chain`, over a
        `vocab`-sized bias) and run it once (every column a hole written past the pointer: the
        content is unchanged). Returns the seconds spent compiling; 0 without compilation."""
        hidden_layers = tuple(hidden_layers)
        before = self.compiler.seconds
        for width in sorted(set(widths)):
            key = (width, chain, logits) if chain else (hidden_layers, width)
            compiled = self._chains if chain else self._compiled
            if not self.compiler.enabled or key in compiled:  # off (or a failed compile turned it off), or done
                continue
            self.reserve(width + max(chain - 1, 0))
            rows = len(self.rows)
            # Distinct tensors for every input: dynamo would compile two aliased arguments as one.
            ids, positions = (torch.zeros(rows, width, dtype=torch.long, device=self.device) for _ in range(2))
            inputs = self._inputs(ids, positions, chain_attend(width, None, [0] * rows, rows, self.device))
            if chain:
                ones = torch.ones(self.batch, width, dtype=torch.bool, device=self.device)
                fn = make_chain(self._step(((), True)), width, chain, logits)
                inputs = (*inputs, ones, torch.zeros(vocab, device=self.device))
            else:
                fn = self._step((hidden_layers, False))
            # One eager call first: HF installs its hidden-state capturing hooks lazily, under a
            # lock dynamo cannot trace.
            fn(*inputs)
            wrapped = self.compiler.wrap(fn)
            if self.compiler.first_calls(f"{f'a {chain}-token chain after ' if chain else ''}width {width}", wrapped,
                                         *inputs):  # fmt: skip
                compiled[key] = wrapped
        return self.compiler.seconds - before

    @torch.inference_mode()
    def chain(self, ids, positions, lo: list[int], num_tokens: int, bias: torch.Tensor, logits: bool = False):
        """A greedy draft chain (`make_chain`): feed the right-aligned catch-up ids [rows, p]
        (row b's real columns from lo_b) at `positions`, then draft `num_tokens` tokens, feeding
        each but the last. One compiled call when a chain of >= num_tokens was warmed for p (a
        longer one is cut: its extra drafts stay junk past the pointer), else the same function
        uncompiled. Returns tokens [rows, k] and, with `logits`, their logits [rows, k, V]; the
        cache then holds the catch-up and k - 1 drafts, as step-by-step forwards leave it."""
        width, rows = ids.shape[1], ids.shape[0]
        fits = [k for (w, k, l) in self._chains if (w, l) == (width, logits) and num_tokens <= k
                and self._length + width + k - 1 <= self.capacity]  # fmt: skip
        k = min(fits, default=num_tokens)
        self.reserve(width + k - 1)  # nothing to do when the caller reserved the room (no compaction then)
        fn = self._chains[(width, k, logits)] if fits else make_chain(self._step(((), True)), width, k, logits)
        keep = spans(width, lo, None, rows, "cpu")
        inputs = self._inputs(ids, positions, chain_attend(width, lo, None, rows, self.device))
        out = fn(*inputs, self._physical(keep.to(self.device), torch.zeros), bias.to(self.device))
        out = [x[:, :num_tokens] if self._rows is None else x[:, :num_tokens].index_select(0, self._rows) for x in out]
        if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
            out = [x.clone() for x in out]
        self.commit(keep)
        if num_tokens > 1:
            if self.window is not None:
                drafts = positions[:, -1:].to(self.device) + torch.arange(1, num_tokens, device=self.device)
                self._slots[:, self._length : self._length + num_tokens - 1] = self._physical(drafts, torch.zeros)
            self.commit(torch.ones(rows, num_tokens - 1, dtype=torch.bool))
        return out[0], (out[1] if logits else None)

    @torch.inference_mode()
    def forward(self, model, ids, positions, attend=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """Write ids [rows, n] at the pointer and return their logits (`logits_to_keep`: 0 all, 1
        the last column). Runs the smallest compiled width >= n that fits (padded: the padding
        columns are holes that see only themselves), else the uncompiled step at width n."""
        n, hidden_layers = ids.shape[1], tuple(hidden_layers)
        if attend is None:
            attend = chain_attend(n, None, None, ids.shape[0], self.device)
        fits = [w for (k, w) in self._compiled if k == hidden_layers and n <= w and self._length + w <= self.capacity]
        width = min(fits) if fits else n
        if self._length + width > self.capacity:
            raise StaticCacheOverflow(
                f"static KV cache overflow ({self.owner}): {self._length} columns in use and {width} more were fed, "
                f"but it was preallocated for {self.capacity}; nothing was written (call reserve first)"
            )
        if width > n:
            pad = width - n
            ids, positions = torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(positions, (0, pad))
            attend = torch.nn.functional.pad(attend, (0, pad, 0, pad))
            attend[:, n:, n:] |= torch.eye(pad, dtype=torch.bool, device=attend.device)
        if fits:
            logits, hidden = self._compiled[(hidden_layers, width)](*self._inputs(ids, positions, attend))
            if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
                logits, hidden = logits.clone(), tuple(h.clone() for h in hidden)
            logits = logits[:, n - 1 : n] if logits_to_keep == 1 else logits[:, :n]
        else:
            logits, hidden = self._step((hidden_layers, logits_to_keep == 1))(*self._inputs(ids, positions, attend))
        hidden = {i: h[:, :n] for i, h in zip(hidden_layers, hidden)}
        if self._rows is not None:  # back to the rows in use
            logits = logits.index_select(0, self._rows)
            hidden = {i: h.index_select(0, self._rows) for i, h in hidden.items()}
        return ForwardResult(logits=logits, hidden_states=hidden)


#: Per model, role ("target", "draft"), compile mode and batch size, its static cache: the next
#: request of that batch size reuses it (its compiled steps are the expensive part) when it holds
#: enough columns, and replaces it with a larger one when not. A model used as its own draft
#: keeps the two roles apart. So a model decodes one static-path request at a time.
_STATIC_CACHES: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()


def model_cache(model: PreTrainedModel, role: str, batch: int, capacity: int | None, compile=False) -> RaggedCache:
    """The KV cache of `model` for a request of `batch` rows: growing when `capacity` is None,
    else the static store of at least `capacity` columns (made once per model, role, mode and
    batch size; grown when too small), reset."""
    if capacity is None:
        return RaggedCache.for_model(model, batch, f"the {role}")
    slots = _STATIC_CACHES.setdefault(model, {})
    key = (role, compile_mode(compile), batch)
    kv = slots.get(key)
    if kv is None or kv.capacity < capacity:
        kv = slots[key] = StaticRaggedCache(model, batch, capacity, compile=compile, owner=f"the {role}")
    kv.reset()
    return kv
