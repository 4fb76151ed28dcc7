"""Draft-OPD's replay: the calls a head's own decoding made (decoding/recorder.py), trained again with
the target as teacher. The maths, the weights and what is left out: docs/onpolicy.md.

    replay = get_method(kind).part("replay")  # the method's `Replay`, beside its trainer
    batch = replay_batch(episodes, width=K, offset=replay.offset, pad_id=0, device=device)
    loss, parts = replay_losses(replay, head, target, batch, method_recipe, weights)

A call at anchor n (the row's first n tokens committed) drafted x_1..x_m (m <= K), of which the verifier kept
the first a; the target's distribution p_j for draft j is its prediction at position n + j - 2 of the
rollout row (prompt + emitted tokens: the lossless decoder's output, so a sample of the target). Per
replayed call, from ONE forward of the head:
- the method's own loss (its trainer's, unchanged) over the blocks anchored where the decoder called
  (a block drafter: a block at p = n - 1) or, for a drafter trained unrolled, its unroll over every
  position of the rollout rows (the calls' chains at t = n - 2 among them);
- a Bernoulli forward KL on each accepted draft (j <= a): KL(Bern(p_j(x_j)) || Bern(q_j(x_j)));
- a k3 estimate of KL(q_j || p_j) on each rejected draft (a < j <= m): r - 1 - log r, r = p_j(x_j) /
  q_j(x_j), weighted decay^(j - a - 1) (1 for the draft the verifier rejected).
q_j is the head's drafting law for draft j, teacher-forced on the rollout row as its trainer is
(`Replay.law`); up to the first rejection the row's tokens are the drafts themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.decoding.recorder import DraftCall
from draftsmith.train.teacher import on_draft_vocab, target_forward

LOG_FLOOR = -1e4  # log(1 - p) of a token the target is sure of (p = 1): its (1 - p) factor is 0 anyway
K3_LOG_RATIO = (-100.0, 20.0)  # log r clamped only where exp(log r) would overflow fp32 (or log p is -inf)


# ---------------------------------------------------------------------------- the Draft-OPD terms
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) of x <= 0, stable at both ends (Maechler 2012), floored at LOG_FLOOR."""
    x = x.clamp(max=0.0)
    near = torch.log(-torch.expm1(x))  # accurate for x > -log 2
    far = torch.log1p(-torch.exp(x))  # accurate below
    return torch.where(x > -math.log(2), near, far).clamp(min=LOG_FLOOR)


