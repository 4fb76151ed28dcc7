"""A static-cache adapter, optionally compiled: the fast decoding path for small models.

On a small target (a few million parameters) one forward costs a few milliseconds, and most of
that is fixed per-call overhead (Python, HF's mask and cache bookkeeping, one dispatch per op),
not arithmetic. `StaticCausalLMAdapter` removes most of it:

- the KV cache is preallocated once (HF `StaticCache`, `[1, kv_heads, capacity, head_dim]` per
  layer) and written at explicit slots: a forward fed at cache length `s` writes slots
  s..s+n-1, so rejected drafts are simply overwritten by the next call. `crop` moves the length
  pointer; `keep` gathers the accepted tree path into contiguous slots. Nothing grows per step;
- every forward goes through one step function with the same inputs: token ids, positions, the
  cache length `s` as a 0-d tensor, and the [n, n] "allowed" matrix of the new tokens (lower
  triangular for a chain, ancestors for a tree). The step builds the additive mask
  [1, 1, n, capacity] itself (slots < s: attend; the new tokens: as allowed; the rest: blocked);
- with `compile` that step is `torch.compile`d (inductor; on CUDA with CUDA graphs) for a small
  fixed set of widths, see `warm_up`. A narrower call is padded up to the nearest compiled
  width: the padding rows write junk KV past the committed length (never attended, overwritten
  later) and are dropped from the outputs. Wider calls (the prefill) run the same step
  uncompiled. `greedy_chain` drafts k greedy tokens in ONE compiled call (a draft model's whole
  proposal), so the per-call overhead is paid once per proposal, not once per token.

The model is never modified and no modeling file is forked: everything goes through
`model.forward` with `cache=` and a 4-D float mask.

Compiled steps keep only dynamo's tensor guards (shapes, dtypes, devices of the weights, the
cache and the inputs): checking the ~1,000 module/config guards cost 0.1-0.3 ms per call on
the demo models, as much as a draft step's arithmetic. Each compiled function belongs to one
adapter, one variant and one width, so identity guards are redundant. The contract that
buys: weights may change in place (they are graph inputs, never baked in), but hooks, config
values or the module structure must not change after the warm-up; make a new adapter instead.

Limits: full-attention layers only (HF's static sliding-window layers are ring buffers that
cannot be cropped back after a rejection; use the default `CausalLMAdapter` for those), batch 1
(the batched decoder has its own static ragged cache, `eval/batched.py`). `Compiler` and
`static_mask` serve every fast-path user: this adapter, the EAGLE and Medusa drafters
(`eval/eagle.py`, `eval/drafters.py`) and the batched caches.
A forward that would write past the capacity raises `StaticCacheOverflow` and leaves the cache
as it was; `reserve` grows the cache between requests.
"""

from __future__ import annotations

import os
import shutil
import time
import types
import warnings
import weakref

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from draftsmith.heads.target import CausalLMAdapter, ForwardResult

#: Capacities are rounded up to a multiple of this, so that requests of similar length share
#: one cache (and one set of compiled graphs: the capacity is part of every compiled shape).
#: Attention reads every slot, so a coarser step costs time on every forward.
CAPACITY_STEP = 128

#: `compile=` values. "default": inductor's defaults (on CUDA `reduce-overhead`, i.e. CUDA
#: graphs). "max-autotune": inductor's GEMM autotuning (on CUDA Triton GEMMs, with CUDA graphs;
#: on CPU `max_autotune` + `freezing` with the C++ GEMM templates). On the demo CPU models it
#: measured no faster than "default" (the weights stay graph inputs, which keeps them
#: updatable, and the C++ templates are not picked) while its first compile takes minutes.
COMPILE_MODES = ("default", "max-autotune")


