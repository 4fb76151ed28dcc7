"""How the decoder's forwards run `nn.Linear` over a few rows on a CPU.

A decoding step multiplies every linear layer's weight W [out, in] by a few rows X [n, in]: one per
row of the batch, K + 1 per row in a verification. On a CPU PyTorch computes `F.linear` as X Wᵀ, and
in float32 MKL is slow there (torch 2.13's MKL on the 2-core x86 machine of the docs; SmolLM2-135M,
whole forwards after a 200-token context, 2 threads):
- n = 2..4 costs 1.5-2x n = 1;
- n = 1 (a matrix-vector product) streams W at about a third of the speed of the same product
  taken as W Xᵀ with two columns.
So within `cpu_linears`, a float32 `nn.Linear` on the CPU computes 1 to `MAX_ROWS` rows as (W Xᵀ)ᵀ,
one row padded to two (that forward: 60 -> 36 ms at n = 1, 100 -> 39 ms at n = 2, 95 -> 51 ms at
n = 4; at n = 8 0.8x on 2 threads, 1.0-1.1x on one). Wider inputs keep `F.linear`: at 16-64 rows
the two measured alike on 2 threads and W Xᵀ 10-20% slower on one.
- the arithmetic is the same product and sum; only MKL's blocking, hence the float round-off,
  differs, as it already did between a one-row and a wider forward;
- bfloat16/float16 (oneDNN's kernels, which the other orientation does not help), other devices,
  subclasses of `nn.Linear` and modules whose `forward` is already replaced keep `F.linear`;
- the model is not changed: for the block's duration each swapped `nn.Linear` instance gets a
  `forward` of its own, removed afterwards, also after an error;
- `DRAFTSMITH_CPU_LINEARS=aten` turns it off (to compare the two side by side); reports name the
  one in force (`in_force`).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

#: The widest input (rows = every dim but the last, multiplied) that takes (W Xᵀ)ᵀ.
MAX_ROWS = 8
#: `DRAFTSMITH_CPU_LINEARS` values: "transposed" (the default) or "aten" (always `F.linear`).
CHOICES = ("transposed", "aten")


def choice() -> str:
    value = os.environ.get("DRAFTSMITH_CPU_LINEARS", "transposed")
    if value not in CHOICES:
        raise ValueError(f"DRAFTSMITH_CPU_LINEARS={value!r}; expected one of {', '.join(CHOICES)}")
    return value


def _covered(device, dtype) -> bool:
    """Whether weights on `device` in `dtype` take (W Xᵀ)ᵀ: float32 on the CPU."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def in_force(device, dtype) -> str:
    """What a decode on `device` in `dtype` multiplies its linears with (the reports record it):
    "W Xᵀ" (this module) or "F.linear"."""
    return "W Xᵀ" if choice() == "transposed" and _covered(device, dtype) else "F.linear"


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as (W Xᵀ)ᵀ when x has 1..MAX_ROWS rows (contiguous, as F.linear's)."""
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
        and _covered(weight.device, weight.dtype)
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
