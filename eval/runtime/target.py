"""Small helpers the loop and the drafters share: prompt checks, ragged blocks, device timing."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device, so that a host timer measures the work (timers call it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def max_positions(config) -> int | None:
    """A model's longest sequence (`max_position_embeddings`), or None when it has no limit."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def check_prompts(prompts) -> list[torch.Tensor]:
    """A non-empty list of 1-D (or [1, T]) LongTensors, as 1-D tensors."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of 1-D LongTensors, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for b, prompt in enumerate(prompts):
        if not isinstance(prompt, torch.Tensor) or prompt.dtype != torch.long:
            got = getattr(prompt, "dtype", type(prompt).__name__)
            raise ValueError(f"prompts[{b}] must be a LongTensor, got {got}")
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompts[{b}] must be a non-empty 1-D (or [1, T]) tensor, got shape {list(prompt.shape)}")
        out.append(prompt)
    return out


def right_aligned(pieces: list[list[int]], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
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


def right_align(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Move row b's first counts_b columns of x [B, T, ...] to the right end of a block of width
    max(counts); returns the block and each row's first real column."""
    width = max(counts)
    lo = [width - c for c in counts]
    src = torch.arange(width, device=x.device)[None] - torch.tensor(lo, device=x.device)[:, None]
    src = src.clamp(min=0).view(*src.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x[:, :width].gather(1, src), lo
