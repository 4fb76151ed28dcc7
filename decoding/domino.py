"""The Domino drafter for B rows: one backbone forward per call (the DFlash drafter's `_block`), then
a left-to-right pass of the head's GRU correction over the block's drafting slots.

Row b's block [anchor, mask, ...] drafts block_size - 1 tokens: slot k >= 1 the token at anchor + k
(slot 0 is the anchor, as in DFlash). The backbone gives every slot's logits U_k and state h_k at
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

from draftsmith.decoding.dflash import DFlashDrafter
from draftsmith.decoding.drafters import Proposal
from draftsmith.decoding.sampling import draw_rows


class DominoDrafter(DFlashDrafter):
    """Domino drafting (a chain): `DFlashDrafter`'s block forward and the GRU-corrected pass."""

    def __init__(self, head: torch.nn.Module, *, name: str = "domino"):
        super().__init__(head, name=name, kind="Domino")

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        logits, hidden = self._block(contexts)  # [B, Bs, Vd], [B, Bs, H]; slot 0 is the anchor's
        counts = [max(0, min(k, self.drafts)) for k in num_tokens]
        prev = torch.tensor([c[-1] for c in contexts], device=logits.device)  # [B] the anchors (target ids)
        tokens, probs, raws, state = [], [], [], None
        for k in range(max(counts, default=0)):
            slot = self._first + k  # draft k is slot k + 1: the token at anchor + k + 1
            corrected, state = self.head.corrected(logits[:, slot], prev, hidden[:, slot], state)  # [B, Vd], [B, G]
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
            prev = token  # the GRU reads the draft just made
        if not tokens:
            return Proposal.empty(len(contexts), logits.device)
        return Proposal(
            tokens=torch.stack(tokens, dim=1),  # [B, K]
            counts=counts,
            probs=torch.stack(probs, dim=1) if probs else None,  # [B, K, V]
            logits=torch.stack(raws, dim=1) if raws else None,
        )


def domino_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a Domino head: one GRU-corrected block chain, `name`."""
    return {name: DominoDrafter(head, name=name)}
