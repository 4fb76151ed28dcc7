"""A thin adapter around an unmodified Hugging Face causal LM.

It owns one KV cache and exposes the four things speculative decoding needs from a model:
feed new tokens and get their logits (and, on request, hidden states of chosen layers), crop
the cache back after a rejection, verify a token tree with a 4-D attention mask and explicit
positions, and compact the cache to the accepted branch of that tree. No modeling file is
forked: everything goes through `model.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [B, n, V] for the fed tokens (or the last `logits_to_keep`)
    hidden_states: dict[int, torch.Tensor]  # layer index (HF numbering) -> [B, n, H]


class CausalLMAdapter:
    """Feeds tokens to `model` against its own cache.

    Hidden-state indices follow HF's `output_hidden_states`: 0 is the embedding output,
    i is the output of layer i (the input of layer i+1), and `num_layers` is the last layer's
    output after the final norm.
    """

    #: `keep` moves the kept entries in place when every cache layer is a plain `DynamicLayer`;
    #: False forces the general fallback (crop, then re-feed the kept tokens), e.g. in tests.
    keep_in_place: bool = True

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.config = model.config
        self.cache: DynamicCache | None = None
        # The last forward's tokens and the cache length before it: `keep`'s fallback re-feeds
        # some of them.
        self._fed_start = 0
        self._fed_ids: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.get_text_config().num_hidden_layers

    @property
    def seq_len(self) -> int:
        """Number of tokens held in the cache."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        # Sliding-window layers drop old states as they go; a crop after a rejection needs
        # them back, so keep them until the next crop (as HF's assisted decoding does).
        self.cache.activate_past_recording()

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
        """Append `input_ids [B, n]` to the cache and return their logits.

        `attention_mask` may be a float additive mask [B, 1, n, cache_len + n] (0 = attend,
        a large negative = blocked) for tree verification; then pass `position_ids [B, n]`
        too. `logits_to_keep=k` computes logits for the last k tokens only (0 = all).
        """
        if self.cache is None:
            self.reset()
        if attention_mask is not None:
            expected = (input_ids.shape[1], self.seq_len + input_ids.shape[1])
            if attention_mask.dim() != 4 or tuple(attention_mask.shape[-2:]) != expected:
                raise ValueError(
                    f"tree attention mask must be [B, 1, {expected[0]}, {expected[1]}], "
                    f"got {list(attention_mask.shape)}"
                )
            if attention_mask.dtype == torch.bool:
                raise ValueError("pass a float additive mask (0 / -inf), not a bool mask")
            self._check_window(input_ids.shape[1])
            attention_mask = attention_mask.to(self.model.dtype)
        self._fed_start, self._fed_ids = self.seq_len, input_ids
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=logits_to_keep,
        )
        hidden = {i: out.hidden_states[i] for i in hidden_layers} if hidden_layers else {}
        return ForwardResult(logits=out.logits, hidden_states=hidden)

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens of the cache (drop rejected drafts)."""
        excess = self.seq_len - length
        if excess < 0 or length < 0:
            raise ValueError(f"cannot crop a cache of {self.seq_len} tokens to {length}")
        if excess:
            self.cache.crop(-excess)  # transformers 5: negative = number of tokens to remove

    @torch.inference_mode()
    def keep(self, base: int, indices: list[int]) -> None:
        """Keep the first `base` cached tokens, then the entries at positions base + i for i in
        `indices` (in that order); drop the rest. After a tree verification fed at position
        `base`, `indices` = the root (0) and the accepted path's rows: the cache then holds what
        sequential decoding of those tokens would have computed, because each tree node's keys
        and values were computed at its sequential position and saw only its ancestors.

        Plain `DynamicLayer`s (full attention) are compacted in place with one index_select
        per layer. Any other layer type (sliding window, quantized, linear attention...) is
        cropped to `base` and the kept tokens are fed again with consecutive positions: one
        extra forward, still exact. That needs the tokens of the last forward, so `indices`
        must point into it.
        """
        indices = [int(i) for i in indices]
        if base < 0 or any(i < 0 or base + i >= self.seq_len for i in indices):
            raise ValueError(f"cannot keep {base} + {indices} of a cache of {self.seq_len} tokens")
        if indices == list(range(len(indices))):  # a prefix: a plain crop
            self.crop(base + len(indices))
            return
        layers = getattr(self.cache, "layers", None)
        if self.keep_in_place and layers and all(type(layer) is DynamicLayer for layer in layers):
            device = layers[0].keys.device
            src = torch.tensor([base + i for i in indices], dtype=torch.long, device=device)
            end = base + len(indices)
            for layer in layers:
                if not layer.is_initialized or layer.keys.numel() == 0:
                    continue  # a KV-sharing consumer holds nothing
                # Gather first (src may overlap the destination), then write and cut.
                keys, values = layer.keys.index_select(-2, src), layer.values.index_select(-2, src)
                layer.keys[..., base:end, :] = keys
                layer.values[..., base:end, :] = values
                layer.keys = layer.keys[..., :end, :]
                layer.values = layer.values[..., :end, :]
            return
        start, fed = self._fed_start, self._fed_ids
        if fed is None or any(not start <= base + i < start + fed.shape[1] for i in indices):
            raise ValueError(
                "keep() re-feeds the kept tokens for this cache type, so they must come from the "
                f"last forward (cache positions {start}..{start + (0 if fed is None else fed.shape[1]) - 1})"
            )
        ids = fed[:, [base + i - start for i in indices]]
        self.crop(base)
        self.forward(ids, logits_to_keep=1)

    def _check_window(self, num_new: int) -> None:
        """A tree mask attends to the whole cache: exact for sliding-window layers only while
        every node stays inside the window (HF also hands those layers only the last
        window - 1 past states once the window is full, which the mask would not match)."""
        for layer in getattr(self.cache, "layers", ()):
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            if window is not None and self.seq_len + num_new > window:
                raise ValueError(
                    f"tree verification past a sliding window is not supported: the cache holds "
                    f"{self.seq_len} tokens, the tree {num_new} nodes, the window is {window}. "
                    "Use a chain drafter (no tree) for this target, or shorter sequences."
                )


def tree_attention_mask(
    parents: list[int], past_len: int, dtype: torch.dtype = torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, n, past_len + n] and depths [n] for a token tree.

    `parents[i]` is the index of node i's parent among the fed nodes, or -1 for a node that
    hangs off the last committed token. Every node sees the whole cache and its ancestors.
    Positions are `past_len + depth`.
    """
    n = len(parents)
    # Ancestor sets as Python bitmasks (a node's row = its parent's | itself), turned into one
    # tensor at the end: a per-node tensor update cost ~20 us a node, the budget of a whole call.
    ancestors, depth = [0] * n, [0] * n
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree nodes must come after their parents; node {i} has {parent}")
        ancestors[i] = (ancestors[parent] if parent >= 0 else 0) | (1 << i)
        depth[i] = depth[parent] + 1 if parent >= 0 else 0
    allowed = torch.tensor([[(row >> j) & 1 for j in range(n)] for row in ancestors], dtype=torch.bool)
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    blocked = torch.finfo(dtype).min
    mask[..., past_len:] = torch.where(allowed, 0.0, blocked).to(dtype=dtype, device=device)
    return mask, torch.tensor(depth, device=device)
