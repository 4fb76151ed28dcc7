"""torch.compile for the decoding runtime: one `Compiler` (mode, seconds spent compiling, and a
fallback with a warning when compilation is unavailable or fails) for every compiled step, and
the KV store's compiled step and greedy chain (`make_step`, `make_chain`) with the padding that
lets a narrower call run a wider compiled step (`widen`, `widen_attend`).

Compiled steps keep only dynamo's tensor guards (shapes, dtypes, devices of the weights, the
cache and the inputs): checking the ~1,000 module/config guards cost 0.1-0.3 ms per call on
the demo models, as much as a draft step's arithmetic. Each compiled function belongs to one
cache, one variant and one width, so identity guards are redundant. The contract that buys:
weights may change in place (they are graph inputs, never baked in), but hooks, config values
or the module structure must not change after the warm-up; decode a changed model afresh.
"""

from __future__ import annotations

import os
import shutil
import time
import types
import warnings

import torch

from draftsmith.decoding.masks import chain_attend, spans, static_mask
from draftsmith.decoding.target import hf_call

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
        warnings.warn(f"torch.compile is off for {self.owner}: {reason}. Decoding continues uncompiled.", stacklevel=3)

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


# --------------------------------------------- the KV store's compiled step, chain and padding


def make_step(call, kv):
    """The one compiled forward of a KV store (`kv.KVStore`): (ids [B, W], positions [B, W], valid
    [B, capacity], slots [B, capacity] (positions of the columns), start 0-d long, attend
    [B, W, L], *inputs [B, W, ...]) -> the outputs of `call(ids, positions, mask, cache, *inputs)`
    (`hf_call`: logits, hidden states)."""
    layers, cache = list(kv.cache.layers), kv.cache
    dtype, window, mixed = kv.dtype, kv.window, kv.mixed

    def step(ids, positions, valid, slots, start, attend, *inputs):
        for layer in layers:  # HF's StaticLayer writes at its cumulative length: point it at `start`
            layer.cumulative_length.copy_(start)
        return call(
            ids, positions, static_mask(valid, slots, start, attend, positions, dtype, window, mixed), cache, *inputs
        )

    return step


def make_chain(step, width: int, num_tokens: int, logits: bool):
    """A greedy draft chain over a static cache's `step` (its last-logits variant), as one
    function: (ids [B, p], positions, valid, slots, start, attend, keep [B, p], bias [V]) ->
    (tokens [B, k], then with `logits` their logits [B, k, V]). It feeds the p catch-up columns
    (`keep`: the real ones), then k - 1 times the argmax of (logits + bias) at the next
    position and slot; `bias` is -inf on ids the target lacks. Pure tensor code: `valid` and
    `slots` are updated functionally, the host's bookkeeping follows (`KVStore.chain`)."""

    def chain(ids, positions, valid, slots, start, attend, keep, bias):
        out = step(ids, positions, valid, slots, start, attend)[0]
        rel = torch.arange(valid.shape[1], device=valid.device)[None] - start  # slot - start
        fed = (rel >= 0) & (rel < width)
        # The catch-up's real columns; each draft's slot joins once it is fed (`static_mask`: a
        # step's `valid` ends before its own slot).
        valid = torch.where(fed, keep.index_select(1, rel[0].clamp(0, width - 1)), valid)
        slots = torch.where(fed, positions.index_select(1, rel[0].clamp(0, width - 1)), slots)
        slots = torch.where(rel >= width, positions[:, -1:] + 1 + rel - width, slots)
        one = torch.ones(ids.shape[0], 1, 1, dtype=torch.bool, device=ids.device)
        tokens, raw = [], []
        for i in range(num_tokens):
            raw.append(out[:, -1])
            tokens.append((raw[-1].float() + bias).argmax(-1))
            if i + 1 < num_tokens:
                if i:  # the draft the previous step fed is real for this one
                    valid = valid | (rel == width + i - 1)
                out = step(tokens[-1][:, None], positions[:, -1:] + 1 + i, valid, slots, start + width + i, one)[0]
        return (torch.stack(tokens, 1), torch.stack(raw, 1)) if logits else (torch.stack(tokens, 1),)

    return chain


def widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [B, n, ...] as [B, width, ...] in standard strides (compiled steps guard on them): x
    itself when it already is, else a zero-padded copy."""
    if x.shape[1] == width and x.stride() == _standard_strides(x.shape):
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], 1)


def _standard_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def widen_attend(attend: torch.Tensor, width: int, look: int) -> torch.Tensor:
    """attend [B, n, m + n] (m <= look) as [B, width, look + width]: the lookback is padded on
    the left with True (`valid` alone decides there) and each padding column sees only itself."""
    batch, n, span = attend.shape
    if (n, span) == (width, look + width):
        return attend
    out = torch.zeros(batch, width, look + width, dtype=torch.bool, device=attend.device)
    out[:, :n, : look + n - span] = True
    out[:, :n, look + n - span : look + n] = attend
    out[:, n:, look + n :] = torch.eye(width - n, dtype=torch.bool, device=attend.device)
    return out


class CompiledSteps:
    """The KV store's compiled steps and greedy chains (`decoding/kv.py`'s `KVStore` has them): what
    `warm_up` compiles and `run` / `chain` replay over the store's whole buffers."""

    def _compile(self, fn, width: int, look: int, extra: tuple, room: int, what: str):
        """`fn` (a step or a chain of this store, fed `width` columns after a lookback of `look`
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
        """A compiled greedy draft chain (`make_chain`): feed the right-aligned catch-up ids
        [rows, p] (row b's real columns from lo_b) at `positions`, then draft `num_tokens` tokens,
        feeding each but the last, in ONE call; a chain of k >= num_tokens warmed for p is cut
        (its extra drafts stay junk past the pointer). Returns tokens [rows, k] and, with
        `logits`, their logits [rows, k, V] (else None); the store then holds the catch-up and
        k - 1 drafts, as step-by-step forwards leave it. None (nothing fed) when no compiled
        chain fits: the caller drafts step by step."""
        width, rows = ids.shape[1], ids.shape[0]
        fits = [
            k
            for (w, k, l) in self._chains
            if (w, l) == (width, logits) and num_tokens <= k and self._length + width + k - 1 <= self.capacity
        ]
        if not fits:
            return None
        k = min(fits)
        if any(lo):
            attend, keep = chain_attend(width, lo, None, rows, self.device), spans(width, lo, None, rows, self.device)
        else:
            attend, keep = self._chain_inputs(rows, width)
        fn = self._chains[(width, k, logits)]
        out = fn(*self._inputs(ids, positions, attend), self._physical(keep, torch.zeros), bias.to(self.device))
        out = [self._in_use(x if k == num_tokens else x[:, :num_tokens]) for x in out]
        if self.device.type == "cuda":  # a CUDA graph replay reuses its output buffers
            out = [x.clone() for x in out]
        self._unsettled = width
        self.commit_spans(width, lo, None)
        if num_tokens > 1:
            if self.window is not None:
                drafts = positions[:, -1:].to(self.device) + torch.arange(1, num_tokens, device=self.device)
                self._slots[:, self._length : self._length + num_tokens - 1] = self._physical(drafts, torch.zeros)
            self._unsettled = num_tokens - 1
            self.commit_spans(num_tokens - 1)
        return out[0], (out[1] if logits else None)
