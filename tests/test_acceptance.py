"""The one simulated tau (distill/acceptance.py): the bonus token counted, the chain stopping at
the first rejection, K capping it, floats and tensors alike."""

import pytest
import torch

from draftsmith.distill.acceptance import simulated_tau


def test_tau_counts_the_bonus_token_and_stops_at_k():
    assert simulated_tau([]) == 1.0  # target-only decoding
    assert simulated_tau([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert simulated_tau([0.8, 0.5, 0.9], k=2) == pytest.approx(2.2)
    assert simulated_tau([1.0] * 4) == 5.0  # K always-right drafts: K + 1 tokens
    assert simulated_tau([0.0, 1.0, 1.0]) == 1.0  # nothing after the first rejection counts


def test_tensors_are_one_chain_per_element():
    hits = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])]
    assert simulated_tau(hits).tolist() == [3.0, 2.0, 1.0]  # heads accepted until the first miss, + 1
    p = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    assert simulated_tau([p, p]).flatten().tolist() == pytest.approx([1.75, 1.3125])


def walk_reference(hits, valid):
    """(tokens, calls) of the decoder's walk over 0/1 hits, row by row in plain Python."""
    tokens = calls = 0
    for row, ok in zip(hits, valid):
        K, starts = len(row[0]), [t for t, v in enumerate(ok) if v]
        t, fitting, every = (starts[0] if starts else len(ok)), [], []
        while t < len(ok):
            if not ok[t]:
                t += 1
                continue
            lead = next((i for i, h in enumerate(row[t]) if not h), K)
            every.append(1 + lead)
            if t + K - 1 < len(ok) and ok[t + K - 1]:
                fitting.append(1 + lead)
            t += 1 + lead
        kept = fitting or every
        tokens, calls = tokens + sum(kept), calls + len(kept)
    return tokens, calls


def expected_walk(alphas, valid):
    """(E tokens, E calls) of one row's random walk, by recursion from each position (backwards)."""
    T, K = len(alphas), len(alphas[0])
    fits = [t + K - 1 < T and valid[t + K - 1] for t in range(T)]
    memo = {}

    def go(t):  # (tokens, calls, tokens of fitting calls, fitting calls) from t on
        if t >= T:
            return (0.0, 0.0, 0.0, 0.0)
        if t not in memo:
            if not valid[t]:
                memo[t] = go(t + 1)
            else:
                reach, tau, out = 1.0, 1.0, [0.0, 1.0, 0.0, float(fits[t])]
                for j in range(K + 1):  # L = 1 + j with probability reach * (1 - alpha_{j+1})
                    stop = 1.0 - alphas[t][j] if j < K else 1.0
                    rest = go(t + 1 + j)
                    out = [o + reach * stop * r for o, r in zip(out, rest)]
                    reach = reach * (alphas[t][j] if j < K else 0.0)
                    tau += reach if j < K else 0.0
                out[0] += tau
                out[2] += tau * fits[t]
                memo[t] = tuple(out)
        return memo[t]

    t0 = next(t for t, v in enumerate(valid) if v)
    e = go(t0)
    return (e[2], e[3]) if e[3] > 0 else (e[0], e[1])


def test_walk_tau_follows_the_decoder_over_hand_built_hits():
    from draftsmith.distill.acceptance import walk_tau

    K, T = 3, 12
    all_hit = torch.ones(T, K)
    none_hit = torch.zeros(T, K)
    mixed = torch.zeros(T, K)
    mixed[2] = torch.tensor([1.0, 1.0, 0.0])  # L = 3: jump from 2 to 5
    mixed[5] = torch.tensor([0.0, 1.0, 1.0])  # L = 1 though depth 2 and 3 would hit
    mixed[6] = torch.tensor([1.0, 1.0, 1.0])  # L = 4 (the bonus token after K hits)
    mixed[3] = torch.tensor([1.0, 1.0, 1.0])  # skipped by the walk: not visited
    valid = torch.zeros(3, T, dtype=torch.bool)
    valid[:, 2:11] = True  # the answer: positions 2..10
    hits = torch.stack([all_hit, none_hit, mixed]) * valid[..., None]
    for i in range(K):  # depth i + 1 at t is valid only where position t + i is
        hits[:, : T - i, i] *= valid[:, i:]
        hits[:, T - i :, i] = 0
    assert walk_tau(hits[:1], valid[:1]) == (8.0, 2.0)  # tau = K + 1: calls at 2, 6 (10 cannot fit K drafts)
    assert walk_tau(hits[1:2], valid[1:2]) == (7.0, 7.0)  # tau = 1: a call at each of 2..8
    assert walk_tau(hits[2:], valid[2:]) == (3 + 1 + 4.0, 3.0)  # calls at 2, 5, 6; the one at 10 does not fit
    assert walk_tau(hits, valid) == walk_reference(hits.bool().tolist(), valid.tolist()) == (23.0, 12.0)
    position_mean = float(simulated_tau(hits.unbind(-1))[2][valid[2] & (torch.arange(T) <= 8)].mean())
    assert position_mean == pytest.approx(15 / 7)  # not the walk's 8 / 3: it counts chains never started


def test_walk_tau_of_random_hits_and_probabilities_matches_plain_python():
    from draftsmith.distill.acceptance import walk_tau

    gen = torch.Generator().manual_seed(0)
    B, T, K = 6, 30, 4
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        valid[b, 3 + b : T - 2 * b] = True
    valid[0, 12] = False  # a gap inside a row is stepped over
    hits = (torch.rand(B, T, K, generator=gen) < 0.7).double()
    for i in range(K):
        shifted = torch.zeros(B, T, dtype=torch.bool)
        shifted[:, : T - i] = valid[:, i:]
        hits[..., i] *= shifted
    assert walk_tau(hits, valid) == walk_reference(hits.bool().tolist(), valid.tolist())
    probs = torch.rand(B, T, K, generator=gen, dtype=torch.float64) * hits.bool()
    tokens, calls = walk_tau(probs, valid)
    expected = [expected_walk(probs[b].tolist(), valid[b].tolist()) for b in range(B)]
    assert tokens == pytest.approx(sum(e[0] for e in expected))
    assert calls == pytest.approx(sum(e[1] for e in expected))
    # A row shorter than K counts all of its calls; one without valid positions counts none.
    short = torch.zeros(2, 6, K, dtype=torch.float64)
    short_valid = torch.zeros(2, 6, dtype=torch.bool)
    short_valid[0, 3:5] = True
    short[0, 3, 0] = 1.0
    assert walk_tau(short, short_valid) == (2.0, 1.0)  # the call at 3 emits 2 tokens; 5 is past the row