def bernoulli_forward_kl(target_logp: torch.Tensor, draft_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[...]: KL(Bern(p) || Bern(q)) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)) of each drafted token:
    p = exp(target_logp [...]) the target's probability of it, q the draft's (softmax of draft_logits
    [..., Vd] at `tokens` [...], draft ids). log(1 - q) is the log-sum of the other tokens' probabilities:
    exact, and its gradient stays where q rounds to 1. 0 iff q(x) = p(x); p is a constant (the teacher)."""
    logq_all = torch.log_softmax(draft_logits.float(), -1)  # [..., Vd]
    logq = logq_all.gather(-1, tokens[..., None])[..., 0]
    log1mq = logq_all.scatter(-1, tokens[..., None], float("-inf")).logsumexp(-1).clamp(min=LOG_FLOOR)
    logp = target_logp.float().detach()
    p = logp.exp()
    return p * (logp - logq) + (1 - p) * (log1mexp(logp) - log1mq)


def k3(target_logp: torch.Tensor, draft_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[...]: r - 1 - log r with r = p(x) / q(x) (Schulman's k3): from x ~ q an unbiased, non-negative
    estimate of KL(q || p), 0 iff q(x) = p(x). Its gradient in log q is (1 - r): a draft the target
    gives less than the draft does (r < 1, a likely rejection) is pushed down. Shapes as
    `bernoulli_forward_kl`'s."""
    logq = torch.log_softmax(draft_logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    log_ratio = (target_logp.float().detach() - logq).clamp(*K3_LOG_RATIO)
    return log_ratio.exp() - 1 - log_ratio


def rejected_weights(accepted: torch.Tensor, counts: torch.Tensor, width: int, decay: float) -> torch.Tensor:
    """[N, width]: decay^(offset - 1) of draft j (0-based) of a call with `accepted` [N] of its `counts`
    [N] drafts kept, for the rejected ones (accepted <= j < counts; offset = j - accepted + 1, so the
    draft the verifier rejected weighs 1, and decay = 0 keeps it alone); 0 for accepted drafts and
    padding."""
    j = torch.arange(width, device=accepted.device)[None]  # [1, width]
    offset = j - accepted[:, None] + 1  # [N, width]
    rejected = (offset >= 1) & (j < counts[:, None])
    power = torch.pow(torch.tensor(float(decay), device=accepted.device), (offset - 1).clamp(min=0).float())
    return torch.where(rejected, power, torch.zeros_like(power))


@dataclass(frozen=True)
class OPDWeights:
    replay: float = 1.0  # the method's own loss at the recorded calls
    accepted: float = 1.0  # Bernoulli forward KL on accepted drafts
    rejected: float = 1.0  # k3 on rejected drafts
    decay: float = 0.5  # rejected draft weights decay^(offset - 1)


def draft_opd_terms(target_logp, draft_logits, tokens, accepted_mask, rejected_weight) -> tuple[torch.Tensor, ...]:
    """(the Bernoulli forward KL's mean over accepted drafts, k3's weighted mean over rejected ones):
    target_logp, tokens (draft ids), accepted_mask, rejected_weight [...]; draft_logits [..., Vd].
    Weighted means, so a term's scale does not follow how many drafts a batch has."""
    # selected, not multiplied by the masks: a padded slot's value never reaches the sums (0 * inf is nan)
    bern = torch.where(accepted_mask, bernoulli_forward_kl(target_logp, draft_logits, tokens), 0.0)
    rejected = torch.where(rejected_weight > 0, k3(target_logp, draft_logits, tokens) * rejected_weight, 0.0)
    return bern.sum() / accepted_mask.sum().clamp(min=1), rejected.sum() / rejected_weight.sum().clamp(min=1e-6)


# ---------------------------------------------------------------------------- the rollouts as a batch
@dataclass(frozen=True)
class Episode:
    """One rollout row: its prompt, what the decoder emitted after it, and its calls."""

    prompt: list[int]
    tokens: list[int]
    calls: list[DraftCall]


def replay_batch(episodes: list[Episode], *, width: int, offset: int, pad_id: int, device) -> dict:
    """The episodes as one right-padded batch: input_ids, attention_mask [B, T], loss_mask [B, T] (the
    emitted tokens), and the calls that drafted (A per row at most, padded): call_at [B, A] (the anchor
    n), call_valid [B, A], drafts [B, A, width] (target ids, 0-padded), counts and accepted [B, A]. A
    call whose replay position n - `offset` falls before the row is left out (a drafter that reads a
    pair before the anchor drafts nothing there either)."""
    rows = [e.prompt + e.tokens for e in episodes]
    B, T = len(rows), max(map(len, rows))
    called = [[c for c in e.calls if c.drafts and c.anchor - offset >= 0] for e in episodes]
    A = max(1, max(map(len, called)))
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    call_at, counts, accepted = (torch.zeros(B, A, dtype=torch.long) for _ in range(3))
    drafts = torch.zeros(B, A, width, dtype=torch.long)
    for b, (row, episode, calls) in enumerate(zip(rows, episodes, called)):
        ids[b, : len(row)], attention[b, : len(row)] = torch.tensor(row), 1
        loss_mask[b, len(episode.prompt) : len(row)] = True
        for a, call in enumerate(calls):
            n = min(len(call.drafts), width)
            call_at[b, a], counts[b, a], accepted[b, a] = call.anchor, n, min(call.accepted, n)
            drafts[b, a, :n] = torch.tensor(call.drafts[:n])
    valid = torch.arange(A)[None] < torch.tensor([len(c) for c in called])[:, None]
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "call_at": call_at}
    batch |= {"call_valid": valid, "drafts": drafts, "counts": counts, "accepted": accepted}
    return {k: v.to(device) for k, v in batch.items()}


# ---------------------------------------------------------------------------- each method's replay
@dataclass(frozen=True)
class Replay:
    """How one method's head is replayed: its registry entry's `replay`, defined beside its trainer."""

    losses: Callable  # its trainer's loss function
    law: Callable  # (head, batch, kept, anchors, drafts [B, A, K]) -> draft logits [B, A, S >= K, Vd]
    offset: int  # where a call at anchor n is replayed: n - offset (a block's anchor slot, or a pair's)
    save: str  # "module:function" writing the head in its method's own layout
    shape_keys: tuple[str, ...]  # its trainer recipe's keys that the head's config fixes (e.g. block_size)
    unrolled_loss: Callable | None = None  # (kept, rows, feats, teacher, recipe, in_vocab, width) -> its loss
    # unrolled over every position of the rows (a training-time test); None: its blocks at the anchors


def block_replay(losses: Callable, law: Callable, save: str) -> Replay:
    """A block drafter's Replay: each call replayed at its block's anchor, p = n - 1; the head fixes block_size."""
    return Replay(losses, law, offset=1, save=save, shape_keys=("block_size",))


class _Kept:
    """The head as its method's loss function sees it, keeping what the Draft-OPD terms read from the
    same forward (one head pass, not two): a block drafter's block states (`hidden`), an unrolled
    drafter's (out, logits) of each unrolled step (its calls). Everything else is the head's own."""

    def __init__(self, head):
        self.head, self.kept = head, []

    def __getattr__(self, name):
        return getattr(self.head, name)

    def hidden(self, *args, **kwargs):
        h = self.head.hidden(*args, **kwargs)
        self.kept.append(h)
        return h

    def __call__(self, *args, **kwargs):
        out = self.head(*args, **kwargs)
        self.kept.append(out)
        return out


