"""The sampling maths of speculative decoding (`eval/sampling.py`), on plain tensors.

Losslessness is the product: whatever the draft proposes, the emitted tokens must be
distributed exactly as the target's final sampling distribution p. The chain tests give every
row the same per-position distributions p_1..p_{K+1} and q_1..q_K (context-independent), draw
the draft tokens x_i ~ q_i independently per row, and run `verify_chain` once over 10^5 rows.
Then, for each position j, the j-th emitted token of the rows that got that far must follow
p_j: a chi-square goodness-of-fit per position (`assert_lossless`). The seeds are fixed, so
every test is deterministic; a correct rule must clear p > 1e-3, and the negative controls
(always accept; q taken from the raw logits; no residual) must fall below 1e-6 in the very
same check, which shows that the check has the power to catch those bugs.

Also here: the greedy rule, `SamplingConfig` against HF's logits warpers, the closed forms
(acceptance = 1 - TV, KL equals `F.kl_div`) and the empirical acceptance rate.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftsmith.decoding.sampling import (
    SamplingConfig,
    acceptance_probability,
    draw,
    kl_divergence,
    total_variation,
    verify_chain,
    verify_chain_greedy,
)
from draftsmith.eval.stats import chi_square_gof

ROWS = 100_000  # draws per test: a TV error of ~0.01 already gives p << 1e-6
PASS = 1e-3  # a correct sampler must clear this p-value
FAIL = 1e-6  # a negative control must fall below it
MIN_ROWS = 200  # positions reached by fewer rows are too thin for a chi-square
GAMMAS = (1, 3, 7)
WARPED = [  # (how both models sample, gamma): each warper setting on one chain length
    (SamplingConfig(temperature=0.7, top_k=5), 1),
    (SamplingConfig(temperature=1.3, top_p=0.8), 7),
    (SamplingConfig(temperature=1.0, top_k=3, top_p=0.9), 3),
]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_dists(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """n random, peaked distributions over `vocab` tokens (top token ~0.3-0.6)."""
    return torch.softmax(2.0 * torch.randn(n, vocab, generator=g), dim=-1)


def target_and_draft_logits(k: int, vocab: int, g: torch.Generator):
    """Target logits [K+1, V] and draft logits [K, V], a noisy copy of the target's.

    Independent draws would accept ~25% of drafts, and positions past 3 would see few rows;
    the noisy copy accepts ~60%, so every position of a gamma=7 chain gets tested, while p and q
    stay different enough that each branch (accept, residual, bonus) runs often.
    """
    target = 2.0 * torch.randn(k + 1, vocab, generator=g)
    return target, target[:k] + 1.5 * torch.randn(k, vocab, generator=g)


def draw_drafts(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x_i ~ q_i independently in each of ROWS rows: [ROWS, K].

    Same law as `draw(q.expand(ROWS, K, V))`, but one multinomial per position is ~30x faster.
    """
    return torch.multinomial(q, ROWS, replacement=True, generator=g).T.contiguous()


def run_chain(sampler, p, q, g, *, drafts=None, verify_q="same"):
    """Run `sampler` over ROWS rows that share p [K+1, V] and q [K, V] (q None: deterministic).

    `drafts` defaults to x_i ~ q_i; `verify_q` is the q the sampler is told (default: q).
    Returns (draft_tokens, num_accepted, next_token).
    """
    if drafts is None:
        drafts = draw_drafts(q, g)
    told = q if verify_q == "same" else verify_q
    told = None if told is None else told.expand(ROWS, *told.shape)
    num_accepted, next_token = sampler(p.expand(ROWS, *p.shape), drafts, told, g)
    return drafts, num_accepted, next_token


def emitted_tokens(drafts, num_accepted, next_token):
    """tokens [ROWS, K+1] and reached [ROWS, K+1]: token j of each row (0-based column j-1),
    and whether the row emitted at least j tokens (n >= j-1). Row b emits drafts[b, :n] and
    then next_token."""
    position = torch.arange(drafts.shape[1] + 1)
    n = num_accepted[:, None]
    tokens = torch.where(position < n, F.pad(drafts, (0, 1)), next_token[:, None])
    return tokens, position <= n


def position_p_values(p, drafts, num_accepted, next_token) -> dict[int, float]:
    """Chi-square p-value of emitted token j against p_j, for each position j with enough rows."""
    tokens, reached = emitted_tokens(drafts, num_accepted, next_token)
    k1, vocab = p.shape
    # One bincount for all positions: bin j*V + token, unreached cells in a spare last block.
    bins = torch.where(reached, torch.arange(k1) * vocab + tokens, k1 * vocab)
    counts = torch.bincount(bins.flatten(), minlength=(k1 + 1) * vocab)
    counts = counts[: k1 * vocab].view(k1, vocab)
    return {
        j: chi_square_gof(counts[j - 1], p[j - 1]).p_value for j in range(1, k1 + 1) if counts[j - 1].sum() >= MIN_ROWS
    }


