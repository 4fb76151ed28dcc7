"""What each fed column of a ragged batch sees, as the bool blocks and the float masks HF models
take: spans of real columns, chain and tree attention over the fed block, and the per-layer-kind
masks of sliding-window models (`decoding/kv.py` keeps the columns they index).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

#: Layer types the decoder runs: attention over the store's columns, recurrent layers
#: (`decoding/recurrent.py`) and layers with no cache.
KNOWN_LAYERS = ("full_attention", "sliding_attention", "linear_attention", "conv", "hybrid", "dummy")


def attention_of(config, owner: str) -> tuple[int | None, bool, tuple[str, ...]]:
    """(window, mixed, layer types) of a model config's layers: the sliding window (None: every
    layer attends to everything), whether full and sliding layers mix (HF then takes one mask per
    kind) and HF's type of each layer."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == "sliding_attention"}
    odd = sorted(set(types) - set(KNOWN_LAYERS))
    if odd or len(windows) > 1:
        raise ValueError(
            f"the decoder runs full-attention, sliding-window (one window), linear-attention, convolution and hybrid "
            f"layers, but {owner} has {', '.join(odd) or f'windows {sorted(windows)}'} layers"
        )
    return (windows.pop() if windows else None), {"full_attention", "sliding_attention"} <= set(types), tuple(types)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float additive mask of a bool one (True = attend). Pure tensor code (compiled steps)."""
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


def layer_masks(allowed, dtype, window: int | None, mixed: bool, queries, keys):
    """What HF takes as `attention_mask` for `allowed [B, 1, W, S]`: its float mask; with a
    sliding `window`, the keys (positions `keys [B, S]`) `window` or more positions behind the
    query (`queries [B, W]`) are blocked too, for every layer, or as {"full_attention",
    "sliding_attention"} masks when the kinds are `mixed`."""
    if window is None:
        return additive(allowed, dtype)
    sliding = additive(allowed & (queries[:, None, :, None] - keys[:, None, None, :] < window), dtype)
    return {"full_attention": additive(allowed, dtype), "sliding_attention": sliding} if mixed else sliding


def spans(width: int, lo: list[int] | None, hi: list[int] | None, batch: int, device) -> torch.Tensor:
    """Bool [B, width]: True on columns [lo_b, hi_b) of row b (None: 0 / width)."""
    cols = torch.arange(width, device=device)[None]
    out = torch.ones(batch, width, dtype=torch.bool, device=device)
    if lo is not None:
        out &= cols >= torch.tensor(lo, device=device)[:, None]
    if hi is not None:
        out &= cols < torch.tensor(hi, device=device)[:, None]
    return out


def chain_attend(width: int, lo: list[int] | None, hi: list[int] | None, batch: int, device) -> torch.Tensor:
    """[B, W, W]: each fed column sees the real fed columns [lo_b, hi_b) up to itself, and itself
    (so no query row is fully blocked: a padding column's output is never read)."""
    if lo is None and hi is None:  # every column real: causal
        return torch.ones(batch, width, width, dtype=torch.bool, device=device).tril()
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    return (causal[None] & spans(width, lo, hi, batch, device)[:, None, :]) | eye[None]


def tree_attend(parents: list[list[int]], width: int, device) -> tuple[torch.Tensor, list[list[int]]]:
    """[B, W, W] for rows fed [last] + nodes (node i at column i + 1; `parents[b][i]` its
    parent's index, -1 = a child of `last`), and each row's fed depths (0 for `last`): a node
    sees `last`, its ancestors and itself; padding columns see themselves."""
    rows, depths = [], []
    for row in parents:
        # Ancestor sets as Python bitmasks (a node's = its parent's | itself), one tensor at the
        # end: a per-node tensor update costs ~20 us a node, the budget of a whole call.
        sets, depth = [1], [0]
        for i, parent in enumerate(row):
            if not -1 <= parent < i:
                raise ValueError(f"tree nodes must come after their parents; node {i} has parent {parent}")
            sets.append(sets[parent + 1] | (1 << (i + 1)))
            depth.append(depth[parent + 1] + 1)
        sets += [1 << j for j in range(len(sets), width)]
        rows.append([[(s >> j) & 1 for j in range(width)] for s in sets])
        depths.append(depth)
    return torch.tensor(rows, dtype=torch.bool, device=device).view(len(parents), width, width), depths


def static_mask(valid, slots, start, attend, positions, dtype: torch.dtype, window=None, mixed=False):
    """The mask(s) [B, 1, W, capacity] of W columns at `positions [B, W]` written at `start` (0-d
    long): a fed column sees its row's real columns (valid [B, capacity], at positions `slots
    [B, capacity]`; every slot from `start` on is False there: a hole, or junk past the pointer)
    and the fed columns `attend [B, W, L]` marks (L > W: the L - W columns before `start` only
    where `attend` marks them too), within the sliding `window` if any (`layer_masks`). Pure
    tensor code: it runs inside the compiled step."""
    width, look = attend.shape[1], attend.shape[2] - attend.shape[1]
    rel = torch.arange(valid.shape[1], device=valid.device) - start  # slot - start
    sees = attend.index_select(2, (rel + look if look else rel).clamp(0, width + look - 1))  # [B, W, capacity]
    if look:  # a lookback column is seen only where it is real too
        sees = sees & (valid | (rel >= 0))[:, None]
    # On the L columns `attend` covers it decides; elsewhere `valid` (False from the fed block on).
    ok = torch.where(((rel >= -look) & (rel < width))[None, None], sees, valid[:, None])
    keys = None
    if window is not None:  # the fed columns' positions, then the cache's
        fed = ((rel >= 0) & (rel < width))[None]
        keys = torch.where(fed, positions.index_select(1, rel.clamp(0, width - 1)), slots)
    return layer_masks(ok[:, None], dtype, window, mixed, positions, keys)
