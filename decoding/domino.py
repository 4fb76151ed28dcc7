"""The Domino drafter for B rows: one backbone forward per call (the block drafter's `_block`), then
a left-to-right pass of the head's GRU correction over the block's drafting slots.

Row b's block [anchor, mask, ...] drafts block_size - 1 tokens: slot k >= 1 the token at anchor + k
(slot 0 is the anchor, as in the backbone). The backbone gives every slot's logits U_k and state h_k at
once; then, for k = 1, 2, ...:
    s_k = GRU(E[x_{k-1}], s_{k-1})                      x_0 = the anchor, s_0 = 0; E the target's embeddings
    logits_k = U_k + W2 SiLU(W1 [h_k; s_k])
    x_k ~ q_k = sampling.probs(logits_k)                greedy: x_k = argmax logits_k
so q_k is the distribution x_k is really drawn from given x_1..x_{k-1}, and the verifier's
min(1, p/q) with the residual at the first rejection stays exact (speculative sampling only
needs each draft drawn from the q it reports, given the drafts before it). The GRU is stepped
once per draft: its state after x_{k-1} is all slot k needs, so the pass costs one GRU cell and
one small MLP per draft on top of the one backbone forward.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.blocks import BlockDrafter
from draftsmith.decoding.drafters import Proposal


class DominoDrafter(BlockDrafter):
    """Domino drafting (a chain): `BlockDrafter`'s block forward and the GRU-corrected pass."""

    def __init__(self, head: torch.nn.Module, *, name: str = "domino"):
        super().__init__(head, name=name, kind="Domino")

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        def step(logits, hidden, prev, state):  # U_k + W2 SiLU(W1 [h_k; s_k]), the GRU stepped on x_{k-1}
            corrected, state = self.head.corrected(logits, prev, hidden, state)  # [B, Vd], [B, G]
            return self.head.target_logits(corrected), state

        return self._left_to_right(contexts, num_tokens, sampling, generators, step)


def domino_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a Domino head: one GRU-corrected block chain, `name`."""
    return {name: DominoDrafter(head, name=name)}