class StaticCacheOverflow(ValueError):
    """A forward would write past the preallocated cache."""


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why `torch.compile` cannot run on `device` here, or None when it can as far as one can
    tell without compiling (a failed first compile still falls back, see `warm_up`)."""
    device = torch.device(device)
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        return "TORCHDYNAMO_DISABLE=1 is set"
    if device.type == "cpu":
        from torch._inductor import config as inductor_config

        cxx = inductor_config.cpp.cxx
        candidates = [os.environ.get("CXX"), *(cxx if isinstance(cxx, tuple) else (cxx,)), "g++", "clang++", "c++"]
        if not any(c and shutil.which(c) for c in candidates):
            return "inductor on CPU needs a C++ compiler and none was found (install g++, or set CXX)"
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor on CUDA needs Triton, which is not installed"
    return f"torch.compile is not supported for device type {device.type!r} here"


def compile_mode(compile) -> str | None:
    """The mode a `compile=` value asks for: None (off), "default" (True) or "max-autotune"."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "default"
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be True/False or one of {COMPILE_MODES}, got {compile!r}")
    return compile


def _fresh_function(fn):
    """A copy of `fn` (a function or a bound method) with its own code object: dynamo keeps its
    compiled graphs (and walks their guards) per code object, so each adapter, variant and
    width gets a cache of its own."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(_fresh_function(fn.__func__), fn.__self__)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def static_mask(start, allowed: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, n, capacity] of n new tokens over a preallocated cache: slots
    before `start` are attended, the m slots start..start+m-1 as `allowed` [n, m] (bool) says,
    every later slot is blocked (junk: never read). `start` may be a 0-d tensor (compiled)."""
    fed = allowed.shape[1]
    rel = torch.arange(capacity, device=allowed.device) - start  # slot - start
    sees = allowed.index_select(1, rel.clamp(0, fed - 1))  # [n, capacity]
    ok = (rel < 0) | ((rel < fed) & sees)
    return torch.where(ok, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


class Compiler:
    """`torch.compile` for one fast-path user (a static adapter, a drafter's heads): the mode,
    the seconds spent compiling, and why compilation is off when it is.

    Compiled functions keep only dynamo's tensor guards (see the module doc); each call of
    `wrap` gets a code object of its own, i.e. a graph cache of its own."""

    def __init__(self, compile: bool | str, device: torch.device | str, owner: str):
        self.mode = compile_mode(compile)
        self.device = torch.device(device)
        self.owner = owner
        self.seconds = 0.0
        self.error: str | None = None
        if self.mode is not None:
            reason = compile_unavailable(self.device)
            if reason is not None:
                self.disable(reason)

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    def disable(self, reason: str) -> None:
        self.mode = None
        self.error = reason
        warnings.warn(
            f"torch.compile is off for {self.owner}: {reason}. Decoding continues uncompiled.",
            stacklevel=3,
        )

    def wrap(self, fn):
        """`fn` compiled for this device and mode (compilation happens on its first call)."""
        # One function (one code object) per adapter, variant and width: each holds a single
        # graph, so a call checks one set of guards and never meets dynamo's recompile limit.
        fn = _fresh_function(fn)
        options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}  # see the module doc
        if self.device.type == "cuda":
            # CUDA graphs: one replay per call (outputs are cloned: the next replay reuses them).
            mode = "reduce-overhead" if self.mode == "default" else "max-autotune"
            return torch.compile(fn, mode=mode, dynamic=False, fullgraph=True, options=options)
        # CPU: the C++ wrapper calls the kernels from C++. The Python wrapper's per-kernel
        # bookkeeping (stride asserts, buffer views) cost ~0.2 ms a call on the demo models,
        # about a third of a draft step: decoding measured ~10% faster with it.
        options["cpp_wrapper"] = True
        if self.mode == "max-autotune":
            options.update(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
        return torch.compile(fn, dynamic=False, fullgraph=True, options=options)

    def first_calls(self, what: str, compiled, *inputs) -> bool:
        """Run a freshly compiled function (this is when it compiles), timing it into `seconds`;
        False and a warning (and no more compiling) if that fails."""
        started = time.perf_counter()
        try:
            for _ in range(2 if self.device.type == "cuda" else 1):  # CUDA graphs record on the 2nd call
                compiled(*inputs)
        except Exception as err:  # noqa: BLE001 - whatever the compiler raised: fall back, say why
            first_line = (str(err).strip().splitlines() or [""])[0]
            self.disable(f"compiling {what} failed ({type(err).__name__}: {first_line})")
            return False
        finally:
            self.seconds += time.perf_counter() - started
        return True


def _make_step(model: PreTrainedModel, cache: StaticCache, hidden_layers: tuple[int, ...]):
    """The one forward every call goes through (compiled or not). Inputs:
    ids [1, B], positions [1, B], start (0-d long: the cache length = the first slot written),
    allowed [B, B] bool (which new tokens each new token sees), rows [r] long or None (the rows
    to compute logits for; None = all). Returns (logits, hidden states of `hidden_layers`)."""
    layers = list(cache.layers)
    dtype = model.dtype
    capacity = layers[0].max_cache_len

    def step(ids, positions, start, allowed, rows):
        # HF's StaticLayer writes at its cumulative length: point every layer at `start`.
        for layer in layers:
            layer.cumulative_length.copy_(start)
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=static_mask(start, allowed, capacity, dtype),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=0 if rows is None else rows,
        )
        hidden = tuple(out.hidden_states[i] for i in hidden_layers) if hidden_layers else ()
        return out.logits, hidden

    return step


