"""Per-row state of a model's recurrent layers (linear attention, short convolutions, SSMs): what a
hybrid target such as Qwen3.5, Qwen3-Next, LFM2 or Bamba keeps beside its KV cache, rolled back
per row to each row's last accepted token.

A KV column can become a hole; a recurrent state cannot: it has folded in every token it was fed.
So every forward records the state after each fed column, and a commit sets each row's state to
the one after its last kept column (vLLM keeps per-position states the same way):
- the recurrent state: HF's layers record it per fed token when the cache asks for it
  (`recurrent_states_to_keep`: the last n tokens are stepped one by one, each state kept); a
  verify of K + 1 tokens steps exactly as target-only decoding does, token by token;
- the convolution state: the layer's last `kernel` inputs; the cache keeps the whole
  [old window | fed inputs] (`record_past`), and the state after j fed columns is its window
  [j, j + kernel).
What this asks of a fed block, per row: its kept columns are one run [lo_b, hi_b) (a chain: never
a tree's branches, which would need a state per branch); columns after hi_b are free (they are
never kept); columns before lo_b (left padding) only on a row with no state yet, where they are
masked to zero inputs (HF's 2-D mask for these layers), which leave a zero state exactly zero.
A `retain` that cuts back several forwards (a draft model's chain) reads states kept per column
since `checkpoint`.

The model runs unmodified: its layers read and write these states through HF's cache API
(`LinearAttentionLayer`), which this module fills before and reads after each forward.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer, get_layer_types_and_kwargs

#: Layer types whose state lives in a `LinearAttentionLayer` (HF's names: Gated DeltaNet, Mamba-2 and
#: other SSM mixers are "linear_attention", LFM2's short convolutions "conv"; Falcon-H1's "hybrid"
#: layers hold an SSM state and attention columns both).
STATE_TYPES = ("linear_attention", "conv", "hybrid")
#: Layers with no cache at all (KV shared with another layer, MLP-only blocks).
NO_CACHE_TYPES = ("dummy",)
#: A forward of at most this many columns keeps the state after every column (stepped one token at
#: a time); a longer one (a prompt) only its last: its rows must all end at its last column.
RECORD_EVERY_COLUMN = 64


def state_layers(config, owner: str) -> dict[int, int]:
    """{layer index: its number of states} of a model config's recurrent layers ({} for none)."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return {i: kw.get("number_of_states", 1) for i, (t, kw) in enumerate(zip(types, kwargs)) if t in STATE_TYPES}


def check_cache_protocol(model, owner: str) -> None:
    """A model whose recurrent layers keep their state in a cache class of their own (MiniMax's
    `MiniMaxCache`) cannot be rolled back per row here: one line that says so."""
    module = inspect.getmodule(type(model))
    own = sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, Cache) and obj.__module__ == getattr(module, "__name__", None)
    )
    if own:
        raise ValueError(
            f"{owner} ({type(model).__name__}) keeps its recurrent state in its own cache class ({', '.join(own)}), "
            "which records no per-token states: the decoder cannot roll its rows back to their accepted tokens"
        )


class StateLayer(LinearAttentionLayer):
    """HF's linear-attention cache layer, filled by `RowStates` before each forward and read after it."""

    def prime(self, conv: list, recurrent: list, keep: int) -> None:
        """Before a forward: the committed states (None: none yet), and record the last `keep` fed
        tokens' recurrent states."""
        started = any(c is not None for c in conv) or any(r is not None for r in recurrent)
        for i in range(self.number_of_states):
            self.conv_states[i], self.recurrent_states[i] = conv[i], recurrent[i]
            self.is_conv_states_initialized[i] = conv[i] is not None
            self.is_recurrent_states_initialized[i] = recurrent[i] is not None
            self.has_previous_state[i] = started
            if conv[i] is not None:
                self.conv_kernel_size[i] = conv[i].shape[-1]
        self.record_past, self.recurrent_states_to_keep = True, keep
        self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}  # one list each


