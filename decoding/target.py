"""Small helpers the loop, the caches and the drafters share: a HF causal LM as a cache call,
prompt checks, ragged blocks, device timing."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.decoding.linears import cpu_linears


def synchronize(device: torch.device) -> None:
    """Wait for the device, so that a host timer measures the work (timers call it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(device: torch.device, call):
    """(call(), its device-synchronised seconds)."""
    synchronize(device)
    start = time.perf_counter()
    out = call()
    synchronize(device)
    return out, time.perf_counter() - start


@torch.inference_mode()
def forward_seconds(model, kv, ids, positions, base: int, sizes, *, repeats: int, hidden_layers=()) -> dict[int, float]:
    """{n: seconds of one forward of `model` over ids/positions [rows, base + n] columns
    [base, base + n)}, the median of `repeats` synchronised timings per n, on the KV store `kv`
    (`kv.py`) holding columns [0, base) of every row. Every forward computes all its logits (as a
    verification does) and is cut away again; one untimed warm-up per n, then the sizes
    interleaved within each repeat, so load noise hits every size alike. The linears run as in a
    decode (`linears.cpu_linears`)."""
    rows = ids.shape[0]

    def once(n: int) -> float:
        cols = slice(base, base + n)
        _, seconds = timed(
            model.device, lambda: kv.forward(model, ids[:, cols], positions[:, cols], hidden_layers=hidden_layers)
        )
        kv.commit_spans(n, None, [0] * rows)  # kept by no row: cut again
        return seconds

    samples: dict[int, list[float]] = {n: [] for n in sizes}
    with cpu_linears(model):  # as a decode runs them
        for n in sizes:
            once(n)
        for _ in range(repeats):
            for n in sizes:
                samples[n].append(once(n))
    return {n: statistics.median(v) for n, v in samples.items()}


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
    ids, positions = torch.tensor([ids, positions], dtype=torch.long, device=device).view(2, len(pieces), width)
    return ids, positions, lo


def left_aligned(pieces: list[list[int]], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token lists placed at the left end of a block as wide as the longest, padding after them:
    ids [B, W], positions [B, W] (start_b, start_b + 1, ... on every column, padding included) and
    the end hi_b of each row's real columns [0, hi_b). What a model with recurrent layers is fed
    after its first tokens: a state cannot skip padding before a row's tokens."""
    width = max(len(p) for p in pieces)
    ids = [p + [0] * (width - len(p)) for p in pieces]
    positions = [list(range(s, s + width)) for s in starts]
    ids, positions = torch.tensor([ids, positions], dtype=torch.long, device=device).view(2, len(pieces), width)
    return ids, positions, [len(p) for p in pieces]


def right_align(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Move row b's first counts_b columns of x [B, T, ...] to the right end of a block of width
    max(counts); returns the block and each row's first real column."""
    width = max(counts)
    lo = [width - c for c in counts]
    src = torch.arange(width, device=x.device)[None] - torch.tensor(lo, device=x.device)[:, None]
    src = src.clamp(min=0).view(*src.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x[:, :width].gather(1, src), lo


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [B, n, V] for the fed tokens (or the last `logits_to_keep`)
    hidden_states: dict[int, torch.Tensor]  # layer index (HF numbering: 0 = embeddings) -> [B, n, H]


def layers_config(model):
    """The config that shapes a model's KV cache: a HF model's own, or a draft head's decoder
    layers as a llama config (`config.layer_config()`)."""
    layer_config = getattr(model.config, "layer_config", None)
    return model.config if layer_config is None else layer_config()


def hf_call(model: PreTrainedModel, hidden_layers: tuple[int, ...], last_only: bool):
    """A HF causal LM as a cache call: (ids, positions, mask, cache) -> (logits, the hidden
    states of `hidden_layers`...); `last_only`: the last column's logits only."""

    def call(ids, positions, mask, cache):
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1 if last_only else 0,
        )
        return (out.logits, *(out.hidden_states[i] for i in hidden_layers))

    return call


def forward_result(out: tuple, hidden_layers: tuple[int, ...], last_only: bool) -> ForwardResult:
    logits = out[0][:, -1:] if last_only else out[0]
    return ForwardResult(logits=logits, hidden_states=dict(zip(hidden_layers, out[1:])))
