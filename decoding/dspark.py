"""The DSpark drafter for B rows: one backbone forward per call (the block drafter's `_block`), then
a left-to-right pass of the head's sequential correction over the block's slots.

Row b's block [anchor, mask, ...] drafts block_size tokens: slot k the token at anchor + k + 1. The
backbone gives every slot's logits U_k and state h_k at once; then, for k = 0, 1, ...:
    logits_k = U_k + bias(x_{k-1}, h_k[, s_{k-1}])      x_{-1} = the anchor, x_{k-1} = the draft before
    x_k ~ q_k = sampling.probs(logits_k)                 greedy: x_k = argmax logits_k
so q_k is the distribution x_k is really drawn from given x_0..x_{k-1}, and the verifier's
min(1, p/q) with the residual at the first rejection stays exact (speculative sampling only
needs each draft drawn from the q it reports, given the drafts before it).

With `admission` (the row NAME-admit of a head with a confidence head), the call then keeps, per
row, the drafts that `decoding/admission.py` admits from the confidence head's survival estimates
and the measured verify cost: a drafted length per call instead of a fixed K, still exact.
"""

from __future__ import annotations

import dataclasses

import torch

from draftsmith.decoding.admission import ConfidenceAdmission
from draftsmith.decoding.blocks import BlockDrafter
from draftsmith.decoding.drafters import Proposal
from draftsmith.decoding.target import timed


class DSparkDrafter(BlockDrafter):
    """DSpark drafting (a chain): `BlockDrafter`'s block forward and the sequential correction;
    with `admission`, the confidence-admitted drafts of each call."""

    def __init__(self, head: torch.nn.Module, *, name: str = "dspark", admission: ConfidenceAdmission | None = None):
        super().__init__(head, name=name, kind="DSpark")
        if admission is not None and head.confidence_head is None:
            raise ValueError(f"{name}: confidence admission needs a DSpark head with a confidence head")
        self.admission = admission

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        size = super().proposal_sizes(num_tokens)[0]
        return tuple(range(size + 1)) if self.admission is not None else (size,)  # admitted: any width

    def prepare(self, batch, capacity, compile, num_tokens, sampling, logits=False) -> float:
        seconds = super().prepare(batch, capacity, compile, num_tokens, sampling, logits)
        if self.admission is not None:
            seconds += self.admission.prepare(batch, max(self.proposal_sizes(num_tokens)))
        return seconds

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        confidences = []

        def step(logits, hidden, prev, state):  # U_k + bias(x_{k-1}, h_k[, s_{k-1}]), over the target's vocabulary
            corrected, state = self.head.corrected(logits, prev, hidden, state)
            if self.admission is not None:  # c_k reads x_{k-1}: known before x_k is drawn
                confidences.append(torch.sigmoid(self.head.confidence(hidden, prev).float()))
            return self.head.target_logits(corrected), state

        if self.admission is None:
            return self._left_to_right(contexts, num_tokens, sampling, generators, step)
        device = self._param().device
        proposal, seconds = timed(device, lambda: self._left_to_right(contexts, num_tokens, sampling, generators, step))
        self.admission.record_draft(seconds)
        if not confidences:
            return proposal
        survival = torch.stack(confidences, dim=1).cumprod(dim=1)  # [B, K]: draft k and all before it accepted
        return dataclasses.replace(proposal, counts=self.admission.counts(survival, proposal.counts))


def dspark_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a DSpark head: one corrected block chain, `name`, and with a
    confidence head NAME-admit, its confidence-admitted drafts (`decoding/admission.py`)."""
    rows = {name: DSparkDrafter(head, name=name)}
    if head.confidence_head is not None:
        admit = f"{name}-admit"
        rows[admit] = DSparkDrafter(head, name=admit, admission=ConfidenceAdmission(target))
    return rows
