"""Expected accepted length from per-position acceptance: of one chain (`simulated_tau`, the tau
the chain tuner eval/tune.py predicts for each K), and along the decoder's walk (`walk_tau`, the
`tau_simulated` every trainer's held-out evaluation reports).

A chain of K drafts is verified left to right and stops at the first rejection; draft i is
accepted with probability alpha_i given that drafts 1..i-1 were. One target call then yields

    tau(K) = 1 + sum_{i=1..K} prod_{j<=i} alpha_j

tokens. The 1 is the bonus token: the target's own token at the first rejection (or after the
K-th draft) comes with every call, so target-only decoding has tau = 1 and K drafts that are
always right give K + 1.

The decoder does not start a chain at every position, though: a call whose context ends at
position t emits L(t) tokens (its accepted drafts and the bonus token), so the next call is at
t + L(t). Its tokens per call are the mean of L over the positions that walk visits, which weights
short chains more: about 1 / mean(1 / L) <= mean(L) over a stretch of text, so a head that knows
some rows and not others gets far less than the mean over all positions. `walk_tau` follows that
walk on teacher-forced chains. With
P(L(t) = 1 + j) = prod_{i<=j} alpha_i(t) * (1 - alpha_{j+1}(t)) (alpha_{K+1} = 0), the walk visits
position s with probability

    v(t_0) = 1 (the first valid position),   v(s) = sum_{t<s} v(t) P(L(t) = s - t)

and the decoder's long-run tokens per call is

    tau_walk = sum_t v(t) tau_t(K) / sum_t v(t)

with tau_t(K) the chain's expected length above. 0/1 hits (greedy) make v 0 or 1: the walk
itself, 1 + the leading hits at each visited position, then a jump past what was emitted.
"""

from __future__ import annotations

import torch


def simulated_tau(alphas, k: int | None = None):
    """tau(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j, counting the bonus token; K = `k`, or every
    position given.

    `alphas`: alpha_1, alpha_2, ... as floats, or as tensors of one shape, one chain per element
    (0/1 hits of teacher-forced drafts, or acceptance probabilities; float64 keeps long sums
    exact). Returns a float, or a tensor of that shape.
    """
    tau = reach = 1.0
    for alpha in list(alphas)[:k]:
        reach = reach * alpha  # P(drafts 1..i are all accepted)
        tau = tau + reach
    return tau


def walk_tau(alphas, valid) -> tuple[float, float]:
    """(tokens, calls) of the decoder's walk along teacher-forced chains, summed over the rows;
    tokens / calls is its tokens per target call, counting the bonus token.

    `alphas [B, T, K]`: depth i + 1 of the chain started at position t is accepted given depths
    1..i were (0/1 hits, or acceptance probabilities); `valid [B, T]`: the positions a chain can
    start at (draft 1 proposes a trained token). Depth i of the call at t drafts what depth 1 of
    the call at t + i - 1 drafts, so the alphas must be 0 where `valid[t + i - 1]` is not. Each
    row's walk starts at its first valid position; invalid positions inside a row are stepped over
    one at a time, uncounted. Like `train.common.decoded_tau`, which leaves out the calls cut
    short by the token budget, only calls whose K drafts all lie on valid positions are counted,
    unless a row has none (a row shorter than K: then all of its calls are).
    """
    a = torch.as_tensor(alphas).detach().double().cpu()
    valid = torch.as_tensor(valid).detach().bool().cpu()
    B, T, K = a.shape
    reach = a.cumprod(-1)  # [B, T, K]: P(drafts 1..i accepted)
    expected = 1.0 + reach.sum(-1)  # tau_t(K), the bonus token counted
    ahead = torch.cat([torch.ones(B, T, 1, dtype=a.dtype), reach], dim=-1)
    p_len = ahead - torch.cat([reach, torch.zeros(B, T, 1, dtype=a.dtype)], dim=-1)  # [B, T, K+1]: P(L = 1 + j)
    fits = torch.zeros(B, T, dtype=torch.bool)
    if T >= K:
        fits[:, : T - K + 1] = valid[:, K - 1 :]
    visit = torch.zeros(B, T + K + 1, dtype=a.dtype)
    first = valid.long().argmax(1)
    visit[valid.any(1), first[valid.any(1)]] = 1.0
    sums = torch.zeros(4, B, dtype=a.dtype)  # tokens, calls; then those of the calls that fit
    for t in range(int(first.min()) if valid.any() else T, T):
        v = visit[:, t]
        here = v * valid[:, t]
        visit[:, t + 1 : t + K + 2] += here[:, None] * p_len[:, t]
        visit[:, t + 1] += v * ~valid[:, t]  # stepped over, not a call
        counted = here * fits[:, t]
        sums += torch.stack([here * expected[:, t], here, counted * expected[:, t], counted])
    use_fits = sums[3] > 0
    tokens = torch.where(use_fits, sums[2], sums[0]).sum()
    calls = torch.where(use_fits, sums[3], sums[1]).sum()
    return float(tokens), float(calls)