def assert_lossless(p, drafts, num_accepted, next_token):
    p_values = position_p_values(p, drafts, num_accepted, next_token)
    assert 1 in p_values, "position 1 must always be tested"
    bad = {j: pv for j, pv in p_values.items() if not pv > PASS}
    assert not bad, f"emitted tokens do not follow p at positions {bad} (p-values)"


def assert_not_lossless(p, drafts, num_accepted, next_token):
    p_values = position_p_values(p, drafts, num_accepted, next_token)
    assert min(p_values.values()) < FAIL, f"a broken rule passed the check: {p_values}"


# --- Negative controls: each breaks the rule in one known way --------------------------------


def always_accept(p, drafts, q, g):
    """Emits every draft and a bonus from p_{K+1}: the output follows q, not p."""
    batch, k = drafts.shape
    return torch.full((batch,), k), draw(p[:, k], g)


def no_residual(p, drafts, q, g):
    """The right accept rule, but on rejection samples from p_i instead of norm(max(0, p_i - q_i)):
    the output is min(p, q) + (1 - alpha) p, biased toward the draft."""
    batch, k = drafts.shape
    p_x = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = torch.rand(batch, k, generator=g) * q_x < p_x
    num_accepted = accept.long().cumprod(-1).sum(-1)
    return num_accepted, draw(p[torch.arange(batch), num_accepted], g)


# --- Speculative sampling: chi-square over 10^5 rows -----------------------------------------


def random_pair(gamma: int):
    """Random p [gamma+1, 16] and q [gamma, 16] (the same for a given gamma), and a generator."""
    g = generator(gamma)
    target_logits, draft_logits = target_and_draft_logits(gamma, 16, g)
    return target_logits.softmax(-1), draft_logits.softmax(-1), g