class RowStates:
    """The recurrent layers of one model's store: their states per physical row, the per-column
    states of the last forward, and (after `checkpoint`) of every uniform commit since."""

    def __init__(self, numbers: dict[int, int], owner: str):
        self.owner, self.numbers = owner, numbers  # layer index -> its number of states
        self.layers: dict[int, StateLayer] = {}  # the cache layers the model reads them through (`attach`)
        self.reset()

    def attach(self, layers: dict[int, StateLayer]) -> None:
        """The cache layers (`StateLayer`s, one per index of `numbers`) the store's forwards see."""
        self.layers = layers

    def reset(self) -> None:
        # Per layer and state index: conv [B, C, kernel] and recurrent [B, ...], None before the first forward.
        self.conv = {i: [None] * n for i, n in self.numbers.items()}
        self.recurrent = {i: [None] * n for i, n in self.numbers.items()}
        self._pending = None  # the last forward's per-column states
        self._journal: list | None = None  # states per column since `checkpoint` (index 0: at it)

    # ------------------------------------------------------------------- around a forward

    def begin(self, positions: torch.Tensor, started: list[bool], dtype) -> torch.Tensor | None:
        """Before a forward of `positions [B, W]` (physical rows; `started[b]`: row b holds a state).
        Returns the 2-D input mask of the recurrent layers [B, W] (0 on a fresh row's left padding),
        or None when no row has padding before its tokens. Refuses left padding on a started row."""
        width = positions.shape[1]
        keep = width if width <= RECORD_EVERY_COLUMN else 0
        for i, layer in self.layers.items():
            layer.prime(self.conv[i], self.recurrent[i], keep)
        self._width, self._every = width, keep == width
        # A row's real tokens have increasing positions from its count on; left padding sits at 0
        # before them: on a fresh row the columns before its last position-0 column, on a started
        # row any column at 0 (one device sync in a decode, where every row has started).
        zero = positions == 0  # [B, W]
        if all(started):
            if bool(zero.any()):
                raise ValueError(self._left_padding)
            return None
        cols = torch.arange(width, device=positions.device)
        last_zero = torch.where(zero, cols, -1).amax(1)  # [B]: -1 when none
        pads = (cols[None] < last_zero[:, None]).cpu()
        fresh = torch.tensor([not s for s in started])
        if (pads.any(1) & ~fresh).any() or (zero.cpu() & ~fresh[:, None]).any():
            raise ValueError(self._left_padding)
        if not pads.any():
            return None
        return (~pads).to(device=positions.device, dtype=dtype)

    @property
    def _left_padding(self) -> str:
        return (
            f"{self.owner}'s recurrent layers were fed left padding after a row's tokens: a state cannot "
            "skip a column (feed such rows' blocks left-aligned, padding after their tokens)"
        )

    def end(self) -> None:
        """After the forward: the states after each fed column, per layer (`_pending`)."""
        pending = {}
        for i, layer in self.layers.items():
            per_state = []
            for s in range(layer.number_of_states):
                conv = layer.conv_states[s]
                if conv is not None:  # [B, C, kernel + W]: the old window, then the fed inputs
                    kernel = layer.conv_kernel_size[s]
                    missing = kernel + self._width - conv.shape[-1]  # a first forward has no old window
                    conv = torch.nn.functional.pad(conv, (missing, 0)) if missing > 0 else conv
                recurrent = None
                if layer.is_recurrent_states_initialized[s]:
                    history = layer.recurrent_states_history[s]
                    # [W + 1, B, ...]: before the block, then after each column (or before and after)
                    recurrent = torch.stack([*history, layer.recurrent_states[s]])
                per_state.append((conv, recurrent))
            pending[i] = per_state
            layer.record_past = False
        self._pending = pending

    # ------------------------------------------------------------------- commits

    def commit(self, first: list[int], end: list[int]) -> None:
        """Row b (physical) kept the fed columns [first_b, end_b) of the last forward (end_b = first_b:
        none): its state becomes the one after column end_b - 1."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"{self.owner}'s recurrent states: a commit with no forward before it")
        width = self._width
        uniform = all(e == end[0] for e in end)
        if not self._every and not all(e in (0, width) for e in end):  # only a long block's end was kept
            raise RuntimeError(
                f"{self.owner}'s recurrent states: a {width}-column forward keeps only its last state, "
                f"but rows ended at columns {sorted(set(end))}"
            )
        index = torch.tensor(end)
        for i, per_state in pending.items():
            for s, (conv, recurrent) in enumerate(per_state):
                if conv is not None:
                    kernel = conv.shape[-1] - width
                    self.conv[i][s] = self._pick_conv(conv, index, kernel, uniform)
                if recurrent is not None:
                    at = index if self._every else (index > 0).long()  # [W + 1] or [before, after]
                    self.recurrent[i][s] = self._pick(recurrent, at, uniform)
        if self._journal is not None:
            if uniform and end[0] == width and self._every:
                self._journal.append((width, pending))
            else:
                self._journal = None  # rows went apart: nothing to cut back to any more

    @staticmethod
    def _pick(stacked: torch.Tensor, at: torch.Tensor, uniform: bool) -> torch.Tensor:
        """Row b of stacked [N, B, ...] at index at_b."""
        if uniform:
            return stacked[int(at[0])].clone()
        rows = torch.arange(stacked.shape[1])
        return stacked[at.to(stacked.device), rows.to(stacked.device)]

    @staticmethod
    def _pick_conv(conv: torch.Tensor, end: torch.Tensor, kernel: int, uniform: bool) -> torch.Tensor:
        """Row b's window [end_b, end_b + kernel) of conv [B, C, kernel + W]."""
        if uniform:
            start = int(end[0])
            return conv[..., start : start + kernel].contiguous()
        cols = end.to(conv.device)[:, None] + torch.arange(kernel, device=conv.device)[None]  # [B, kernel]
        return conv.gather(-1, cols[:, None, :].expand(-1, conv.shape[1], -1))

    def checkpoint(self) -> None:
        """From here on, keep the states after every column of uniform commits, for `retain`."""
        self._journal = []

    def retain(self, width: int, keep: list[int]) -> None:
        """Of the last `width` committed columns (uniform commits since `checkpoint`), row b keeps
        the first keep_b: its state becomes the one after them."""
        journal, self._journal = self._journal, None
        columns = sum(w for w, _ in journal or ())
        if journal is None or columns < width:
            raise RuntimeError(
                f"{self.owner}'s recurrent states cannot cut back {width} columns: only {columns} were kept "
                "per column since the last checkpoint"
            )
        if width == 0 or all(k == width for k in keep):
            return
        at = torch.tensor([columns - width + k for k in keep])  # per row: columns after the checkpoint it keeps
        for i, n in self.numbers.items():
            for s in range(n):
                conv, recurrent = journal[0][1][i][s]
                if conv is not None:  # one history [B, C, kernel + columns]: the first window, then every input
                    kernel = conv.shape[-1] - journal[0][0]
                    whole = torch.cat([conv, *(p[i][s][0][..., kernel:] for _, p in journal[1:])], dim=-1)
                    self.conv[i][s] = self._pick_conv(whole, at, kernel, False)
                if recurrent is not None:  # [columns + 1, B, ...]: at the checkpoint, then after each column
                    states = torch.cat([recurrent[:1], *(p[i][s][1][1:] for _, p in journal)])
                    self.recurrent[i][s] = self._pick(states, at, False)

    # ------------------------------------------------------------------- rows

    def select(self, index: torch.Tensor) -> None:
        """Only the physical rows `index` stay."""
        for states in (self.conv, self.recurrent):
            for per_state in states.values():
                for s, x in enumerate(per_state):
                    if x is not None:
                        per_state[s] = x.index_select(0, index.to(x.device))
        if self._journal is not None:  # its per-column states: conv [B, ...], recurrent [W + 1, B, ...]
            self._journal = [
                (width, {i: [(_rows(c, 0, index), _rows(r, 1, index)) for c, r in per] for i, per in pending.items()})
                for width, pending in self._journal
            ]


def _rows(x: torch.Tensor | None, dim: int, index: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x.index_select(dim, index.to(x.device))
