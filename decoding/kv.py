"""The one KV store of the decoding runtime: B ragged rows over preallocated buffers per model.

Each layer's keys and values live in buffers [B, kv_heads, capacity, head_dim], written at a
pointer (`length`). Column s of row b holds a real token of that row or a hole; `valid[b, s]`
says which. Every forward feeds W new columns per row with explicit positions (= the number of
the row's real tokens before it, plus the depth inside a tree) and `attend [B, W, L]` (bool:
which fed columns each fed column sees, in its last W columns; a chain is causal over the row's
real span, a tree sees its ancestors; L > W: its first L - W columns are the store's last ones,
seen where both `attend` and `valid` say so: a draft head's tree sees its ancestors among
earlier depths). The model gets a float additive 4-D mask built from `valid` and `attend`;
afterwards `commit` says which fed columns each row keeps (a chain: the last token and its
accepted drafts; a tree: the root and the accepted path, wherever its nodes sit). Keys are
stored after RoPE, so a kept column keeps its position, and a tree node's keys, computed seeing
only its ancestors, are exactly what sequential decoding of the path computes. No row is cut to
another's length:
- prompts are right-aligned: a shorter prompt's left padding is holes;
- columns that no row keeps (the common tail) are cut at once: the pointer moves back;
- when holes fill a quarter of the columns (`COMPACT_WHEN`), every row's real columns are
  gathered to the right end of [0, live) (one in-place gather per layer).
Per-row counts live on the host, so no bookkeeping waits on the device.

Capacity: preallocated (the loop sizes it for the longest prompt + max_new_tokens + the widest
call), and grown by reallocation (doubling, one copy of the live columns) only when a call would
pass it even after compaction; a store made without a known size starts at `CAPACITY_STEP`.

Two ways to run a forward over the same buffers:
- live (every call no compiled step serves): the model sees a `LiveLayer` per layer, the first
  `length` columns plus the fed ones, so attention reads only the live columns, and a store
  without holes passes no mask at all (HF's causal path);
- compiled (`warm_up` compiled a step of that width): the step sees the whole buffers (HF
  `StaticLayer`s) and builds its mask inside from tensors (valid, slots, pointer, attend), so every
  call of a width has the same shapes; a narrower call is padded up. Growth drops the compiled
  steps (their shapes hold the capacity), so the loop allocates the decode's maximum up front.
A finished row leaves the buffers (`select`), except while compiled steps exist: it then stays
as a padding row (token 0, no real column), so the batch shape stays fixed.
Sliding-window layers (Mistral, Qwen2's `use_sliding_window`, Gemma-2/3, gpt-oss) keep every
column too: HF's own sliding layers drop states by column, which would count a row's holes as
tokens. The store keeps each column's position (`slots`) instead, and a sliding layer's mask also
blocks the keys `window` or more positions behind the query (HF takes {"full_attention": mask,
"sliding_attention": mask} for a model with both kinds); attention takes a 4-D float mask.
A store serves any model with a HF cache: a HF causal LM (`forward`), or a draft head through a
cache call `call(ids, positions, mask, cache, *inputs) -> outputs` (`run`; a drafter's head).
Recurrent layers (linear attention, convolutions, SSMs: hybrid models) keep no columns: their
per-row states (`decoding/recurrent.py`) follow every commit, retain and select of the store; such a
store runs live (no compiled steps) and takes chains, not trees.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, StaticLayer

from draftsmith.decoding.compiler import CAPACITY_STEP, CompiledSteps, Compiler, compile_mode, widen, widen_attend
from draftsmith.decoding.masks import attention_of, chain_attend, layer_masks, spans
from draftsmith.decoding.recurrent import NO_CACHE_TYPES, RowStates, StateLayer, check_cache_protocol, state_layers
from draftsmith.decoding.target import ForwardResult, forward_result, hf_call, layers_config
from draftsmith.heads.layers import layer_value

#: Compact when holes (columns past the longest row's real count) make up at least this share:
#: attention then never reads more than 4/3 of the live columns, and a compaction (one gather of
#: K and V per layer, about one attention pass of memory traffic) happens once every few calls.
COMPACT_WHEN = 0.25


def capacity_for(columns: int) -> int:
    """A store's capacity for `columns`: rounded up so similar requests share one store (and one
    set of compiled graphs)."""
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


class StoreLayer(StaticLayer):
    """One layer's buffers [B, heads, capacity, dim], allocated from the config's attention shape;
    a layer that caches other shapes (DeepSeek's MLA: its compressed latent as keys [B, 1, T, kv_lora_rank],
    the rotary part as values [B, 1, T, rope dim]) gets buffers of those at its first write."""

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys.shape[1::2] == keys.shape[1::2] and self.values.shape[1::2] == values.shape[1::2]:
            return
        batch, capacity = self.keys.shape[0], self.keys.shape[2]
        with torch.inference_mode(False):  # plain tensors, written in place in and out of inference mode
            self.keys = keys.new_zeros(batch, keys.shape[1], capacity, keys.shape[-1])
            self.values = values.new_zeros(batch, values.shape[1], capacity, values.shape[-1])

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.fit(keys, values)
        return super().update(keys, values, *args, **kwargs)


class LiveLayer(DynamicLayer):
    """One layer of a store's buffers as a live forward sees it: its first `live` columns (the
    store's pointer) and the fed ones, written in place after them. To HF it is a growing layer
    of `live` columns: its masks and its causal shortcut read `get_seq_length`."""

    def __init__(self, buffers: StaticLayer):
        super().__init__()
        self.buffers, self.live, self.is_initialized = buffers, 0, True

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.buffers.fit(keys, values)
        end = self.live + keys.shape[-2]
        self.buffers.keys[..., self.live : end, :] = keys
        self.buffers.values[..., self.live : end, :] = values
        return self.buffers.keys[..., :end, :], self.buffers.values[..., :end, :]

    def get_seq_length(self) -> int:
        return self.live


class LiveHybridLayer(StateLayer, LiveLayer):
    """A layer with both a recurrent state and attention columns (Falcon-H1's "hybrid" layers): the
    state as `StateLayer`, the columns as `LiveLayer`."""

    def __init__(self, buffers: StaticLayer, number_of_states: int):
        StateLayer.__init__(self, number_of_states=number_of_states)
        LiveLayer.__init__(self, buffers)

    update, get_seq_length, get_mask_sizes = LiveLayer.update, LiveLayer.get_seq_length, LiveLayer.get_mask_sizes


def check_decodable(model, owner: str = "the target"):
    """(window, mixed, layer types, recurrent layers) of what a store of `model` runs; ValueError in
    one line when its layers are of a kind the decoder does not run (`masks.attention_of`,
    `recurrent.check_cache_protocol`)."""
    config = layers_config(model)
    window, mixed, layer_types = attention_of(config, owner)
    states = state_layers(config, owner)
    if states and isinstance(model, PreTrainedModel):
        check_cache_protocol(model, owner)
    return window, mixed, layer_types, states


class KVStore(CompiledSteps):
    """Which columns of a model's preallocated KV buffers are real, per row; and the moves on them
    (module docstring). The owner runs a forward through `forward` (a HF model) or `run` (a
    cache call), then `commit`s what each row keeps. Callers pass and get tensors of the rows in
    use; `rows[i]` is the physical row of row i.

    `shape` = (layers, kv_heads, head_dim) of the buffers; `model` (the one `warm_up` compiles
    and `chain` drafts with) is None for a store fed only through `run`.
    """

    def __init__(
        self,
        shape: tuple[int, int, int],
        batch: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        window: int | None = None,
        mixed: bool = False,
        model: PreTrainedModel | None = None,
        compile=False,
        owner: str = "the target",
        layer_types: tuple[str, ...] | None = None,
        states: dict[int, int] | None = None,
    ):
        self.shape, self.batch, self.model, self.owner = shape, batch, model, owner
        self.layer_types = layer_types or ("full_attention",) * shape[0]  # HF's names, one per layer
        self.states = RowStates(states, owner) if states else None  # recurrent layers: {index: states}
        if self.states is not None and compile_mode(compile) is not None:
            raise ValueError(
                f"{owner} has recurrent layers (linear attention, convolutions or SSMs): its decoding runs uncompiled "
                "(drop --compile; --static-cache works)"
            )
        self.dtype, self.device = dtype, torch.device(device)  # the model's: masks are built in its dtype
        self.window, self.mixed = window, mixed
        self.compiler = Compiler(compile, self.device, owner)
        self._compiled: dict[tuple, tuple] = {}  # (key, width) -> (lookback, compiled step)
        self._chains: dict[tuple, object] = {}  # (width, tokens, logits) -> compiled greedy draft chain
        self._made: dict[tuple, tuple] = {}  # what `_chain_inputs` made, per (rows, width)
        self._starts: dict[int, torch.Tensor] = {}  # the pointer as a step input (0-d long), made once per value
        self._allocate(batch, capacity)
        self.reset()

    @classmethod
    def for_model(cls, model: PreTrainedModel, batch: int, capacity: int, *, compile=False, owner: str = "the target"):
        """The store of `model` (a HF model, or a draft head with `config.layer_config()`)."""
        config = layers_config(model)
        window, mixed, layer_types, states = check_decodable(model, owner)
        text = config.get_text_config()
        layers = range(text.num_hidden_layers)  # Gemma 4: head_dim differs between sliding and full layers
        head_dim = tuple(
            layer_value(text, "head_dim", i) or text.hidden_size // text.num_attention_heads for i in layers
        )
        kv_heads = tuple(layer_value(text, "num_key_value_heads", i) or text.num_attention_heads for i in layers)
        shape, param = (text.num_hidden_layers, kv_heads, head_dim), next(model.parameters())
        where = {"dtype": getattr(model, "dtype", param.dtype), "device": getattr(model, "device", param.device)}
        facts = {"window": window, "mixed": mixed, "layer_types": layer_types, "states": states}
        return cls(shape, batch, capacity, **where, **facts, model=model, compile=compile, owner=owner)

    @torch.inference_mode(False)  # plain tensors, written in place in and out of inference mode
    def _allocate(self, batch: int, capacity: int) -> None:
        """Zeroed buffers of `batch` physical rows and `capacity` columns: HF `StaticLayer`s (what
        compiled steps write) and their live views (what live forwards write)."""
        layers, kv_heads, head_dim = self.shape
        numbers = self.states.numbers if self.states is not None else {}

        def layer(i: int, kind: str):  # what compiled steps see: columns, a recurrent state, or nothing
            if kind in NO_CACHE_TYPES:
                return DummyLayer()
            if i in numbers and kind != "hybrid":
                return StateLayer(number_of_states=numbers[i])
            return StoreLayer(max_cache_len=capacity)

        def live(i: int, layer):  # what a live forward sees
            if not isinstance(layer, StaticLayer):
                return layer
            return LiveHybridLayer(layer, numbers[i]) if i in numbers else LiveLayer(layer)

        self.cache = Cache(layers=[layer(i, kind) for i, kind in enumerate(self.layer_types)])
        self.cache.early_initialization(batch, kv_heads, head_dim, self.dtype, self.device)
        self._kv = [layer for layer in self.cache.layers if isinstance(layer, StaticLayer)]  # the layers with columns
        self.live_cache = Cache(layers=[live(i, layer) for i, layer in enumerate(self.cache.layers)])
        if self.states is not None:
            self.states.attach({i: self.live_cache.layers[i] for i in numbers})
        self.capacity = capacity
        self._valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self._slots = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)  # each column's position

    def reset(self) -> None:
        """Empty, every row in use (the buffers and the compiled steps stay: a new request)."""
        if self._valid.shape[0] != self.batch:  # finished rows left the buffers
            self._allocate(self.batch, self.capacity)
        self._length = 0
        self._written = 0  # columns [_written, _length) are real in every row; `_valid` says so once read
        self._unsettled = 0  # columns fed and not committed yet
        self._valid.zero_()
        self.rows = list(range(self.batch))
        self._rows = None  # the same as a device tensor; None while it is the identity
        self.counts = [0] * self.batch  # real columns per row in use
        if self.states is not None:
            self.states.reset()

    # ------------------------------------------------------------------- bookkeeping

    @property
    def length(self) -> int:
        return self._length

    @property
    def valid(self) -> torch.Tensor:
        """[rows in use, length] bool: which columns of each row are real."""
        self._write_valid()
        return self._in_use(self._valid[:, : self._length])

    @property
    def dense(self) -> bool:
        """No holes and no padding rows (then a causal forward needs no mask)."""
        return self._rows is None and all(c == self._length for c in self.counts)

    def _write_valid(self) -> None:
        """Write the columns every row holds (committed on the host only) into `_valid`."""
        if self._written < self._length:
            self._valid[:, self._written : self._length] = True
            self._written = self._length

    def _in_use(self, x: torch.Tensor) -> torch.Tensor:
        """x [B physical rows, ...] cut to the rows in use."""
        return x if self._rows is None else x.index_select(0, self._rows.to(x.device))

    def _physical(self, x: torch.Tensor, fill) -> torch.Tensor:
        """x [rows in use, ...] scattered into the physical rows (`fill` on padding rows)."""
        if self._rows is None:
            return x
        out = fill(self._valid.shape[0], *x.shape[1:]).to(device=x.device, dtype=x.dtype)
        return out.index_copy_(0, self._rows.to(x.device), x)

    def _attend(self, attend: torch.Tensor) -> torch.Tensor:
        """attend of the rows in use on the physical rows: a padding row's columns see themselves."""
        return self._physical(
            attend.to(self.device),
            lambda b, w, span: widen_attend(torch.zeros(b, 0, span - w, dtype=torch.bool), w, span - w),
        )

    def _settle(self, width: int) -> int:
        """The pointer before the `width` fed columns a commit settles; RuntimeError when they
        are not what the last forward fed."""
        if width != self._unsettled:
            raise RuntimeError(
                f"KV store of {self.owner} out of step: {width} columns committed, the last forward fed "
                f"{self._unsettled} (was the cache fed outside the decoder?)"
            )
        self._unsettled = 0
        return self._length

    def commit(self, keep: torch.Tensor) -> None:
        """The last forward fed W columns; row b keeps those `keep [B, W]` marks. Columns kept by
        no row (past the last kept one) are cut at once: the pointer moves back."""
        width = keep.shape[1]
        start = self._settle(width)
        if self.states is not None:
            self._commit_states(keep.cpu())
        used = self._count(keep)
        self._write_valid()
        self._valid[:, start : start + width] = self._physical(keep.to(self.device), torch.zeros)
        self._length = self._written = start + used  # the columns past it were written False

    def _commit_states(self, keep: torch.Tensor) -> None:
        """Each row's recurrent state after its last kept column; its kept columns must be one run."""
        cols = torch.arange(keep.shape[1])
        end = torch.where(keep, cols + 1, 0).amax(1)  # [B]: one past the last kept column, 0 for none
        first = torch.where(keep, cols, keep.shape[1]).amin(1).clamp(max=end)
        if (keep.sum(1) != end - first).any():
            raise ValueError(
                f"{self.owner} has recurrent layers: a row can keep one run of the fed columns (a chain), not a "
                "tree's path (each branch would need its own state)"
            )
        self.states.commit(first.tolist(), end.tolist())

    def _count(self, keep: torch.Tensor) -> int:
        """Add `keep`'s columns to the per-row counts (on the host: no device wait); the columns
        up to the last kept."""
        host = keep.cpu()
        self.counts = [c + k for c, k in zip(self.counts, host.sum(1).tolist())]
        kept = host.any(0).nonzero() if not host.all() else None  # None: every row keeps every column
        return keep.shape[1] if kept is None else int(kept[-1]) + 1 if kept.numel() else 0

    def commit_spans(self, width: int, lo: list[int] | None = None, hi: list[int] | None = None) -> None:
        """`commit` of the fed columns [lo_b, hi_b) (None: 0 / all); no tensor is built when
        every row in use keeps the same first columns (batch-1 chains)."""
        kept = width if hi is None else hi[0]
        if any(lo or ()) or any(h != kept for h in hi or ()) or self._rows is not None:
            return self.commit(spans(width, lo, hi, len(self.counts), "cpu"))
        self._settle(width)
        if self.states is not None:
            self.states.commit([0] * len(self.counts), [kept] * len(self.counts))
        self.counts = [c + kept for c in self.counts]
        self._length += kept  # real in every row: written into `_valid` when it is read

    def retain(self, start: int, keep: list[int]) -> None:
        """Of the columns from `start` on (all committed whole), row b keeps the first keep_b;
        the rest become holes, and the common tail is cut."""
        width = self._length - start
        if width < 0 or any(not 0 <= k <= width for k in keep):
            raise ValueError(f"cannot retain {keep} of the {width} columns from {start} of a ragged KV store")
        if self.states is not None:
            self.states.retain(width, keep)
        cut = start + max(keep, default=0)
        if any(k != keep[0] for k in keep):
            self._write_valid()
            kept = spans(width, None, keep, len(keep), self.device)
            self._valid[:, start : self._length] = self._physical(kept, torch.zeros)
            self._written = cut
        elif cut < self._written:  # every row keeps [start, cut): the rest become holes past the pointer
            self._valid[:, cut : self._written] = False
            self._written = cut
        self.counts = [c - width + k for c, k in zip(self.counts, keep)]
        self._length = cut

    def checkpoint(self) -> None:
        """`retain` will cut back to here (or later): recurrent layers keep their state per column
        until rows part (a no-op for a store of attention layers only)."""
        if self.states is not None:
            self.states.checkpoint()

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        """Keep rows `kept` (indices into the rows in use; `rows` the same on the device). They
        leave the buffers (one copy), unless compiled steps hold the batch shape: then the
        others turn into padding rows."""
        physical = [self.rows[i] for i in kept]
        self._write_valid()  # before a row turns into padding: its columns must not turn real later
        if self.states is not None:  # never with compiled steps: physical rows are the rows in use
            self.states.select(rows)
        if self._compiled or self._chains:
            dropped = sorted(set(self.rows) - set(physical))
            if dropped:
                self._valid[torch.tensor(dropped, device=self.device)] = False
            self.rows = physical
            self._rows = torch.tensor(physical, dtype=torch.long, device=self.device)
        else:
            self._keep_rows(torch.tensor(physical, dtype=torch.long, device=self.device))
            self.rows, self._rows = list(range(len(kept))), None
        self.counts = [self.counts[i] for i in kept]

    @torch.inference_mode(False)  # plain tensors, as `_allocate` makes them
    def _keep_rows(self, index: torch.Tensor) -> None:
        """Only the physical rows `index` stay in the buffers."""
        for layer in self._kv:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self._valid, self._slots = self._valid.index_select(0, index), self._slots.index_select(0, index)

    def reserve(self, fed: int) -> None:
        """Room for `fed` more columns: compacting when they would not fit, growing when even the
        compacted store cannot hold them. Call it where columns may move (between proposals)."""
        if self._length + fed <= self.capacity:
            return
        self._compact()
        if self._length + fed > self.capacity:
            self._grow(self._length + fed)

    def _grow(self, columns: int) -> None:
        """Reallocate for at least `columns` (doubling: a store that keeps growing copies its
        columns O(log n) times), copying the live columns; compiled steps go (their shapes hold
        the old capacity)."""
        old, valid, slots, length = self._kv, self._valid, self._slots, self._length
        self._allocate(valid.shape[0], capacity_for(max(columns, 2 * self.capacity)))
        for new, was in zip(self._kv, old):
            new.fit(was.keys, was.values)
            new.keys[..., :length, :] = was.keys[..., :length, :]
            new.values[..., :length, :] = was.values[..., :length, :]
        self._valid[:, :length], self._slots[:, :length] = valid[:, :length], slots[:, :length]
        if self._compiled or self._chains:
            warnings.warn(
                f"the KV store of {self.owner} grew to {self.capacity} columns: its compiled steps are dropped and "
                "the rest of the decode runs uncompiled (size the store for the longest prompt + max_new_tokens + "
                "K + 1)",
                stacklevel=3,
            )
            self._compiled.clear()
            self._chains.clear()

    @staticmethod
    def _order(valid: torch.Tensor, length: int, live: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of `valid`, the columns of its compacted (right-aligned) form and their
        validity: a stable sort of 0/1 puts each row's holes first and its real columns after
        them, in order, so the last `live` sorted columns are the row compacted."""
        order = torch.sort(valid[:, :length].to(torch.int32), dim=1, stable=True)
        return order.indices[:, length - live :], order.values[:, length - live :].bool()

    def compact_if_wasteful(self) -> bool:
        """Gather every row's real columns to the right end when the holes are worth it."""
        waste = self._length - max(self.counts, default=0)
        if waste <= 0 or waste < COMPACT_WHEN * self._length:
            return False
        self._compact()
        return True

    def _compact(self) -> None:
        """Every row's real columns, in order, to [0, live) (right-aligned in it): one gather per
        layer over the same buffers (gather first: source and destination overlap)."""
        length, live = self._length, max(self.counts, default=0)
        if live == length:
            return
        self._write_valid()
        index, valid = self._order(self._valid, length, live)  # every physical row
        for layer in self._kv:
            for x in (layer.keys, layer.values):
                gather = index.view(x.shape[0], 1, live, 1).expand(x.shape[0], x.shape[1], live, x.shape[-1])
                x[..., :live, :] = x.gather(-2, gather)
        self._slots[:, :live] = self._slots.gather(1, index)
        self._valid[:, :live] = valid
        self._valid[:, live:length] = False
        self._length = self._written = live

    # ------------------------------------------------------------------- the forward

    def mask(self, attend: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None):
        """A live forward's float additive mask [rows, 1, W, length + W] (`_live_mask`) for
        `attend [rows, W, L]` and the fed `positions [rows, W]` (read with a sliding window)."""
        if positions is None:  # only a sliding window reads them
            positions = torch.zeros(attend.shape[:2], dtype=torch.long)
        fed = self._physical(positions.to(self.device), torch.zeros)
        if self.window is not None:
            self._slots[:, self._length : self._length + fed.shape[1]] = fed
        out = self._live_mask(self._attend(attend), dtype)
        return {k: self._in_use(m) for k, m in out.items()} if isinstance(out, dict) else self._in_use(out)

    def _live_mask(self, attend: torch.Tensor, dtype: torch.dtype):
        """On the physical rows: a fed column sees its row's real columns and the fed columns
        `attend [B, W, L]` marks (L > W: the store's last L - W columns only where `attend` marks
        them too); with a sliding window, those within it of the fed positions (in `slots` from
        the pointer on; `layer_masks`)."""
        batch, width, span = attend.shape
        look, length = span - width, self._length
        self._write_valid()
        past = self._valid[:, None, :length].expand(batch, width, length)
        allowed = torch.cat([past, attend[..., look:]], dim=-1)[:, None]
        if look:
            allowed[..., length - look : length] &= attend[:, None, :, :look]
        keys = None if self.window is None else self._slots[:, : length + width]
        fed = None if keys is None else keys[:, length:]
        return layer_masks(allowed, dtype, self.window, self.mixed, fed, keys)

    def forward(self, model, ids, positions, attend=None, *, hidden_layers=(), logits_to_keep=0) -> ForwardResult:
        """`model` (a HF causal LM over this store) on ids [rows, W] at positions [rows, W] (`run`);
        `logits_to_keep`: 0 every column's logits, 1 the last column's."""
        hidden_layers, last = tuple(hidden_layers), logits_to_keep == 1
        out = self.run(hf_call(model, hidden_layers, last), ids, positions, attend, key=hidden_layers)
        return forward_result(out, hidden_layers, last)

    @torch.inference_mode()
    def run(self, call, ids, positions, attend=None, *inputs, key=None) -> tuple[torch.Tensor, ...]:
        """The outputs of `call(ids, positions, mask, cache, *inputs)` for ids [rows, n] at
        positions [rows, n] and `inputs` [rows, n, ...], written at the pointer; `attend=None`:
        every fed column is real and causal. Runs the smallest width >= n compiled for `key` that
        fits (padded: the padding columns are holes that see only themselves; a shorter lookback
        is padded too), else a live forward at width n (growing the store when n columns do not
        fit: no column moves). The bookkeeping is the caller's: `commit` afterwards."""
        n = ids.shape[1]
        if self._unsettled:
            raise RuntimeError(f"KV store of {self.owner} out of step: the last forward's columns were never committed")
        self._unsettled = n
        look = 0 if attend is None else attend.shape[-1] - n
        fits = [
            (w, l)
            for (k, w), (l, _) in self._compiled.items()
            if k == key and n <= w and look <= l and self._length + w <= self.capacity
        ]
        if not fits:
            return self._run_live(call, ids, positions, attend, inputs)
        width, look = min(fits)
        if attend is None:
            attend = self._chain_inputs(ids.shape[0], n)[0]
        # Padded to the compiled width, in the standard strides its guards expect.
        ids, positions, *inputs = (widen(x, width) for x in (ids, positions, *inputs))
        out = self._compiled[(key, width)][1](*self._inputs(ids, positions, widen_attend(attend, width, look), *inputs))
        if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
            out = tuple(x.clone() for x in out)
        return tuple(self._in_use(x if width == n else x[:, :n]) for x in out)

    def _run_live(self, call, ids, positions, attend, inputs) -> tuple[torch.Tensor, ...]:
        """`call` over the live columns and the fed ones (module docstring); no mask at all while
        the store is dense, the call causal and no window applies."""
        width = ids.shape[1]
        if self._length + width > self.capacity:
            self._grow(self._length + width)
        ids, positions, *inputs = (self._physical(x.to(self.device), torch.zeros) for x in (ids, positions, *inputs))
        if self.window is not None:  # the fed columns' positions: this mask's and later calls' windows
            self._slots[:, self._length : self._length + width] = positions
        mask = None
        if attend is not None or self.window is not None or not self.dense or self.states is not None:
            attend = self._chain_inputs(len(self.rows), width)[0] if attend is None else attend
            mask = self._live_mask(self._attend(attend), self.dtype)
        for layer in self.live_cache.layers:
            layer.live = self._length
        if self.states is None:
            return tuple(self._in_use(x) for x in call(ids, positions, mask, self.live_cache, *inputs))
        # HF takes one mask per layer type: the attention layers' (one for both kinds unless they mix),
        # and the recurrent layers' 2-D input mask (None: no padding before a row's tokens).
        inputs_mask = self.states.begin(positions, [c > 0 for c in self.counts], self.dtype)
        masks = mask if isinstance(mask, dict) else {"full_attention": mask, "sliding_attention": mask}
        masks |= {kind: inputs_mask for kind in ("linear_attention", "conv")}
        out = call(ids, positions, masks, self.live_cache, *inputs)
        self.states.end()
        return tuple(self._in_use(x) for x in out)

    def _inputs(self, ids, positions, attend, *inputs):
        """A compiled step's inputs on the physical rows; the fed columns' positions go into
        `slots` (read by later calls)."""
        ids, positions, *inputs = (self._physical(x.to(self.device), torch.zeros) for x in (ids, positions, *inputs))
        if self.window is not None:
            self._slots[:, self._length : self._length + positions.shape[1]] = positions
        self._write_valid()
        return ids, positions, self._valid, self._slots, self._start(), self._attend(attend), *inputs

    def _start(self) -> torch.Tensor:
        start = self._starts.get(self._length)
        if start is None:
            start = self._starts[self._length] = torch.tensor(self._length, device=self.device)
        return start

    def _chain_inputs(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's causal attend [rows, W, W] and all-real keep [rows, W], made once per shape."""
        made = self._made.get((rows, width))
        if made is None:
            keep = torch.ones(rows, width, dtype=torch.bool, device=self.device)
            made = self._made[(rows, width)] = (chain_attend(width, None, None, rows, self.device), keep)
        return made


#: Per model, role ("target", "draft", a head drafter's kind), compile mode and batch size, its
#: store: the next request of that batch size reuses it (its compiled steps are the expensive part) when it
#: holds enough columns, and replaces it with a larger one when not. A model used as its own
#: draft keeps the two roles apart. So a model decodes one sized request at a time.
_STORES: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()


def model_cache(model: PreTrainedModel, role: str, batch: int, capacity: int | None, compile=False) -> KVStore:
    """The KV store of `model` (a HF model or a draft head) for a request of `batch` rows: with
    `capacity` None a fresh one of `CAPACITY_STEP` columns that grows as it fills, else the
    shared store of at least `capacity` columns (made once per model, role, mode and batch size;
    replaced when too small), reset."""
    if capacity is None:
        return KVStore.for_model(model, batch, CAPACITY_STEP, owner=f"the {role}")
    slots = _STORES.setdefault(model, {})
    key = (role, compile_mode(compile), batch)
    kv = slots.get(key)
    if kv is None or kv.capacity < capacity:
        kv = slots[key] = KVStore.for_model(model, batch, capacity, compile=compile, owner=f"the {role}")
    kv.reset()
    return kv