def _make_greedy_chain(step, num_new: int, num_tokens: int, vocab_limit: int, device: torch.device):
    """Greedy drafting in one call: feed `num_new` pending tokens, then take the argmax (over the
    first `vocab_limit` logits) and feed it, `num_tokens` argmaxes in all (the last one is not
    fed). Inputs: ids [1, num_new], start (0-d long). Returns tokens [num_tokens] and logits
    [num_tokens, V]."""
    arange = torch.arange(num_new, device=device)
    tril = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    one = torch.ones(1, 1, dtype=torch.bool, device=device)
    last_row = torch.tensor([num_new - 1], device=device) if num_new > 1 else None

    def chain(ids, start):
        logits, _ = step(ids, (start + arange)[None], start, tril, last_row)
        logits = logits[0, -1]
        position = start + num_new
        tokens, all_logits = [], []
        for i in range(num_tokens):
            token = logits[:vocab_limit].argmax(-1)
            tokens.append(token)
            all_logits.append(logits)
            if i + 1 < num_tokens:
                logits, _ = step(token.view(1, 1), position.view(1, 1), position, one, None)
                logits = logits[0, -1]
                position = position + 1
        return torch.stack(tokens), torch.stack(all_logits)

    return chain


class StaticCausalLMAdapter(CausalLMAdapter):
    """`CausalLMAdapter`'s interface (reset / forward / crop / keep / seq_len) over a
    preallocated cache of `max_length` slots (rounded up to `CAPACITY_STEP`), optionally
    compiled (`compile=True`, or a mode of `COMPILE_MODES`).

    Compilation happens in `warm_up(widths)` / `warm_up_greedy_chain(k)`, never inside a
    forward: `compile_seconds` adds up the time spent. `compile_error` says why compilation is
    off when it is unavailable or failed (the adapter then runs uncompiled, with a warning).
    """

    keep_in_place = True

    def __init__(self, model: PreTrainedModel, max_length: int, *, compile: bool | str = False):
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model; the static cache needs a causal LM")
        super().__init__(model)
        # Read once: `model.device` walks the parameters (~50 us a call on the demo target).
        self._device = model.device
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self.compiler = Compiler(compile, self._device, type(model).__name__)
        self._eager: dict[tuple, object] = {}  # (hidden_layers, last_only) -> uncompiled step
        self._compiled: dict[tuple, object] = {}  # ((hidden_layers, last_only), width) -> compiled step
        self._chains: dict[tuple, object] = {}  # (num_new, num_tokens, vocab_limit) -> compiled chain
        self._chain_inputs_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._length = 0
        self._allocate(max_length)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def compile(self) -> bool:
        """Whether forwards may run compiled (False after a failed or unavailable compile)."""
        return self.compiler.enabled

    @property
    def compile_mode(self) -> str | None:
        return self.compiler.mode

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (warm-ups), never part of a forward."""
        return self.compiler.seconds

    @property
    def compile_error(self) -> str | None:
        """Why compilation is off, when it was asked for and is unavailable or failed."""
        return self.compiler.error

    # ------------------------------------------------------------------------ the cache

    @property
    def capacity(self) -> int:
        """Slots preallocated per layer: the most tokens a sequence can hold."""
        return self._capacity

    @property
    def seq_len(self) -> int:
        return self._length

    def _allocate(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        capacity = -(-int(max_length) // CAPACITY_STEP) * CAPACITY_STEP
        text = self.config.get_text_config()
        cache = StaticCache(config=self.config, max_cache_len=capacity)
        for i, layer in enumerate(cache.layers):
            if type(layer) is not StaticLayer:
                raise ValueError(
                    f"the static cache supports full-attention layers only; layer {i} of "
                    f"{type(self.model).__name__} is a {type(layer).__name__} (sliding window or other), whose "
                    "entries cannot be cropped back after a rejection. Use the default dynamic cache "
                    "(static_cache=False) for this model."
                )
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        cache.early_initialization(1, kv_heads, head_dim, self.model.dtype, self._device)
        self.cache, self._capacity = cache, capacity
        # New tensors: every step built over the old cache is stale.
        self._eager.clear()
        self._compiled.clear()
        self._chains.clear()
        self._length = 0

    @torch.inference_mode()
    def reserve(self, max_length: int) -> None:
        """Make room for a sequence of `max_length` tokens (prompt, new tokens and the padding
        of the widest call). Growing allocates a new cache (the entries held are copied over)
        and recompiles what was warmed against it: do it between requests, never inside a
        timed region (`generate` does it before its clock starts)."""
        if max_length <= self._capacity:
            return
        old, length = self.cache, self._length
        warmed, chains = sorted(self._compiled), sorted(self._chains)
        self._allocate(max_length)
        for new, previous in zip(self.cache.layers, old.layers):
            new.keys[..., :length, :] = previous.keys[..., :length, :]
            new.values[..., :length, :] = previous.values[..., :length, :]
        self._length = length
        for (hidden_layers, last_only), width in warmed:
            self.warm_up([width], hidden_layers, last_only)
        for num_new, num_tokens, vocab_limit in chains:
            self.warm_up_greedy_chain(num_tokens, vocab_limit, num_new=num_new)

    def reset(self) -> None:
        self._length = 0  # old entries stay in the tensors; every slot >= the length is junk

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        self._length = length

    @torch.inference_mode()
    def keep(self, base: int, indices: list[int]) -> None:
        """As `CausalLMAdapter.keep`: slots base + i for i in `indices` move to base, base + 1,
        ... (one gather and one indexed write per layer, from the first entry not already in
        place); the length becomes base + len(indices)."""
        indices = [int(i) for i in indices]
        if base < 0 or any(i < 0 or base + i >= self._length for i in indices):
            raise ValueError(f"cannot keep {base} + {indices} of a cache of {self._length} tokens")
        first = next((j for j, i in enumerate(indices) if i != j), len(indices))
        if first < len(indices):
            src = torch.tensor([base + i for i in indices[first:]], dtype=torch.long, device=self._device)
            dst = torch.arange(base + first, base + len(indices), device=self._device)
            for layer in self.cache.layers:
                # Gather first (src and dst may overlap), then write.
                layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
                layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        self._length = base + len(indices)

    # ---------------------------------------------------------------------- compilation

    def _eager_step(self, key: tuple):
        if key not in self._eager:
            self._eager[key] = _make_step(self.model, self.cache, key[0])
        return self._eager[key]

    @property
    def compiled_widths(self) -> list[int]:
        """Widths with a compiled step (any variant)."""
        return sorted({width for (_, width) in self._compiled})

    @torch.inference_mode()
    def warm_up(self, widths, hidden_layers: tuple[int, ...] = (), last_only: bool = False) -> float:
        """Compile the step for each width in `widths` (tokens per call) and run it once; returns
        the seconds spent. A later call of n tokens runs at the smallest compiled width >= n
        (padded), or uncompiled when there is none. `hidden_layers` / `last_only` (logits of the
        last row only) name the variant the calls will use. The warm-up writes only slots past
        the cache length: the cache content is unchanged. A no-op without compilation."""
        key = (tuple(int(i) for i in hidden_layers), bool(last_only))
        todo = [w for w in sorted({int(w) for w in widths}) if w >= 1 and (key, w) not in self._compiled]
        if not self.compile or not todo:
            return 0.0
        before = self.compile_seconds
        for width in todo:
            if not self.compile:  # a failed compile turned it off
                break
            if self._length + width > self._capacity:
                raise StaticCacheOverflow(
                    f"cannot warm up width {width}: the cache holds {self._length} of {self._capacity} slots"
                )
            ids = torch.zeros(1, width, dtype=torch.long, device=self._device)
            inputs = self._inputs(ids, None, None, width, width, self._length, last_only)
            # One eager call first: HF installs its hidden-state capturing hooks lazily, under a
            # lock dynamo cannot trace; once installed, the compiled step runs through them.
            self._eager_step(key)(*inputs)
            compiled = self.compiler.wrap(self._eager_step(key))
            if self.compiler.first_calls(f"width {width}", compiled, *inputs):
                self._compiled[(key, width)] = compiled
        return self.compile_seconds - before

    @torch.inference_mode()
    def warm_up_greedy_chain(self, num_tokens: int, vocab_limit: int | None = None, *, num_new: int = 1) -> float:
        """Compile `greedy_chain` for proposals of `num_tokens` after `num_new` pending tokens;
        returns the seconds spent (0 without compilation: the chain then runs step by step)."""
        key = (int(num_new), int(num_tokens), int(vocab_limit or self._vocab))
        if not self.compile or key in self._chains or num_tokens < 1:
            return 0.0
        if self._length + num_new + num_tokens - 1 > self._capacity:
            raise StaticCacheOverflow(
                f"cannot warm up a {num_tokens}-token chain: the cache holds {self._length} of {self._capacity} slots"
            )
        before = self.compile_seconds
        compiled = self.compiler.wrap(_make_greedy_chain(self._eager_step(((), False)), *key, self._device))
        ids = torch.zeros(1, num_new, dtype=torch.long, device=self._device)
        start = torch.tensor(self._length, device=self._device)
        if self.compiler.first_calls(f"a {num_tokens}-token chain", compiled, ids, start):
            self._chains[key] = compiled
        return self.compile_seconds - before

    # ------------------------------------------------------------------------- decoding

    @torch.inference_mode()
    def greedy_chain(
        self, pending: torch.Tensor, num_tokens: int, vocab_limit: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `pending [1, p]`, then draft `num_tokens` tokens greedily (argmax over the first
        `vocab_limit` logits), feeding each but the last. Returns (tokens [num_tokens], logits
        [num_tokens, V]); the cache then holds the pending tokens and num_tokens - 1 drafts,
        as `forward` step by step would leave it. One compiled call when a chain of at least
        `num_tokens` was warmed for p (a longer one is cut: its extra drafts stay junk past the
        length), else step by step."""
        vocab_limit = int(vocab_limit or self._vocab)
        num_new, start = pending.shape[1], self._length
        fits = [
            k for (p, k, v) in self._chains
            if p == num_new and v == vocab_limit and k >= num_tokens and start + p + k - 1 <= self._capacity
        ]
        if not fits:
            logits = self.forward(pending, logits_to_keep=1).logits[0, -1]
            tokens, all_logits = [], []
            for i in range(num_tokens):
                tokens.append(logits[:vocab_limit].argmax(-1, keepdim=True))
                all_logits.append(logits)
                if i + 1 < num_tokens:
                    logits = self.forward(tokens[-1].view(1, 1)).logits[0, -1]
            return torch.cat(tokens), torch.stack(all_logits)
        k = min(fits)
        tokens, logits = self._chains[(num_new, k, vocab_limit)](
            pending.to(self._device), torch.tensor(start, device=self._device)
        )
        if self._device.type == "cuda":
            tokens, logits = tokens.clone(), logits.clone()
        self._length = start + num_new + num_tokens - 1
        return tokens[:num_tokens], logits[:num_tokens]

    def _inputs(self, ids, position_ids, allowed, n, width, start, last_only):
        """Step inputs for n real tokens padded to `width` rows. Padding rows: token 0 at
        position `start`, seeing only themselves; no real row sees them."""
        if width > n:
            ids = torch.cat([ids, ids.new_zeros(1, width - n)], dim=1)
        arange, tril = self._chain_inputs(width)
        if position_ids is None:
            positions = (arange + start)[None]
        else:
            positions = position_ids.reshape(1, n).to(self._device)
            if width > n:
                positions = torch.cat([positions, positions.new_full((1, width - n), start)], dim=1)
        if allowed is None:
            allowed = tril
        elif width > n:
            padded = torch.eye(width, dtype=torch.bool, device=self._device)
            padded[:n, :n] = allowed
            allowed = padded
        start_t = torch.tensor(start, dtype=torch.long, device=self._device)
        rows = torch.tensor([n - 1], device=self._device) if last_only else None
        return ids, positions, start_t, allowed, rows

    def _chain_inputs(self, width: int):
        if width not in self._chain_inputs_cache:
            self._chain_inputs_cache[width] = (
                torch.arange(width, device=self._device),
                torch.ones(width, width, dtype=torch.bool, device=self._device).tril(),
            )
        return self._chain_inputs_cache[width]

    def _pick(self, key: tuple, n: int, start: int):
        """(width, step) for a call of n tokens: the smallest compiled width >= n that fits in
        the cache, else n and the uncompiled step."""
        if self._compiled:
            fits = [w for (k, w) in self._compiled if k == key and n <= w and start + w <= self._capacity]
            if fits:
                return min(fits), self._compiled[(key, min(fits))]
        return n, self._eager_step(key)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        logits_to_keep: int = 0,
    ) -> ForwardResult:
        """As `CausalLMAdapter.forward`. A tree `attention_mask` [1, 1, n, seq_len + n] must let
        every new token see the whole cache (the decoder's `tree_attention_mask` does); its last
        n columns give the tree. `logits_to_keep`: 0 (all rows) or 1 (the last)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"the static cache decodes one sequence: input_ids must be [1, n >= 1], got {list(input_ids.shape)}")
        n, start = input_ids.shape[1], self._length
        if start + n > self._capacity:
            raise StaticCacheOverflow(
                f"static KV cache overflow: it holds {start} tokens and {n} more were fed, but it was "
                f"preallocated for {self._capacity}. Reserve room before the request "
                "(adapter.reserve(prompt + max_new_tokens + widest call)); nothing was written."
            )
        if logits_to_keep not in (0, 1):
            raise ValueError(f"logits_to_keep must be 0 (all rows) or 1 (the last) here, got {logits_to_keep}")
        allowed = None
        if attention_mask is not None:
            expected = (1, 1, n, start + n)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(f"tree attention mask must be {list(expected)}, got {list(attention_mask.shape)}")
            if attention_mask.dtype == torch.bool:
                raise ValueError("pass a float additive mask (0 / -inf), not a bool mask")
            if position_ids is None:
                raise ValueError("a tree attention mask needs position_ids too")
            if start and bool((attention_mask[0, 0, :, :start] != 0).any()):
                raise ValueError(
                    "the static cache needs every new token to see the whole cache: "
                    f"mask columns 0..{start - 1} must be 0"
                )
            allowed = attention_mask[0, 0, :, start:] == 0
        hidden_layers = tuple(int(i) for i in hidden_layers)
        last_only = logits_to_keep == 1 and n > 1
        key = (hidden_layers, last_only)
        width, fn = self._pick(key, n, start)
        logits, hidden = fn(*self._inputs(input_ids.to(self._device), position_ids, allowed, n, width, start, last_only))
        if self._device.type == "cuda" and fn is not self._eager.get(key):
            # A CUDA graph replay reuses its output buffers: copy them out.
            logits, hidden = logits.clone(), tuple(h.clone() for h in hidden)
        self._length = start + n
        if not last_only and width > n:
            logits = logits[:, :n]
        return ForwardResult(logits=logits, hidden_states={i: h[:, :n] for i, h in zip(hidden_layers, hidden)})


# ------------------------------------------------------------------------------ factory

_ADAPTERS: weakref.WeakKeyDictionary[PreTrainedModel, dict] = weakref.WeakKeyDictionary()


def static_adapter(
    model: PreTrainedModel, max_length: int, *, compile: bool | str = False, role: str = "target"
) -> StaticCausalLMAdapter:
    """The static adapter of `model` for `role`, made once and reused (its compiled graphs are
    the expensive part), grown to `max_length` if needed. `role` keeps a target and a draft
    that are the same model object apart: each needs a cache of its own."""
    slots = _ADAPTERS.setdefault(model, {})
    key = (role, compile_mode(compile))
    adapter = slots.get(key)
    if adapter is None:
        adapter = slots[key] = StaticCausalLMAdapter(model, max_length, compile=compile)
    else:
        adapter.reserve(max_length)
    return adapter
