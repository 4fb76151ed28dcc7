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
from draftsmith.decoding.sampling import draw_rows


class DSparkDrafter(DFlashDrafter):
    """DSpark drafting (a chain): `DFlashDrafter`'s block forward and the sequential correction."""

    def __init__(self, head: torch.nn.Module, *, name: str = "dspark"):
        super().__init__(head, name=name, kind="DSpark")

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        logits, hidden = self._block(contexts)  # [B, Bs, Vd], [B, Bs, H]
        counts = [max(0, min(k, self.drafts)) for k in num_tokens]
        prev = torch.tensor([c[-1] for c in contexts], device=logits.device)  # the anchors (target ids)
        tokens, probs, raws, state = [], [], [], None
        for k in range(max(counts, default=0)):
            corrected, state = self.head.corrected(logits[:, k], prev, hidden[:, k], state)
            raw = self.head.target_logits(corrected).float()  # [B, V]
            if sampling.greedy:
                token = raw.argmax(-1)
            else:
                q = sampling.probs(raw)  # [B, V]: exactly what row b's draft k is drawn from
                probs.append(q)
                token = draw_rows(q, generators, [k < c for c in counts])  # rows past their count: argmax
            tokens.append(token)
            if self.logits:
                raws.append(raw)
            prev = token
        if not tokens:
            return Proposal.empty(len(contexts), logits.device)
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            counts=counts,
            probs=torch.stack(probs, dim=1) if probs else None,
            logits=torch.stack(raws, dim=1) if raws else None,
        )


def dspark_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a DSpark head: one corrected block chain, `name`."""
    return {name: DSparkDrafter(head, name=name)}
