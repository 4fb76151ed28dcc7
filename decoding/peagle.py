"""The P-EAGLE drafter for B rows: one head forward per call drafts up to `num_depths` tokens.

What a call computes (`head` = `draftsmith.heads.eagle.PEagleHead`). Row b's context holds n_b
tokens; the target has fed the first n_b - 1, so the pairs t = (token_{t+1}, f_t) for t = 0..n_b-2
are known (f_t = project of the aux states a verification returned). The pairs the head's cache
lacks (the prompt's at first, then the fed last token's and the accepted drafts') are fed
together with K - 1 placeholders, in ONE causal forward:
    columns  [pairs not yet fed ..., (token_{n_b-1}, f_{n_b-2}) | mask_1 ... mask_{K-1}]
    positions  ...                    n_b - 2                   | n_b - 1 ... n_b + K - 3
    outputs                           -> token n_b              | -> token n_b + d
mask_d's token is the mask token, its feature project(mask_hidden); it sees its row's real pairs
and the placeholders before it. The KV store (`decoding/kv.py`'s
`KVStore`) keeps the real pairs only: the placeholders' columns are cut at once, so a row's
pairs are fed once and nothing is rolled back after a verification.

Lossless at any temperature: greedy takes each depth's argmax; sampling draws depth d from its
own q_d = sampling.probs(logits_d) (the target's temperature, top-k, top-p) with the row's
generator and hands q_d to the verifier as `probs`. Speculative sampling needs each draft drawn
from the q it reports given everything before it, which holds since q_d depends on the context
only, not on the drafts x_1..x_{d-1}. On the static path the store is sized up front, and
`--compile` compiles its step (`OnePassDrafter`: one width, K + 1 pairs + K - 1 masks).
"""

from __future__ import annotations

import torch

from draftsmith.decoding.drafters import OnePassDrafter, Proposal
from draftsmith.decoding.masks import chain_attend


class PEagleDrafter(OnePassDrafter):
    """P-EAGLE drafting (a chain, every depth from one forward) over `head.config.aux_layer_ids`;
    `_pending[b]`: row b's pairs (ids [n], features [n, H]) not yet fed."""

    def __init__(self, head: torch.nn.Module, *, name: str = "peagle"):
        super().__init__(head, name, "P-EAGLE")
        self.num_depths = int(head.config.num_depths)

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return (min(num_tokens, self.num_depths),)

    def start(self, prompts, prefill, vocab_size) -> None:
        self._start_rows(len(prompts), vocab_size)
        device = self._param().device
        if prefill:  # pair t = (prompt[t + 1], f_t) for every prompt token but the last, right-aligned
            features = self._features(prefill)
            for b, prompt in enumerate(prompts):
                n = len(prompt) - 1
                if n:
                    ids = torch.as_tensor(list(prompt[1:]), dtype=torch.long, device=device)
                    self._pending[b].append((ids, features[b, features.shape[1] - n :]))

    def _suffix_for(self, size: int) -> int:
        return max(size - 1, 0)

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        head, device, dtype = self.head, self._param().device, self._param().dtype
        batch, H = len(contexts), head.config.hidden_size
        fresh = [sum(ids.numel() for ids, _ in p) for p in self._pending]
        self._check_in_step(contexts, fresh, "pairs")
        # A row drafts from its newest pair's output, so only a row that feeds one this call drafts.
        counts = [min(k, self.num_depths) if fresh[b] else 0 for b, k in enumerate(num_tokens)]
        if max(counts) == 0:
            return Proposal.empty(batch, device)
        # The placeholders: `prepare`'s K - 1 (extra ones change nothing: each sees only those before it).
        self._suffix = max(self._suffix, max(counts) - 1)
        width = self._context_width(fresh)
        lo, fed = [width - n for n in fresh], width + self._suffix
        ids = torch.full((batch, fed), self.mask_token_id, dtype=torch.long, device=device)
        features = torch.zeros(batch, fed, H, device=device, dtype=dtype)
        features[:, width:] = head.mask_features(batch, self._suffix).to(dtype)
        for b, pieces in enumerate(self._pending):
            if fresh[b]:
                ids[b, lo[b] : width] = torch.cat([i for i, _ in pieces])
                features[b, lo[b] : width] = torch.cat([f for _, f in pieces])
        # Pairs at their positions (padding at 0), then placeholder d one position past the last pair.
        offset = torch.arange(fed, device=device)[None] - torch.tensor(lo, device=device)[:, None]
        positions = (torch.tensor(self._real, device=device)[:, None] + offset).clamp(min=0)
        attend = chain_attend(fed, lo, None, batch, device)  # causal over the real pairs and masks
        keep = (offset >= 0) & (torch.arange(fed, device=device) < width)[None]  # the pairs stay, the placeholders go
        _, logits = self._forward(ids, positions, attend, features, keep)
        self._fed(fresh)

        raw = head.target_logits(logits[:, width - 1 :]).float()  # [B, K, V]: depth d drafts token n_b + d
        return self._one_pass_proposal(raw, counts, sampling, generators)

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The pairs of the verified positions: (the token committed after each fed column, its feature)
        # for the fed last token and the n_b accepted drafts.
        features = self._features(hidden)
        ids = committed.to(features.device)
        for b, n in enumerate(num_accepted):
            self._pending[b].append((ids[b, : n + 1], features[b, : n + 1]))


def peagle_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a P-EAGLE head: one chain drafted in one pass, `name`."""
    return {name: PEagleDrafter(head, name=name)}
