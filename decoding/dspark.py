"""The DSpark drafter for B rows: one backbone forward per call (the DFlash drafter's `_block`), then
a left-to-right pass of the head's sequential correction over the block's slots.

Row b's block [anchor, mask, ...] drafts block_size tokens: slot k the token at anchor + k + 1. The
backbone gives every slot's logits U_k and state h_k at once; then, for k = 0, 1, ...:
    logits_k = U_k + bias(x_{k-1}, h_k[, s_{k-1}])      x_{-1} = the anchor, x_{k-1} = the draft before
    x_k ~ q_k = sampling.probs(logits_k)                 greedy: x_k = argmax logits_k
so q_k is the distribution x_k is really drawn from given x_0..x_{k-1}, and the verifier's
min(1, p/q) with the residual at the first rejection stays exact (speculative sampling only
needs each draft drawn from the q it reports, given the drafts before it).
"""

from __future__ import annotations

import torch

from draftsmith.decoding.dflash import DFlashDrafter
from draftsmith.decoding.drafters import Proposal


class DSparkDrafter(DFlashDrafter):
    """DSpark drafting (a chain): `DFlashDrafter`'s block forward and the sequential correction."""

    def __init__(self, head: torch.nn.Module, *, name: str = "dspark"):
        super().__init__(head, name=name, kind="DSpark")

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        def step(logits, hidden, prev, state):  # U_k + bias(x_{k-1}, h_k[, s_{k-1}]), over the target's vocabulary
            corrected, state = self.head.corrected(logits, prev, hidden, state)
            return self.head.target_logits(corrected), state

        return self._left_to_right(contexts, num_tokens, sampling, generators, step)


def dspark_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a DSpark head: one corrected block chain, `name`."""
    return {name: DSparkDrafter(head, name=name)}
