"""The block drafter for B rows: one head forward per call proposes up to block_size - 1 tokens
(block_size for a head that drafts from its anchor's slot too); a corrected head's drafter subclasses
it and drafts left to right (`_left_to_right`).

What a call computes (`head` a `draftsmith.heads.blocks.BlockHead`). Row b's context holds n_b
tokens; the target has fed the first n_b - 1 (its cache holds every token but the last), so
their features c_0..c_{n_b-2} (`head.project` of the aux states the verifications returned) are
known, and the last token is the anchor at position n_b - 1:
    block_b = [anchor, mask, ..., mask] at positions n_b - 1, ..., n_b + B - 2
    head(block_b | c_0..c_{n_b-2}) -> logits of slot k = the token at position n_b - 1 + k
All B - 1 drafts come from one forward: slot k's q_k depends on the context only, never on the
drafts before it.

The head's KV store (`decoding/kv.py`'s `KVStore`) holds, per draft
layer, the keys/values of each row's context features and nothing else: a call feeds the
features that arrived since the last one (the verified positions: the fed last token and the
accepted drafts; rejected drafts never had features) together with the block, keeps the
context columns, and the block's columns are cut at once. A row's features are fed once.

Lossless at any temperature: greedy takes each slot's argmax; sampling draws slot k from its
own q_k = sampling.probs(logits_k) (the target's temperature, top-k, top-p) with the row's
generator and hands q_k to the verifier as `probs`: speculative sampling only needs each draft
drawn from the q it reports, given everything before it, which holds since x_k ~ q_k whatever
x_1..x_{k-1} are. On the static path the store is sized up front, and `--compile` compiles its
step (`OnePassDrafter`: one width, K + 1 new columns + the block).
"""

from __future__ import annotations

import torch

from draftsmith.decoding.drafters import OnePassDrafter, Proposal
from draftsmith.decoding.sampling import draw_rows


class BlockDrafter(OnePassDrafter):
    """Block drafting (a chain) over the target's hidden states `head.config.aux_layer_ids`;
    `_pending[b]`: row b's features [n, H] not yet fed."""

    def __init__(self, head: torch.nn.Module, *, name: str, kind: str):
        super().__init__(head, name, kind)
        self.block_size = int(head.config.block_size)
        self.drafts = int(head.config.drafts_per_block)  # block_size - 1; a head drafting from its anchor: block_size
        self._first = self.block_size - self.drafts  # the first drafting slot
        self._suffix = self.block_size

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return (min(num_tokens, self.drafts),)

    def start(self, prompts, prefill, vocab_size) -> None:
        self._start_rows(len(prompts), vocab_size)
        if prefill:  # every prompt token but the last, right-aligned
            features = self._features(prefill)
            for b, prompt in enumerate(prompts):
                n = len(prompt) - 1
                if n:
                    self._pending[b].append(features[b, features.shape[1] - n :])

    def _suffix_for(self, size: int) -> int:
        return self.block_size

    def _step(self, ids, positions, mask, cache, features):
        """The head's forward as a cache call (`kv.py`): the fed columns are [context | block], the
        context's columns carrying their features, the block's (the last block_size) their ids;
        the block's queries only, so its logits [B, block_size, draft_vocab] and final-norm states
        [B, block_size, H]."""
        block = self.block_size
        hidden = self.head.hidden(
            ids[:, -block:], features[:, :-block], positions=positions, attention_mask=mask[:, :, -block:], cache=cache
        )
        return self.head.lm_head(hidden), hidden

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        logits, _ = self._block(contexts)
        raw = self.head.target_logits(logits[:, self._first :]).float()  # [B, drafts, V]: slot k drafts anchor + k
        counts = [max(0, min(k, self.drafts)) for k in num_tokens]
        return self._one_pass_proposal(raw, counts, sampling, generators)

    def _left_to_right(self, contexts, num_tokens, sampling, generators, step) -> Proposal:
        """One block forward, then the drafts left to right, each from the block's slot logits
        corrected by what was drafted before it: `step(slot logits [B, Vd], slot state [B, H], the
        previous token [B] (the anchor first), carried) -> (logits over the target's vocabulary
        [B, V], carried)`. Draft k is drawn from q_k = the warped softmax of those logits (greedy:
        their argmax), which is exactly its law given the drafts before it: speculative sampling
        with q_k stays exact (every corrected block drafter)."""
        logits, hidden = self._block(contexts)  # [B, Bs, Vd], [B, Bs, H]
        counts = [max(0, min(k, self.drafts)) for k in num_tokens]
        prev = torch.tensor([c[-1] for c in contexts], device=logits.device)  # [B] the anchors (target ids)
        tokens, probs, raws, carried = [], [], [], None
        for k in range(max(counts, default=0)):
            slot = self._first + k  # the slot that drafts the token at anchor + k + 1
            raw, carried = step(logits[:, slot], hidden[:, slot], prev, carried)
            raw = raw.float()  # [B, V]
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
            tokens=torch.stack(tokens, dim=1),  # [B, K]
            counts=counts,
            probs=torch.stack(probs, dim=1) if probs else None,  # [B, K, V]
            logits=torch.stack(raws, dim=1) if raws else None,
        )

    def _block(self, contexts) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over every row's new context columns and its block [anchor, mask, ...]:
        (logits [B, block_size, draft_vocab], final-norm states [B, block_size, H])."""
        head, device, dtype = self.head, self._param().device, self._param().dtype
        batch, Bs, H = len(contexts), self.block_size, head.config.hidden_size
        pending = [torch.cat(p) if p else torch.zeros(0, H, device=device, dtype=dtype) for p in self._pending]
        fresh = [p.shape[0] for p in pending]
        self._check_in_step(contexts, fresh, "features")
        # The new context columns, right-aligned (row b's real ones are [lo_b, W)), then the block.
        width = self._context_width(fresh)
        lo = [width - n for n in fresh]
        features = torch.zeros(batch, width + Bs, H, device=device, dtype=dtype)
        for b, p in enumerate(pending):
            if fresh[b]:
                features[b, lo[b] : width] = p
        offset = torch.arange(width, device=device)[None] - torch.tensor(lo, device=device)[:, None]
        real = offset >= 0  # [B, W]
        ctx_pos = torch.where(real, torch.tensor(self._real, device=device)[:, None] + offset, 0)
        anchor = torch.tensor([len(c) - 1 for c in contexts], device=device)
        positions = torch.cat([ctx_pos, anchor[:, None] + torch.arange(Bs, device=device)[None]], dim=1)
        ids = torch.full((batch, width + Bs), self.mask_token_id, dtype=torch.long, device=device)
        ids[:, width] = torch.tensor([c[-1] for c in contexts], device=device)
        # Every slot sees its row's cached context, its new context columns and the whole block
        # (a context column sees itself: its output is never read).
        attend = torch.eye(width + Bs, dtype=torch.bool, device=device).repeat(batch, 1, 1)
        attend[:, width:, :width] = real[:, None, :]
        attend[:, width:, width:] = True
        keep = torch.cat([real, torch.zeros(batch, Bs, dtype=torch.bool, device=device)], dim=1)
        logits, hidden = self._forward(ids, positions, attend, features, keep)
        self._fed(fresh)
        return logits, hidden

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The features of the verified positions: the fed last token and the n_b accepted drafts.
        features = self._features(hidden)
        for b, n in enumerate(num_accepted):
            self._pending[b].append(features[b, : n + 1])
