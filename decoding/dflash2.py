"""The DFlash2 drafter for B rows: one backbone forward per call (the block drafter's `_block`), then
the candidate selector's walk from the anchor over the block's drafting slots.

Row b's block [anchor, mask, ...] drafts block_size - 1 tokens: slot k >= 1 the token at anchor + k
(slot 0 is the anchor, as in the backbone). The backbone gives every slot's logits U_k and state h_k at
once; then, for k = 1, 2, ...:
    C_k = the selector_top_k largest of U_k                                  (from the context only)
    s_k(c) = U_k(c) + <A[x_{k-1}] * W h_k, B[c]>   for c in C_k,  x_0 = the anchor
    greedy:   x_k = argmax_{c in C_k} s_k(c)                                 (the walk of z-lab's release)
    sampling: x_k ~ q_k = sampling.probs(s_k on C_k, -inf elsewhere)         (0 outside C_k)
so q_k is the distribution x_k is really drawn from given x_1..x_{k-1} (C_k depends on the context
alone, s_k on the previous draft), and the verifier's min(1, p/q) with the residual at the first
rejection stays exact: speculative sampling only needs each draft drawn from the q it reports,
given the drafts before it. q_k is the target's sampling law (temperature, top-k, top-p) applied to
the scores, restricted to the candidates; a target token outside C_k is never drafted, so the
residual max(0, p - q) gives it back. The selector costs one rank-r product per candidate and draft
on top of the one backbone forward.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.blocks import BlockDrafter
from draftsmith.decoding.drafters import Proposal


class DFlash2Drafter(BlockDrafter):
    """DFlash2 drafting (a chain): `BlockDrafter`'s block forward and the selector's walk."""

    def __init__(self, head: torch.nn.Module, *, name: str = "dflash2"):
        super().__init__(head, name=name, kind="DFlash2")

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        def step(logits, hidden, prev, carried):  # the candidates' edge scores from x_{k-1}, -inf off them
            candidates, scores = self.head.walk_step(logits, hidden, prev)  # [B, K] each
            raw = torch.full(logits.shape, float("-inf"), device=logits.device)  # [B, V]
            return raw.scatter_(-1, candidates, scores.to(raw.dtype)), None

        return self._left_to_right(contexts, num_tokens, sampling, generators, step)


def dflash2_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a DFlash2 head: one selector-walked block chain, `name`."""
    return {name: DFlash2Drafter(head, name=name)}