def block_states(head, kept, anchors) -> torch.Tensor:
    """[B, A, Bs, H]: the final-norm states of the one packed block forward the loss made."""
    if len(kept) != 1:
        raise RuntimeError(f"expected one block forward in the method's loss, saw {len(kept)}")
    return kept[0].view(*anchors.shape, head.config.block_size, -1)


def block_tokens(batch, anchors, block_size: int) -> torch.Tensor:
    """[B, A, Bs]: the row's tokens at p..p+Bs-1 of each block anchored at p (the anchor, then what the
    decoder committed: the drafts up to the first rejection), clamped at the batch's last column."""
    ids = batch["input_ids"]
    at = (anchors[..., None] + torch.arange(block_size, device=ids.device)).clamp(max=ids.shape[1] - 1)
    return ids.gather(1, at.flatten(1)).view_as(at)


def draft_id_table(head) -> torch.Tensor:
    """[V] long: the draft id of each target id, -1 outside a reduced draft vocabulary."""
    V, Vd, device = head.config.vocab_size, head.config.draft_vocab_size, head.lm_head.weight.device
    table = torch.full((V,), -1, dtype=torch.long, device=device)
    draft = torch.arange(Vd, device=device)
    table[head.draft_to_target(draft)] = draft
    return table


def _method_loss(replay: Replay, kept, batch, feats, teacher, in_vocab, anchors, valid, recipe, width: int):
    """The method's own loss on the rollout rows, through `kept` (its forward is the one the terms read)."""
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")} | {"step": None}  # no warm-up phase
    if replay.unrolled_loss is not None:
        return replay.unrolled_loss(kept, rows, feats, teacher, recipe, in_vocab, width)
    return replay.losses(kept, rows, feats, teacher, anchors, valid, recipe, in_vocab)[0]


def replay_losses(replay: Replay, head, target, batch: dict, recipe, weights: OPDWeights) -> tuple[torch.Tensor, dict]:
    """(the loss, its parts as floats and counts) of one replay batch (`replay_batch`): the target's
    forward over the rollout rows, then the head's, then the method's loss and the Draft-OPD terms."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    (B, T), K = ids.shape, batch["drafts"].shape[-1]
    out = target_forward(target, ids, attention)
    with torch.no_grad():
        feats = torch.cat([out.hidden_states[i] for i in head.config.aux_layer_ids], dim=-1).float()
        table = draft_id_table(head)  # [V]
        reduced = head.config.draft_vocab_size < head.config.vocab_size
        vocab = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=ids.device)) if reduced else None
        teacher, in_vocab = on_draft_vocab(out.logits, vocab, table >= 0)
        lse = torch.stack([row.float().logsumexp(-1) for row in out.logits])  # [B, T], one row in fp32 at a time
    anchors = (batch["call_at"] - replay.offset).clamp(min=0)  # [B, A]
    valid = batch["call_valid"]
    kept = _Kept(head)
    method = _method_loss(replay, kept, batch, feats, teacher, in_vocab, anchors, valid, recipe, K)
    drafts, counts, accepted = batch["drafts"], batch["counts"], batch["accepted"]  # [B, A, K], [B, A], [B, A]
    logits = replay.law(head, batch, kept.kept, anchors, drafts)[:, :, :K]  # [B, A, K, Vd]
    j = torch.arange(K, device=ids.device)
    where = batch["call_at"][..., None] - 1 + j  # [B, A, K]: its logits there predict draft j (0-based), token n + j
    inside = valid[..., None] & (j < counts[..., None]) & (where < attention.sum(1)[:, None, None])
    where = where.clamp(max=T - 1)
    rows = torch.arange(B, device=ids.device)[:, None, None]
    with torch.no_grad():
        target_logp = out.logits[rows, where, drafts].float() - lse[rows, where]  # [B, A, K]
    draft = table[drafts]  # [B, A, K] draft ids: a drafted token is always in the draft vocabulary
    inside = inside & (draft >= 0)
    accepted_mask = inside & (j < accepted[..., None])
    rejected = rejected_weights(accepted.flatten(), counts.flatten(), K, weights.decay).view_as(drafts) * inside
    bern, k3_term = draft_opd_terms(target_logp, logits, draft.clamp(min=0), accepted_mask, rejected)
    loss = weights.replay * method + weights.accepted * bern + weights.rejected * k3_term
    parts = {
        "method_loss": float(method.detach()),
        "accepted_kl": float(bern.detach()),
        "rejected_k3": float(k3_term.detach()),
        "accepted_drafts": int(accepted_mask.sum()),
        "rejected_drafts": int((rejected > 0).sum()),
    }
    return loss, parts
