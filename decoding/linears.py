"""How the decoder's forwards run `nn.Linear` over a few rows on a CPU.

A verification forward feeds K + 1 columns per row, so every linear layer of the target multiplies a
few rows X [n, in] by its weight W [out, in]. On a CPU, PyTorch computes `F.linear` as X Wᵀ, and
MKL's single-precision GEMM in that orientation costs about as much as n separate one-row products
for small n (measured on the demo's 2-core x86 machine with torch 2.13's MKL: SmolLM2-135M's
4-column forward took 1.5x its 1-column forward). The same product taken as (W Xᵀ)ᵀ runs at the
cost of about one row for n up to 8 (the 4-column forward: 0.9-1.0x the 1-column one). So within
`cpu_linears`, a float32 `nn.Linear` on the CPU computes 2 to `MAX_ROWS` rows that way:

- the arithmetic is the same product and sum; only MKL's blocking, hence the float rounding, differs,
  as it already differs between a one-row forward (a matrix-vector product) and a wider one;
- one row (target-only decoding, batch 1) keeps `F.linear`, and so does anything wider than
  `MAX_ROWS` (a prompt's prefill), bfloat16/float16 (oneDNN's kernels, which the other orientation
  does not help) and every device but the CPU;
- the model is not changed: for the decode's duration each plain `nn.Linear` instance gets a
  `forward` of its own, removed afterwards (modules that already have one, e.g. accelerate's
  offloading hooks, are left alone);
- `DRAFTSMITH_CPU_LINEARS=aten` turns it off (to compare the two, side by side).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

#: The widest input (rows = every dim but the last, multiplied) that takes (W Xᵀ)ᵀ.
MAX_ROWS = 64
#: `DRAFTSMITH_CPU_LINEARS` values: "transposed" (the default) or "aten" (always `F.linear`).
CHOICES = ("transposed", "aten")


def choice() -> str:
    value = os.environ.get("DRAFTSMITH_CPU_LINEARS", "transposed")
    if value not in CHOICES:
        raise ValueError(f"DRAFTSMITH_CPU_LINEARS={value!r}; expected one of {', '.join(CHOICES)}")
    return value


def in_force(device, dtype) -> str:
    """What a decode on `device` in `dtype` multiplies its linears with (the reports record it):
    "W Xᵀ" (this module) or "F.linear"."""
    swapped = choice() == "transposed" and torch.device(device).type == "cpu" and dtype == torch.float32
    return "W Xᵀ" if swapped else "F.linear"


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as (W Xᵀ)ᵀ when x has 2..MAX_ROWS rows (contiguous, as F.linear's)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= MAX_ROWS or weight.dim() != 2:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # MKL's matrix-vector product streams W at a third of the two-column product's speed
        flat = flat.expand(2, -1).contiguous()
    out = torch.mm(weight, flat.t())[:, :rows].t()
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def _transposed_forward(module: torch.nn.Linear):
    def forward(x):
        return few_rows_linear(x, module.weight, module.bias)

    return forward


def _swappable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and "forward" not in vars(module)  # already replaced: by accelerate, or by this block (a module seen twice)
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )


@contextlib.contextmanager
def cpu_linears(*models):
    """For the block's duration, the float32 CPU `nn.Linear`s of `models` (modules; None is skipped)
    compute a few rows as (W Xᵀ)ᵀ (module docstring); nothing when `DRAFTSMITH_CPU_LINEARS=aten`.
    Yields how many modules it swapped."""
    swapped: list[torch.nn.Linear] = []
    try:
        if choice() == "transposed":
            for model in models:
                for module in model.modules() if model is not None else ():
                    if _swappable(module):
                        module.forward = _transposed_forward(module)
                        swapped.append(module)
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward
