"""The one KV cache of the decoding runtime: B ragged rows over one batch-shared cache per model.

Column s of row b holds a real token of that row or a hole; `valid[b, s]` says which. Every
forward feeds W new columns per row with explicit positions (= the number of the row's real
tokens before it, plus the depth inside a tree) and `attend [B, W, L]` (bool: which fed columns
each fed column sees, in its last W columns; a chain is causal over the row's real span, a tree
sees its ancestors; L > W: its first L - W columns are the cache's last ones, seen where both
`attend` and `valid` say so: a draft head's tree sees its ancestors among earlier depths).
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
- `RaggedCache` (growing): a `transformers.DynamicCache`; finished rows leave it (`select`).
- `StaticRaggedCache` (preallocated, compile-friendly): one HF `StaticCache`
  [B, kv_heads, capacity, head_dim] per layer, written at a pointer; a tail cut moves the
  pointer back, compaction is an in-place gather, nothing grows. The mask is built INSIDE the
  one step function from tensors (valid, pointer, attend), so every call of a width has the
  same shapes and `warm_up` can `torch.compile` it per width (a narrower call is padded up).
  The B physical rows stay: a finished row becomes a padding row (token 0, no real column).
Sliding-window layers (Mistral, Qwen2's `use_sliding_window`, Gemma-2/3, gpt-oss) keep every
column too: HF's own sliding layers drop states by column, which would count a row's holes as
tokens. The cache keeps each column's position instead, and a sliding layer's mask also blocks
the keys `window` or more positions behind the query (HF takes {"full_attention": mask,
"sliding_attention": mask} for a model with both kinds); attention takes a 4-D float mask.
A store serves any model with a HF cache: a HF causal LM (`forward`), or a draft head through a
cache call `call(ids, positions, mask, cache, *inputs) -> outputs` (`run`; EAGLE, DFlash, P-EAGLE).
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from draftsmith.decoding.compiler import (
    CAPACITY_STEP,
    Compiler,
    StaticCacheOverflow,
    compile_mode,
    make_chain,
    make_step,
    widen,
    widen_attend,
)
from draftsmith.decoding.masks import attention_of, chain_attend, layer_masks, spans, static_mask
from draftsmith.decoding.target import ForwardResult, forward_result, hf_call, layers_config

#: Compact when holes (columns past the longest row's real count) make up at least this share:
#: attention then never reads more than 4/3 of the live cache, and a compaction (one gather of
#: K and V per layer, about one attention pass of memory traffic) happens once every few calls.
COMPACT_WHEN = 0.25


def capacity_for(columns: int) -> int:
    """A static cache's capacity for `columns`: rounded up so similar requests share one cache
    (and one set of compiled graphs)."""
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


# ----------------------------------------------------------------------- the growing store


class RaggedCache:
    """Which columns of a batch-shared KV cache are real, per row; and the moves on it.

    `cache` is a `transformers.DynamicCache` of full-attention layers (a HF model's or a draft
    head's): keys/values [B, heads, S, head_dim] that the model appends to. The owner runs a
    forward through `forward` (a HF model) or `run` (a cache call), then `commit`s what each row
    keeps.
    """

    def __init__(
        self,
        cache,
        batch: int,
        device: torch.device,
        window: int | None = None,
        mixed: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        self.cache = cache
        self.device, self.dtype = device, dtype  # the model's: masks are built in its dtype
        # `valid` is `_head`, then `_tail` columns that every row holds (made a tensor when read).
        self._head, self._tail = torch.zeros(batch, 0, dtype=torch.bool, device=device), 0
        self.counts = [0] * batch  # real columns per row
        self.window, self.mixed = window, mixed
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)  # per column (sliding windows)
        self._fed = None  # positions of the last forward's columns, until `commit`

    @classmethod
    def for_model(cls, model: PreTrainedModel, batch: int, owner: str) -> RaggedCache:
        config = layers_config(model)
        window, mixed = attention_of(config, owner)
        cache = DynamicCache(config=config)
        cache.layers = [DynamicLayer() for _ in cache.layers]  # sliding ones too: the mask applies the window
        return cls(cache, batch, model.device, window, mixed, model.dtype)

    @property
    def length(self) -> int:
        return self._head.shape[1] + self._tail

    @property
    def valid(self) -> torch.Tensor:
        """[B, length] bool: which columns of each row are real."""
        if self._tail:
            ones = torch.ones(len(self.counts), self._tail, dtype=torch.bool, device=self.device)
            self._head, self._tail = torch.cat([self._head, ones], dim=1), 0
        return self._head

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:
        self._head, self._tail = value, 0

    @property
    def dense(self) -> bool:
        """No holes: every row's columns are all real (then a causal forward needs no mask)."""
        return all(c == self.length for c in self.counts)

    def _holders(self) -> list:
        """The cache's layers that hold something: `.keys` / `.values` [B, ..., S, D]."""
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]

    def mask(self, attend: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None):
        """Float additive mask [B, 1, W, S + W]: a fed column sees its row's real cache columns
        and the fed columns `attend [B, W, L]` marks (L > W: the cache's last L - W columns only
        where `attend` marks them too); with a sliding window, those within it of the fed
        `positions [B, W]` (`layer_masks`)."""
        batch, width, span = attend.shape
        look, attend = span - width, attend.to(self.device)
        past = self.valid[:, None, :].expand(batch, width, self.length)
        allowed = torch.cat([past, attend[..., look:]], dim=-1)[:, None]
        if look:
            allowed[..., self.length - look : self.length] &= attend[:, None, :, :look]
        keys = None if self.window is None else torch.cat([self.positions, positions], dim=1)
        return layer_masks(allowed, dtype, self.window, self.mixed, positions, keys)

    def forward(self, model, ids, positions, attend=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """`model` (a HF causal LM over `self.cache`) on ids [B, W] at positions [B, W] (`run`);
        `logits_to_keep`: 0 every column's logits, 1 the last column's."""
        hidden_layers, last = tuple(hidden_layers), logits_to_keep == 1
        out = self.run(hf_call(model, hidden_layers, last), ids, positions, attend)
        return forward_result(out, hidden_layers, last)

    @torch.inference_mode()
    def run(self, call, ids, positions, attend=None, *inputs, key=None) -> tuple[torch.Tensor, ...]:
        """The outputs of `call(ids, positions, mask, cache, *inputs)` for ids [B, W] at positions
        [B, W] and `inputs` [B, W, ...]; `attend=None`: every fed column is real and causal (no
        mask at all while the cache is dense). `key` names the call's compiled steps (the static
        store's). The bookkeeping is the caller's: `commit` afterwards."""
        mask = None
        if self.window is not None:
            self._fed = positions.to(self.device)
        if attend is not None or not self.dense or self.window is not None:
            if attend is None:
                attend = chain_attend(ids.shape[1], None, None, ids.shape[0], self.device)
            mask = self.mask(attend, self.dtype, self._fed)
        return call(ids, positions, mask, self.cache, *inputs)

    def reserve(self, fed: int) -> None:
        """Room for `fed` more columns (the growing store always has it)."""

    def compiled_widths(self, key) -> list[int]:
        """The widths `run(..., key=key)` has compiled steps for (the growing store compiles none)."""
        return []

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
        """Add `keep`'s columns to the per-row counts (on the host: no device wait); the columns up to the last kept."""
        host = keep.cpu()
        self.counts = [c + k for c, k in zip(self.counts, host.sum(1).tolist())]
        kept = host.any(0).nonzero() if not host.all() else None  # None: every row keeps every column
        return keep.shape[1] if kept is None else int(kept[-1]) + 1 if kept.numel() else 0

    def commit_spans(self, width: int, lo: list[int] | None = None, hi: list[int] | None = None) -> None:
        """`commit` of the fed columns [lo_b, hi_b) (None: 0 / all); no tensor is built when
        every row keeps the same first columns (batch-1 chains)."""
        kept = width if hi is None else hi[0]
        uniform = not any(lo or ()) and all(h == kept for h in hi or ())
        if not (uniform and self._commit_prefix(width, kept)):
            self.commit(spans(width, lo, hi, len(self.counts), "cpu"))

    def _commit_prefix(self, width: int, kept: int) -> bool:
        """Every row keeps the first `kept` of the `width` fed columns: True once done."""
        self._check_length(self.length + width)
        self.counts = [c + kept for c in self.counts]
        if self.window is not None:
            self.positions = torch.cat([self.positions, self._fed[:, :kept]], dim=1)
        self._tail += kept
        if kept < width:
            self._cut(self.length)
        return True

    def retain(self, start: int, keep: list[int]) -> None:
        """Of the columns from `start` on (all committed whole), row b keeps the first keep_b;
        the rest become holes, and the common tail is cut."""
        width = self.length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        cut = start + max(keep, default=0)
        if any(k != keep[0] for k in keep):  # else every row keeps [start, cut): cutting the tail is all
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
        if self._head.shape[1] > length:
            self.valid = self._head[:, :length]
        self._tail = length - self._head.shape[1]
        if self.window is not None:
            self.positions = self.positions[:, :length]

    def _check_length(self, expected: int) -> None:
        for holder in self._holders():
            if holder.keys.shape[-2] != expected:
                raise RuntimeError(
                    f"ragged cache out of step: the model cache holds {holder.keys.shape[-2]} columns, "
                    f"the bookkeeping expects {expected} (was the cache fed outside the decoder?)"
                )


# ------------------------------------------------------------------- the preallocated store


class StaticRaggedCache(RaggedCache):
    """A `RaggedCache` over a preallocated HF `StaticCache` (module docstring), with its forward.

    Callers pass and get tensors of the rows in use; `rows[i]` is the physical row of row i.
    """

    def __init__(self, model: PreTrainedModel, batch: int, capacity: int, *, compile=False, owner: str = "the target"):
        config = layers_config(model)
        self.window, self.mixed = attention_of(config, owner)
        cache = StaticCache(config=config, max_cache_len=capacity)
        cache.layers = [StaticLayer(max_cache_len=capacity) for _ in cache.layers]  # sliding ones: by the mask
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.device, self.dtype = model.device, model.dtype
        cache.early_initialization(batch, kv_heads, head_dim, model.dtype, self.device)
        self.cache, self.model, self.owner = cache, model, owner
        self.batch, self.capacity = batch, capacity
        self.compiler = Compiler(compile, self.device, owner)
        self._compiled: dict[tuple, tuple] = {}  # (key, width) -> (lookback, compiled step)
        self._chains: dict[tuple, object] = {}  # (width, tokens, logits) -> compiled greedy draft chain
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self._slots = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)  # each column's position
        self._made: dict[tuple, torch.Tensor] = {}  # what `_chain_inputs` made, per (rows, width)
        self._starts: dict[int, torch.Tensor] = {}  # the pointer as a step input (0-d long), made once per value
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
        return self._in_use(self._valid[:, : self._length])

    def _in_use(self, x: torch.Tensor) -> torch.Tensor:
        """x [B physical rows, ...] cut to the rows in use."""
        return x if self._rows is None else x.index_select(0, self._rows.to(x.device))

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
        start, attend = self._start(), self._attend(attend)
        positions = self._physical(positions.to(self.device), torch.zeros)
        mask = static_mask(self._valid, self._slots, start, attend, positions, dtype, self.window, self.mixed)
        return {k: self._in_use(m) for k, m in mask.items()} if isinstance(mask, dict) else self._in_use(mask)

    def _attend(self, attend: torch.Tensor) -> torch.Tensor:
        """attend of the rows in use on the physical rows: a padding row's columns see themselves."""
        return self._physical(
            attend.to(self.device),
            lambda b, w, span: widen_attend(torch.zeros(b, 0, span - w, dtype=torch.bool), w, span - w),
        )

    def _check_length(self, expected: int) -> None:
        if expected > self.capacity:
            raise RuntimeError(f"static ragged cache out of step: {expected} columns committed, of {self.capacity}")

    def commit(self, keep: torch.Tensor) -> None:
        width, start = keep.shape[1], self._length
        self._check_length(start + width)
        used = self._count(keep)
        self._valid[:, start : start + width] = self._physical(keep.to(self.device), torch.zeros)
        self._length = start + used  # the common tail: the pointer moves back

    def _commit_prefix(self, width: int, kept: int) -> bool:
        if self._rows is not None:  # padding rows must stay holes: `commit` writes row by row
            return False
        self._check_length(self._length + width)
        self.counts = [c + kept for c in self.counts]
        self._valid[:, self._length : self._length + kept] = True  # the columns past the pointer are holes
        self._length += kept
        return True

    def retain(self, start: int, keep: list[int]) -> None:
        width = self._length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged cache")
        cut = start + max(keep, default=0)
        if any(k != keep[0] for k in keep):
            kept = spans(width, None, keep, len(keep), self.device)
            self._valid[:, start : self._length] = self._physical(kept, torch.zeros)
        else:  # every row keeps [start, cut): the rest become holes past the pointer
            self._valid[:, cut : self._length] = False
        self.counts = [c - width + k for c, k in zip(self.counts, keep)]
        self._length = cut

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

    def _inputs(self, ids, positions, attend, *inputs):
        """The step's inputs on the physical rows; the fed columns' positions go into `slots`
        (read by later calls)."""
        ids, positions, *inputs = (self._physical(x.to(self.device), torch.zeros) for x in (ids, positions, *inputs))
        if self.window is not None:
            self._slots[:, self._length : self._length + positions.shape[1]] = positions
        return ids, positions, self._valid, self._slots, self._start(), self._attend(attend), *inputs

    def _start(self) -> torch.Tensor:
        start = self._starts.get(self._length)
        if start is None:
            start = self._starts[self._length] = torch.tensor(self._length, device=self.device)
        return start

    def _compile(self, fn, width: int, look: int, extra: tuple, room: int, what: str):
        """`fn` (a step or a chain of this cache, fed `width` columns after a lookback of `look`
        and `extra` inputs) compiled, and run once on holes written past the pointer (the content
        is unchanged); None when compilation is off or failed."""
        self.reserve(room)
        rows = len(self.rows)
        # Distinct tensors for every input: dynamo would compile two aliased arguments as one.
        ids, positions = (torch.zeros(rows, width, dtype=torch.long, device=self.device) for _ in range(2))
        attend = widen_attend(chain_attend(width, None, [0] * rows, rows, self.device), width, look)
        inputs = (*self._inputs(ids, positions, attend), *extra)
        # One eager call first: HF installs its hidden-state capturing hooks lazily, under a lock
        # dynamo cannot trace.
        fn(*inputs)
        wrapped = self.compiler.wrap(fn)
        return wrapped if self.compiler.first_calls(what, wrapped, *inputs) else None

    @torch.inference_mode()
    def warm_up(
        self, widths, hidden_layers: tuple[int, ...] = (), *, chain: int = 0, vocab: int = 0, logits: bool = False
    ) -> float:
        """Compile the all-logits step of `hidden_layers` for each width (with `chain` = k > 0:
        the greedy draft chain of k tokens after a catch-up of each width, `make_chain`, over a
        `vocab`-sized bias). Returns the seconds spent compiling; 0 without compilation."""
        hidden_layers = tuple(hidden_layers)
        if not chain:
            return self.warm_up_call(hf_call(self.model, hidden_layers, False), {w: 0 for w in widths}, hidden_layers)
        before, step = self.compiler.seconds, make_step(hf_call(self.model, (), True), self)
        for width in sorted(set(widths)):
            if self.compiler.enabled and (width, chain, logits) not in self._chains:
                extra = (
                    torch.ones(self.batch, width, dtype=torch.bool, device=self.device),
                    torch.zeros(vocab, device=self.device),
                )
                fn = self._compile(
                    make_chain(step, width, chain, logits),
                    width,
                    0,
                    extra,
                    width + chain - 1,
                    f"a {chain}-token chain after width {width}",
                )
                if fn is not None:
                    self._chains[(width, chain, logits)] = fn
        return self.compiler.seconds - before

    @torch.inference_mode()
    def warm_up_call(self, call, looks: dict[int, int], key, inputs=lambda width: ()) -> float:
        """Compile `call`'s step (what `run(call, ..., key=key)` runs) for each width of `looks`
        (width -> the widest lookback, L - W of `attend`, it serves), with `inputs(width)` as
        its physical extra inputs. Returns the seconds spent compiling; 0 without compilation."""
        before, step = self.compiler.seconds, make_step(call, self)
        for width, look in sorted(looks.items()):
            done = self._compiled.get((key, width))  # a deeper lookback serves a shallower one too
            if self.compiler.enabled and (done is None or done[0] < look):  # off (or a failed compile), or done
                fn = self._compile(step, width, look, inputs(width), width, f"width {width}")
                if fn is not None:
                    self._compiled[(key, width)] = (look, fn)
        return self.compiler.seconds - before

    def compiled_widths(self, key) -> list[int]:
        """The widths `run(..., key=key)` has compiled steps for, narrowest first."""
        return sorted(width for k, width in self._compiled if k == key)

    @torch.inference_mode()
    def chain(self, ids, positions, lo: list[int], num_tokens: int, bias: torch.Tensor, logits: bool = False):
        """A greedy draft chain (`make_chain`): feed the right-aligned catch-up ids [rows, p]
        (row b's real columns from lo_b) at `positions`, then draft `num_tokens` tokens, feeding
        each but the last. One compiled call when a chain of >= num_tokens was warmed for p (a
        longer one is cut: its extra drafts stay junk past the pointer), else the same function
        uncompiled. Returns tokens [rows, k] and, with `logits`, their logits [rows, k, V]; the
        cache then holds the catch-up and k - 1 drafts, as step-by-step forwards leave it."""
        width, rows = ids.shape[1], ids.shape[0]
        fits = [
            k
            for (w, k, l) in self._chains
            if (w, l) == (width, logits) and num_tokens <= k and self._length + width + k - 1 <= self.capacity
        ]
        k = min(fits, default=num_tokens)
        self.reserve(width + k - 1)  # nothing to do when the caller reserved the room (no compaction then)
        if fits:
            fn = self._chains[(width, k, logits)]
        else:
            fn = make_chain(make_step(hf_call(self.model, (), True), self), width, k, logits)
        if any(lo):
            attend, keep = chain_attend(width, lo, None, rows, self.device), spans(width, lo, None, rows, self.device)
        else:
            attend, keep = self._chain_inputs(rows, width)
        out = fn(*self._inputs(ids, positions, attend), self._physical(keep, torch.zeros), bias.to(self.device))
        out = [self._in_use(x if k == num_tokens else x[:, :num_tokens]) for x in out]
        if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
            out = [x.clone() for x in out]
        self.commit_spans(width, lo, None)
        if num_tokens > 1:
            if self.window is not None:
                drafts = positions[:, -1:].to(self.device) + torch.arange(1, num_tokens, device=self.device)
                self._slots[:, self._length : self._length + num_tokens - 1] = self._physical(drafts, torch.zeros)
            self.commit_spans(num_tokens - 1)
        return out[0], (out[1] if logits else None)

    def _chain_inputs(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's causal attend [rows, W, W] and all-real keep [rows, W], made once per shape."""
        made = self._made.get((rows, width))
        if made is None:
            keep = torch.ones(rows, width, dtype=torch.bool, device=self.device)
            made = self._made[(rows, width)] = (chain_attend(width, None, None, rows, self.device), keep)
        return made

    def forward(self, model, ids, positions, attend=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """Write ids [rows, n] at the pointer and return their logits (`logits_to_keep`: 0 all, 1
        the last column), through `run` (this cache's model; `model` is ignored)."""
        hidden_layers, last = tuple(hidden_layers), logits_to_keep == 1
        out = self.run(hf_call(self.model, hidden_layers, last), ids, positions, attend, key=hidden_layers)
        return forward_result(out, hidden_layers, last)

    @torch.inference_mode()
    def run(self, call, ids, positions, attend=None, *inputs, key=None) -> tuple[torch.Tensor, ...]:
        """Write ids [rows, n] (and `inputs` [rows, n, ...]) at the pointer; the outputs of `call`.
        Runs the smallest width >= n compiled for `key` that fits (padded: the padding columns are
        holes that see only themselves; a shorter lookback is padded too), else `call`'s step
        uncompiled at width n."""
        n = ids.shape[1]
        if attend is None:
            attend = self._chain_inputs(ids.shape[0], n)[0]
        look = attend.shape[-1] - n
        fits = [
            (w, l)
            for (k, w), (l, _) in self._compiled.items()
            if k == key and n <= w and look <= l and self._length + w <= self.capacity
        ]
        width, look = min(fits) if fits else (n, look)
        if self._length + width > self.capacity:
            raise StaticCacheOverflow(
                f"static KV cache overflow ({self.owner}): {self._length} columns in use and {width} more were fed, "
                f"but it was preallocated for {self.capacity}; nothing was written (call reserve first)"
            )
        if fits:  # padded to the compiled width, in the standard strides its guards expect
            ids, positions, *inputs = (widen(x, width) for x in (ids, positions, *inputs))
        fn = self._compiled[(key, width)][1] if fits else make_step(call, self)
        out = fn(*self._inputs(ids, positions, widen_attend(attend, width, look), *inputs))
        if fits and self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
            out = tuple(x.clone() for x in out)
        return tuple(self._in_use(x if width == n else x[:, :n]) for x in out)


#: Per model, role ("target", "draft", "eagle"), compile mode and batch size, its static cache:
#: the next request of that batch size reuses it (its compiled steps are the expensive part)
#: when it holds enough columns, and replaces it with a larger one when not. A model used as its
#: own draft keeps the two roles apart. So a model decodes one static-path request at a time.
_STATIC_CACHES: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()


def model_cache(model: PreTrainedModel, role: str, batch: int, capacity: int | None, compile=False) -> RaggedCache:
    """The KV cache of `model` (a HF model or a draft head) for a request of `batch` rows:
    growing when `capacity` is None, else the static store of at least `capacity` columns (made
    once per model, role, mode and batch size; grown when too small), reset."""
    if capacity is None:
        return RaggedCache.for_model(model, batch, f"the {role}")
    slots = _STATIC_CACHES.setdefault(model, {})
    key = (role, compile_mode(compile), batch)
    kv = slots.get(key)
    if kv is None or kv.capacity < capacity:
        kv = slots[key] = StaticRaggedCache(model, batch, capacity, compile=compile, owner=f"the {role}")
    kv.reset()
    return kv
