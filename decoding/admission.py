"""Confidence admission: how many of a call's drafts the target verifies, from the drafter's own
estimate of each draft's survival (a confidence head's) and the measured cost of verifying.

A call has drafted up to K tokens for each of B rows; row b's draft k (k = 1..K) carries a
survival estimate s_bk = c_b1 * ... * c_bk, the chance that it and every draft before it are
accepted (c_bj: the confidence head's probability for draft j, given the drafts before it). Verifying
w drafts per row emits, in expectation, E(w) = sum_b (1 + sum_{k <= min(w, K_b)} s_bk) tokens
(each row's bonus or correction, then its accepted drafts), at the cost of one drafting call and one
target forward over B rows of w + 1 tokens. The admission takes the levels w = 1, 2, ... in turn and
stops at the first that does not raise E(w) / (d + v_B(w + 1)), the estimated tokens per second.

Why levels and not (row, position) pairs one at a time: the decoder verifies its B rows as one
padded forward, so every row pays for the widest; a level costs the same whoever fills it, and a
draft in a narrower row is verified for free. (Admitting pairs one by one in confidence order pays
on engines that verify a ragged token budget; here it would stop at the first pair that widens the
batch, before the pairs that come free with it.)

Lossless: the decision to verify draft k of a row depends on the survivals of the drafts up to k
(each known before draft k is drawn: c_bk reads the draft before it) and on the other rows, never on
draft k or the drafts after it. So the count is a stopping rule of the row's draft sequence, and
speculative sampling with the reported q stays exact; the drafts past the count are dropped unseen.
Stopping at the first level that does not pay keeps this true: taking the best level of a full
scan would let a later draft's confidence decide whether an earlier draft is verified.

Costs: v_B(n) is measured once per batch size B and width before the clock starts
(`ConfidenceAdmission.prepare`): device-synchronised target forwards of B rows of n tokens after a
cached context, the median of a few; d, the drafting call, is the running mean of the drafter's own
synchronised calls.
"""

from __future__ import annotations

import time

import torch

from draftsmith.decoding.kv import model_cache
from draftsmith.decoding.target import forward_seconds

CONTEXT_TOKENS = 128  # cached tokens per row before the timed forwards: a decode's typical depth
REPEATS = 5  # timed forwards per width: their median


def admitted_counts(survival: torch.Tensor, caps: list[int], verify_seconds, draft_seconds: float) -> list[int]:
    """The drafts to verify per row: survival [B, K] (row b's first caps[b] entries real), the
    verify cost `verify_seconds(w)` of one target forward of every row at w tokens, the drafting
    call's `draft_seconds`; the module docstring's rule."""
    survival = survival.float().cpu()
    expected = float(len(caps))
    best = expected / (draft_seconds + verify_seconds(1))
    width = 0
    for k in range(max(caps, default=0)):
        gain = sum(float(survival[b, k]) for b, cap in enumerate(caps) if cap > k)
        rate = (expected + gain) / (draft_seconds + verify_seconds(k + 2))
        if rate <= best:
            break
        expected, best, width = expected + gain, rate, k + 1
    return [min(cap, width) for cap in caps]


class ConfidenceAdmission:
    """The admission of one drafter row over one target: the verify costs per batch size and
    width (measured in `prepare`), the drafting call's mean seconds (`record_draft`)."""

    def __init__(self, target, *, context_tokens: int = CONTEXT_TOKENS, repeats: int = REPEATS):
        self.target = target
        self.context_tokens, self.repeats = context_tokens, repeats
        self._verify: dict[int, dict[int, float]] = {}  # batch -> {tokens per row: seconds}
        self._batch = 1
        self._draft_total, self._draft_calls = 0.0, 0

    def prepare(self, batch: int, max_drafts: int) -> float:
        """Measure v_batch(n), n = 1..max_drafts + 1, unless known; the seconds it took."""
        self._batch = batch
        known = self._verify.setdefault(batch, {})
        widths = [n for n in range(1, max_drafts + 2) if n not in known]
        if not widths:
            return 0.0
        start = time.perf_counter()
        known.update(self._measure(batch, widths))
        return time.perf_counter() - start

    def _measure(self, batch: int, widths: list[int]) -> dict[int, float]:
        device, vocab = self.target.device, self.target.get_output_embeddings().weight.shape[0]
        base = self.context_tokens
        ids = (torch.arange(base + max(widths), device=device) * 7919 % vocab)[None].repeat(batch, 1)
        positions = torch.arange(ids.shape[1], device=device)[None].repeat(batch, 1)
        kv = model_cache(self.target, "admission", batch, None)
        with torch.inference_mode():
            kv.forward(self.target, ids[:, :base], positions[:, :base], logits_to_keep=1)
        kv.commit_spans(base)
        return forward_seconds(self.target, kv, ids, positions, base, widths, repeats=self.repeats)

    def record_draft(self, seconds: float) -> None:
        self._draft_total += seconds
        self._draft_calls += 1

    def verify_seconds(self, width: int) -> float:
        known = self._verify.get(self._batch)
        if not known or width not in known:
            raise RuntimeError(f"admission: no verify cost at batch {self._batch}, width {width} (prepare first)")
        return known[width]

    def counts(self, survival: torch.Tensor, caps: list[int]) -> list[int]:
        draft = self._draft_total / self._draft_calls if self._draft_calls else 0.0
        return admitted_counts(survival, caps, self.verify_seconds, draft)
