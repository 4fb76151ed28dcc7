"""torch.compile for the decoding runtime: one `Compiler` (mode, seconds spent compiling, and a
fallback with a warning when compilation is unavailable or fails) for every compiled step.

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


class StaticCacheOverflow(ValueError):
    """A preallocated cache cannot hold what was asked of it (nothing was written)."""


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