@functools.cache
def random_pair_run(gamma: int):
    """verify_chain on `random_pair(gamma)`, shared by the tests that only read it."""
    p, q, g = random_pair(gamma)
    return p, q, run_chain(verify_chain, p, q, g)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_random_pairs_are_lossless(gamma):
    p, _, run = random_pair_run(gamma)
    assert_lossless(p, *run)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_deterministic_proposals_are_lossless(gamma):
    """q=None (prompt lookup, argmax drafts): accept with p(x), else sample p without x.
    Half the rows propose a fixed token (the draft's argmax), half a token drawn from the
    draft: either way q=None must be right, since it conditions on the proposal."""
    g = generator(10 + gamma)
    target_logits, draft_logits = target_and_draft_logits(gamma, 24, g)
    p, draft = target_logits.softmax(-1), draft_logits.softmax(-1)
    drafts = draw_drafts(draft, g)
    drafts[: ROWS // 2] = draft.argmax(-1)
    assert_lossless(p, *run_chain(verify_chain, p, None, g, drafts=drafts))


def _edge_case(name: str, k: int, vocab: int, g: torch.Generator):
    """(p [K+1, V], q [K, V] or None, drafts [ROWS, K] or None = x_i ~ q_i) for the named case."""
    drafts = None
    target_logits, draft_logits = target_and_draft_logits(k, vocab, g)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    if name == "p_equals_q":
        q = p[:k].clone()
    elif name == "identical_deterministic":  # the proposal is the only token p allows
        p = F.one_hot(torch.randint(vocab, (k + 1,), generator=g), vocab).float()
        q, drafts = None, p[:k].argmax(-1).expand(ROWS, k)
    elif name == "disjoint":  # p on the first half of the vocabulary, q on the second
        half = torch.arange(vocab) < vocab // 2
        p, q = p * half, q * ~half
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    elif name == "one_hot_p":  # greedy target, sampled draft
        p = F.one_hot(target_logits.argmax(-1), vocab).float()
    elif name == "one_hot_q":  # greedy draft, sampled target
        q = F.one_hot(draft_logits.argmax(-1), vocab).float()
    elif name == "zero_prob_tokens":  # q loves the tokens p forbids
        banned = torch.rand(k + 1, vocab, generator=g) < 0.4
        banned[:, 0] = False
        p = p.masked_fill(banned, 0.0)
        p = p / p.sum(-1, keepdim=True)
        q = torch.softmax(3.0 * banned[:k].float(), dim=-1)
    return p, q, drafts


EDGE_CASES = ["p_equals_q", "identical_deterministic", "disjoint", "one_hot_p", "one_hot_q", "zero_prob_tokens"]


@pytest.mark.parametrize("name", EDGE_CASES)
def test_edge_cases_are_lossless(name):
    k, vocab = 3, 12
    g = generator(EDGE_CASES.index(name))
    p, q, drafts = _edge_case(name, k, vocab, g)
    drafts, num_accepted, next_token = run_chain(verify_chain, p, q, g, drafts=drafts)
    assert_lossless(p, drafts, num_accepted, next_token)

    # Exact facts, beyond the statistics.
    if name in ("p_equals_q", "identical_deterministic"):
        assert (num_accepted == k).all()  # accept with probability min(1, p/q) = 1
    if name == "disjoint":
        assert (num_accepted == 0).all()  # p(x) = 0 for every proposal
    tokens, reached = emitted_tokens(drafts, num_accepted, next_token)
    p_of_emitted = p[torch.arange(k + 1), tokens]  # [ROWS, K+1]
    assert (p_of_emitted[reached] > 0).all(), "a token of probability 0 was emitted"
    if name == "one_hot_p":
        assert (p_of_emitted[reached] == 1).all()


def warped_pair(cfg: SamplingConfig, gamma: int):
    """Target and draft logits (a noisy copy) over 16 tokens, warped by `cfg`:
    (p [gamma+1, 16], q [gamma, 16], raw draft logits, generator)."""
    g = generator(20 + gamma)
    target_logits, draft_logits = target_and_draft_logits(gamma, 16, g)
    return cfg.probs(target_logits), cfg.probs(draft_logits), draft_logits, g


def warped_id(case) -> str:
    return case.describe().replace(" ", "_") if isinstance(case, SamplingConfig) else f"gamma{case}"


@pytest.mark.parametrize("cfg,gamma", WARPED, ids=warped_id)
def test_warped_distributions_are_lossless(cfg, gamma):
    """p and q after temperature/top-k/top-p; a token outside p's support gives p-value 0."""
    p, q, _, g = warped_pair(cfg, gamma)
    assert_lossless(p, *run_chain(verify_chain, p, q, g))


@pytest.mark.parametrize("control", [always_accept, no_residual], ids=lambda f: f.__name__)
def test_negative_controls_fail(control):
    """The same inputs and the same check as test_random_pairs_are_lossless, a broken rule."""
    p, q, g = random_pair(3)
    assert_not_lossless(p, *run_chain(control, p, q, g))


@pytest.mark.parametrize("cfg,gamma", WARPED, ids=warped_id)
def test_q_from_raw_logits_fails(cfg, gamma):
    """Drafts drawn from the warped q but verified against softmax(raw draft logits): q(x) looks
    smaller than it was, acceptance is inflated and the output drifts toward the draft
    (transformers issue #47932). Same inputs and check as test_warped_distributions_are_lossless."""
    p, q, draft_logits, g = warped_pair(cfg, gamma)
    raw_q = torch.softmax(draft_logits, dim=-1)
    assert_not_lossless(p, *run_chain(verify_chain, p, q, g, verify_q=raw_q))


def test_tokens_within_a_chain_are_independent():
    """Jointly, not only per position. Among rows that accepted x_1 (n >= 1), the first token
    follows min(p_1, q_1) / alpha_1 (accepted drafts are biased toward the draft: that is not a
    bug, the rows that rejected emit the residual instead) and the second token must follow p_2
    whatever the first was: (token 1, token 2) ~ (min(p_1, q_1) / alpha_1) x p_2."""
    k, vocab = 3, 8
    g = generator(30)
    target_logits, draft_logits = target_and_draft_logits(k, vocab, g)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    drafts, num_accepted, next_token = run_chain(verify_chain, p, q, g)
    tokens, _ = emitted_tokens(drafts, num_accepted, next_token)
    first, second = tokens[num_accepted >= 1, :2].T
    accepted_first = torch.minimum(p[0], q[0]) / acceptance_probability(p[0], q[0])
    expected = (accepted_first[:, None] * p[1][None, :]).flatten()
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    assert chi_square_gof(counts, expected).p_value > PASS


def test_two_rounds_give_p1_times_p2():
    """Decoding goes on after a rejection: rows that stopped after one token start a second
    round at position 2. The first two tokens of the decode must then follow p_1 x p_2."""
    k, vocab = 3, 8
    g = generator(31)
    target_logits, draft_logits = target_and_draft_logits(k + 1, vocab, g)  # one spare position
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    drafts, num_accepted, next_token = run_chain(verify_chain, p[: k + 1], q[:k], g)
    tokens, _ = emitted_tokens(drafts, num_accepted, next_token)
    # Second round from position 2, for every row; only rows with n == 0 will use it.
    tokens_next_round, _ = emitted_tokens(*run_chain(verify_chain, p[1:], q[1:], g))
    first = tokens[:, 0]
    second = torch.where(num_accepted >= 1, tokens[:, 1], tokens_next_round[:, 0])
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    assert chi_square_gof(counts, (p[0][:, None] * p[1][None, :]).flatten()).p_value > PASS


@pytest.mark.parametrize("gamma", GAMMAS)
def test_empirical_acceptance_matches_alpha(gamma):
    """P(accept x_i | reached i) = alpha_i = sum_x min(p_i, q_i), within 4 standard errors."""
    p, q, (_, num_accepted, _) = random_pair_run(gamma)
    alpha = acceptance_probability(p[:gamma], q)
    for i in range(1, gamma + 1):
        reached = num_accepted >= i - 1
        tries = int(reached.sum())
        if tries < MIN_ROWS:
            break
        rate = (num_accepted[reached] >= i).double().mean().item()
        a = alpha[i - 1].item()
        tolerance = 4 * (a * (1 - a) / tries) ** 0.5
        assert abs(rate - a) < tolerance, f"position {i}: empirical {rate:.4f} vs alpha {a:.4f}"


# --- Greedy ----------------------------------------------------------------------------------


def test_verify_chain_greedy_exact():
    target_argmax = torch.tensor(
        [
            [5, 6, 7, 8],  # all K=3 matched: n=3, bonus 8
            [5, 6, 7, 8],  # none matched: n=0, next = target's 5
            [5, 6, 7, 8],  # mismatch at position 2: n=1, next = 6
            [5, 6, 7, 8],  # a later match after a mismatch does not count: n=0
        ]
    )
    drafts = torch.tensor([[5, 6, 7], [1, 6, 7], [5, 1, 7], [1, 6, 7]])
    rows = [verify_chain_greedy(t, d) for t, d in zip(target_argmax.tolist(), drafts.tolist())]
    assert rows == [(3, 8), (0, 5), (1, 6), (0, 5)]


def test_greedy_is_the_zero_temperature_limit_of_verify_chain():
    """One-hot p (SamplingConfig() is greedy) with deterministic drafts: verify_chain is exact
    and agrees with verify_chain_greedy row by row."""
    g = generator(50)
    batch, k, vocab = 64, 5, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    target_argmax = logits.argmax(-1)
    # Drafts that match the target for a random-length prefix, then disagree at random.
    matches = torch.rand(batch, k, generator=g) < 0.8
    other = torch.randint(vocab, (batch, k), generator=g)
    drafts = torch.where(matches, target_argmax[:, :k], other)
    p = SamplingConfig().probs(logits)
    assert torch.equal(p, F.one_hot(target_argmax, vocab).float())
    expected = [verify_chain_greedy(t, d) for t, d in zip(target_argmax.tolist(), drafts.tolist())]
    num_accepted, next_token = verify_chain(p, drafts, None, g)
    assert list(zip(num_accepted.tolist(), next_token.tolist())) == expected
    assert {0, k} <= set(num_accepted.tolist())  # both ends were exercised


# --- SamplingConfig --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 5, 1.0),
        (1.3, 0, 0.8),
        (1.0, 3, 0.9),
        (0.5, 10, 0.5),
        (2.0, 50, 0.95),  # top_k >= V: off
        (1.0, 0, 0.01),  # top_p below the top token's mass: keeps exactly one token
    ],
)
def test_warp_matches_hf_logits_warpers(temperature, top_k, top_p):
    logits = 3.0 * torch.randn(8, 40, generator=generator(60))
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    hf = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p)(None, hf)
    ours = cfg.warp(logits)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf)), "different kept tokens"
    torch.testing.assert_close(cfg.probs(logits), torch.softmax(hf, dim=-1))


def test_greedy_probs_is_one_hot_argmax():
    logits = torch.randn(4, 7, 11, generator=generator(61))
    cfg = SamplingConfig(temperature=0.0)
    assert cfg.greedy
    assert torch.equal(cfg.probs(logits), F.one_hot(logits.argmax(-1), 11).float())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**kwargs)


# --- Closed forms ----------------------------------------------------------------------------


def test_acceptance_is_one_minus_total_variation():
    g = generator(70)
    p, q = random_dists(32, 20, g), random_dists(32, 20, g)
    torch.testing.assert_close(acceptance_probability(p, q), 1.0 - total_variation(p, q))


def test_kl_matches_torch_kl_div():
    g = generator(71)
    p, q = random_dists(32, 20, g), random_dists(32, 20, g)
    expected = F.kl_div(q.log(), p, reduction="none").sum(-1)
    torch.testing.assert_close(kl_divergence(p, q), expected)


def test_identical_distributions():
    p = random_dists(8, 20, generator(72))
    torch.testing.assert_close(kl_divergence(p, p), torch.zeros(8))
    torch.testing.assert_close(total_variation(p, p), torch.zeros(8))
    torch.testing.assert_close(acceptance_probability(p, p), torch.ones(8))
