"""A thin adapter around an unmodified Hugging Face causal LM.

It owns one KV cache and exposes the three things speculative decoding needs from a model:
feed new tokens and get their logits (and, on request, hidden states of chosen layers), crop
the cache back after a rejection, and verify a token tree with a 4-D attention mask and
explicit positions. No modeling file is forked: everything goes through `model.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


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

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.config = model.config
        self.cache: DynamicCache | None = None

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
            attention_mask = attention_mask.to(self.model.dtype)
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


def tree_attention_mask(
    parents: list[int], past_len: int, dtype: torch.dtype = torch.float32, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask [1, 1, n, past_len + n] and depths [n] for a token tree.

    `parents[i]` is the index of node i's parent among the fed nodes, or -1 for a node that
    hangs off the last committed token. Every node sees the whole cache and its ancestors.
    Positions are `past_len + depth`.
    """
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree nodes must come after their parents; node {i} has {parent}")
        allowed[i, i] = True
        if parent >= 0:
            allowed[i] |= allowed[parent]
            depth[i] = depth[parent] + 1
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    blocked = torch.finfo(dtype).min
    mask[..., past_len:] = torch.where(allowed, 0.0, blocked).to(dtype=dtype, device=device)
    return mask, torch.tensor(depth, device=device)
