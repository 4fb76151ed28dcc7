"""The speculative decoder end to end, against references that share no code with it.

- greedy: token-identical to Hugging Face `model.generate(do_sample=False)`;
- sampling: the joint law of the first two new tokens equals the target's exact
  p(t1) * p(t2 | t1), computed from plain forwards (chi-square goodness of fit), with a
  negative control showing that the test rejects the draft's own law;
- measured per-position acceptance agrees with sum_x min(p, q) on the reached positions;
- stats bookkeeping, eos, max_new_tokens and input validation.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from fixtures import FAMILIES, VOCAB, tiny_tokenizer, windowed_model

from draftsmith.decoding import DecodeStats, generate, generate_batch
from draftsmith.decoding.drafters import DraftModelDrafter, PromptLookupDrafter, Proposal
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.eval.stats import chi_square_gof

N_NEW = 24  # new tokens per greedy comparison: several target calls at every K

SNIPPETS = [
    "def",
    "import os\n",
    "def f(x):\n    return x + x\n",
    "for i in range(10):\n    for j in range(10):\n        print(i, j)\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n        self.y = 2\n",
    "    if not isinstance(obj, type):\n        raise TypeError(",
    "return self.__class__.__name__",
    "@functools.wraps(func)\ndef wrapper(*args, **kwargs):\n    return func(*args, **kwargs)\n",
    "x = [a for a in b if a]\ny = [a for a in b if a]\n",
    '"""Return the signature of the callable."""',
]
RANDOM_LENGTHS = [1, 1, 2, 3, 4, 6, 9, 14, 25, 40]


def _prompts() -> list[torch.Tensor]:
    tok = tiny_tokenizer()
    prompts = [torch.tensor(tok(s).input_ids) for s in SNIPPETS]
    gen = torch.Generator().manual_seed(1234)
    prompts += [torch.randint(3, VOCAB, (n,), generator=gen) for n in RANDOM_LENGTHS]
    return prompts


PROMPTS = _prompts()


@torch.no_grad()
def _hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    ids = prompt.unsqueeze(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1] :].tolist()


# ----------------------------------------------------------------------------------- greedy


def test_prompts_cover_short_and_repetitive_inputs():
    lengths = [p.numel() for p in PROMPTS]
    assert len(PROMPTS) >= 20
    assert min(lengths) == 1 and sum(n == 1 for n in lengths) >= 2
    assert max(lengths) >= 40


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family, pairs):
    target, draft = pairs(family)
    ks = (1, 3, 5)
    failures, accepted = [], {"draft": 0, "lookup": 0}
    for i, prompt in enumerate(PROMPTS):
        reference = _hf_greedy(target, prompt, N_NEW)
        assert len(reference) == N_NEW  # the fixtures configure no eos
        runs = [
            ("target-only", None, 1, prompt),
            ("draft", DraftModelDrafter(draft), ks[i % 3], prompt),
            ("lookup", PromptLookupDrafter(), ks[(i + 1) % 3], prompt.unsqueeze(0)),  # [1, T]
        ]
        for name, drafter, k, ids in runs:
            out = generate(target, drafter, ids, max_new_tokens=N_NEW, num_draft_tokens=k)
            if out.tokens != reference:
                failures.append(f"prompt {i} (len {prompt.numel()}), {name}, K={k}")
            if name in accepted:
                accepted[name] += sum(out.stats.accepted)
    assert not failures, "differs from HF greedy: " + "; ".join(failures)
    # The comparison only means something if drafts were actually accepted.
    assert accepted["draft"] > 0 and accepted["lookup"] > 0, accepted


def test_a_sliding_window_matches_hf_generate():
    """HF's own sliding-window cache as the reference (window 6, shorter than the sequences)."""
    target = windowed_model("mistral", window=6)
    for prompt in (PROMPTS[4], PROMPTS[-1]):
        reference = _hf_greedy(target, prompt, N_NEW)
        for drafter in (None, PromptLookupDrafter(), DraftModelDrafter(copy.deepcopy(target))):
            assert generate(target, drafter, prompt, max_new_tokens=N_NEW, num_draft_tokens=3).tokens == reference


# -------------------------------------------------------------------- eos, max_new_tokens


def _drafters(family, pairs):
    target, draft = pairs(family)
    return [
        ("target-only", lambda: None),
        ("draft", lambda: DraftModelDrafter(draft)),
        ("self-draft", lambda: DraftModelDrafter(copy.deepcopy(target))),
        ("lookup", lambda: PromptLookupDrafter()),
    ]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_greedy_stops_right_after_eos(family, pairs):
    target, _ = pairs(family)
    prompt = PROMPTS[3]
    reference = _hf_greedy(target, prompt, N_NEW)
    # An eos token that first occurs in the middle of the output (inside a verified chunk
    # for most K), and one that is the very first token.
    middle = next(t for j, t in enumerate(reference) if j >= 5 and t not in reference[:j])
    cut = reference.index(middle)
    absent = next(t for t in range(3, VOCAB) if t not in reference)
    for name, make in _drafters(family, pairs):
        for k in (1, 3, 5):
            for eos, expected in (
                (middle, reference[: cut + 1]),
                ([absent, middle], reference[: cut + 1]),  # a list of eos ids
                (reference[0], reference[:1]),
                (absent, reference),
            ):
                out = generate(target, make(), prompt, max_new_tokens=N_NEW, num_draft_tokens=k, eos_token_id=eos)
                assert out.tokens == expected, (name, k, eos)
                assert out.stats.new_tokens == len(expected)
                assert sum(a + 1 for a in out.stats.accepted) >= len(expected)


def test_sampling_with_eos_is_the_prefix_of_the_run_without(pairs):
    """Same seed, same draws: the eos run must be the no-eos run cut right after its first eos."""
    target, draft = pairs("llama")
    prompt = PROMPTS[2]
    hits = 0

    def run(seed, k, **eos):
        drafter = DraftModelDrafter(draft)
        return generate(
            target, drafter, prompt, max_new_tokens=N_NEW, num_draft_tokens=k, temperature=1.0, seed=seed, **eos
        ).tokens

    for seed in range(12):
        for k in (2, 4):
            free = run(seed, k)
            eos = free[len(free) // 2]  # a token the run does produce
            cut = free.index(eos)
            out = run(seed, k, eos_token_id=eos)
            assert out == free[: cut + 1], (seed, k)
            hits += cut + 1 < len(free)
    assert hits > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_max_new_tokens_is_exact(temperature, pairs):
    prompt = PROMPTS[8]  # repetitive: prompt lookup proposes
    for name, make in _drafters("llama", pairs):
        target = pairs("llama")[0]
        for k in (1, 3, 5):
            for n in (1, 2, 3, 4, 5, 6, 7, 11):
                out = generate(
                    target, make(), prompt, max_new_tokens=n, num_draft_tokens=k, temperature=temperature, seed=n
                )
                stats = out.stats
                assert len(out.tokens) == n == stats.new_tokens, (name, k, n)
                assert sum(a + 1 for a in stats.accepted) == n  # no eos: nothing cut
                assert all(0 <= a <= p <= k for a, p in zip(stats.accepted, stats.proposed))


# ------------------------------------------------------------------------ stats bookkeeping


def _check_position_counters(stats: DecodeStats) -> None:
    """reached/accepted_at are what the per-call (proposed, accepted) lists imply."""
    k = stats.num_draft_tokens
    calls = list(zip(stats.proposed, stats.accepted))
    reached = [sum(i < min(a + 1, p) for p, a in calls) for i in range(k)]
    accepted_at = [sum(i < a for a in stats.accepted) for i in range(k)]
    assert stats.reached == reached
    assert stats.accepted_at == accepted_at
    assert all(a <= r for a, r in zip(stats.accepted_at, stats.reached))


def test_target_only_stats(pairs):
    target, _ = pairs("llama")
    out = generate(target, None, PROMPTS[4], max_new_tokens=N_NEW, num_draft_tokens=4)
    stats = out.stats
    assert stats.tau == 1.0  # tau counts the bonus token: plain decoding scores exactly 1
    assert stats.target_calls == stats.new_tokens == N_NEW
    assert stats.proposed == [0] * N_NEW and stats.accepted == [0] * N_NEW
    assert stats.num_draft_tokens == 0 and stats.alpha_per_position == []
    assert stats.acceptance_rate == 0.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_stats_are_consistent(temperature, pairs):
    target, draft = pairs("llama")
    total = DecodeStats()
    for i, drafter in enumerate([DraftModelDrafter(draft), PromptLookupDrafter()] * 3):
        out = generate(
            target,
            drafter,
            PROMPTS[i + 2],
            max_new_tokens=N_NEW,
            num_draft_tokens=4,
            temperature=temperature,
            seed=i,
            measure_distances=True,
        )
        stats = out.stats
        _check_position_counters(stats)
        assert stats.distance_count == stats.reached  # theory is accumulated where alpha is
        assert sum(a + 1 for a in stats.accepted) == stats.new_tokens == N_NEW
        assert stats.tau == N_NEW / stats.target_calls
        assert stats.target_calls < N_NEW or sum(stats.accepted) == 0
        if isinstance(drafter, DraftModelDrafter):
            assert stats.kl_count == stats.reached
            assert all(kl is None or kl > 0 for kl in stats.kl_per_position)
        else:  # deterministic proposals carry no distribution: no KL
            assert stats.kl_count == [0] * 4
        total = total + stats
    _check_position_counters(total)
    assert total.new_tokens == 6 * N_NEW


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_self_draft_accepts_everything(temperature, pairs):
    target, _ = pairs("qwen2")
    k = 4
    drafter = DraftModelDrafter(copy.deepcopy(target))
    out = generate(
        target,
        drafter,
        PROMPTS[5],
        max_new_tokens=N_NEW,
        num_draft_tokens=k,
        temperature=temperature,
        seed=0,
        measure_distances=True,
    )
    stats = out.stats
    _check_position_counters(stats)
    # KL of identical models: only float noise between a one-token and a (k+1)-token forward.
    kl = stats.kl_per_position
    assert all(x is not None and abs(x) < 1e-5 for x in kl), kl
    assert all(tv < 1e-4 for tv in stats.tv_per_position)
    assert all(e > 1 - 1e-4 for e in stats.expected_alpha_per_position)
    if temperature == 0.0:
        assert stats.alpha == 1.0
        assert stats.accepted == stats.proposed
        # K+1 tokens per call; only the last call may be shorter (capped by max_new_tokens).
        assert all(a + 1 == k + 1 for a in stats.accepted[:-1])
        assert stats.target_calls == math.ceil(N_NEW / (k + 1))
        assert out.tokens == _hf_greedy(target, PROMPTS[5], N_NEW)
    else:
        # p == q up to float noise: a rejection needs u > p/q ~ 1 - 1e-6.
        assert stats.alpha == 1.0, stats.alpha_per_position


# --------------------------------------------------------- measured acceptance vs theory


def _pooled(drafter_factory, target, temperature, runs, k=4, max_new_tokens=32) -> DecodeStats:
    total = DecodeStats()
    for r in range(runs):
        prompt = PROMPTS[r % len(PROMPTS)]
        out = generate(
            target,
            drafter_factory(),
            prompt,
            max_new_tokens=max_new_tokens,
            num_draft_tokens=k,
            temperature=temperature,
            seed=r,
            measure_distances=True,
        )
        total = total + out.stats
    return total


def _assert_alpha_matches_theory(stats: DecodeStats, min_reached: int = 30) -> int:
    """alpha_i (measured) vs mean_j sum_x min(p_j, q_j) (exact, per reached position j).

    Given the trajectory, the acceptance at each reached position is an independent
    Bernoulli(e_j) draw, so accepted_at_i - sum_j e_j has mean 0 and variance
    sum_j e_j (1 - e_j) <= reached_i * a (1 - a) with a the mean of e_j: the binomial standard
    error bounds it. Tolerance: 4 binomial standard errors + 0.01 slack (float noise and the
    small-count regime). Returns the number of positions tested.
    """
    tested = 0
    for i, (alpha, expected, reached) in enumerate(
        zip(stats.alpha_per_position, stats.expected_alpha_per_position, stats.reached)
    ):
        if reached < min_reached:
            continue
        se = math.sqrt(max(expected * (1 - expected), 1e-12) / reached)
        tol = 4 * se + 0.01
        assert abs(alpha - expected) <= tol, (
            f"position {i + 1}: measured alpha {alpha:.3f} vs theory {expected:.3f} "
            f"(reached {reached}, tolerance {tol:.3f})"
        )
        tested += 1
    return tested


class _Seen(DraftModelDrafter):
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        self.seen.append(proposal.logits is not None)
        return proposal


def test_raw_logits_are_stacked_only_for_the_distance_report(pairs):
    target, draft = pairs("llama")
    for measure in (False, True):
        drafter = _Seen(draft)
        drafter.seen = []
        out = generate(target, drafter, PROMPTS[4], max_new_tokens=8, num_draft_tokens=3, measure_distances=measure)
        assert drafter.seen and set(drafter.seen) == {measure}
        assert (sum(out.stats.kl_count) > 0) == measure


def test_measured_acceptance_matches_theory_sampling(pairs):
    target, draft = pairs("llama")
    stats = _pooled(lambda: DraftModelDrafter(draft), target, temperature=1.0, runs=30)
    assert stats.reached[0] >= 200
    assert _assert_alpha_matches_theory(stats) >= 2
    # The fixture pair is meant to exercise every branch: neither ~0 nor ~1.
    assert 0.1 < stats.alpha < 0.9


def test_measured_acceptance_matches_theory_prompt_lookup(pairs):
    target, _ = pairs("llama")
    stats = _pooled(PromptLookupDrafter, target, temperature=1.0, runs=30)
    assert stats.reached[0] >= 200
    assert _assert_alpha_matches_theory(stats) >= 1


def _latest_ngram_follow(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by brute force: the tokens after the latest earlier occurrence of the
    context's last n-gram, n from max_ngram down."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        ends = [e for e in range(n, len(context)) if context[e - n : e] == context[-n:]]
        if ends:
            return context[ends[-1] : ends[-1] + k]
    return []


def test_prompt_lookup_tables_follow_the_latest_match():
    """The incremental n-gram tables propose what a search of the whole context finds, as rows
    grow, skip calls (K = 0), leave the batch, and as a new request reuses the drafter."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        ints = lambda hi, n=1: torch.randint(0, hi, (n,), generator=rng).tolist()  # noqa: E731
        drafter = PromptLookupDrafter(max_ngram=1 + trial % 4, min_ngram=1 + trial % 4 // 2)
        rows = [ints(4, 1 + ints(6)[0]) for _ in range(3)]
        drafter.start(rows, {}, 4)
        for step in range(25):
            ks = ints(5, len(rows))
            got = drafter.propose(rows, ks, None, None)
            for b, (row, k) in enumerate(zip(rows, ks)):
                want = _latest_ngram_follow(row, k, drafter.max_ngram, drafter.min_ngram) if k else []
                assert got.tokens[b, : got.counts[b]].tolist() == want, (trial, step, row, k)
            for row in rows:
                row.extend(ints(4, 1 + ints(3)[0]))
            if step == 12 and len(rows) > 1:
                drafter.select(None, [0, 2][: len(rows) - 1])
                rows = [rows[i] for i in [0, 2][: len(rows) - 1]]
        rows = [ints(4, 2) for _ in rows]  # a new request without `start`: shorter contexts
        got = drafter.propose(rows, [3] * len(rows), None, None)
        assert got.counts == [len(_latest_ngram_follow(r, 3, drafter.max_ngram, drafter.min_ngram)) for r in rows]


def test_measured_acceptance_matches_theory_greedy(pairs):
    """At T=0 the acceptance of a reached draft is decided (argmax match): equal counts."""
    target, draft = pairs("mistral")
    for factory in (lambda: DraftModelDrafter(draft), PromptLookupDrafter):
        stats = _pooled(factory, target, temperature=0.0, runs=10)
        assert stats.accept_prob_sum == [float(a) for a in stats.accepted_at]
        assert stats.distance_count == stats.reached
        assert sum(stats.accepted_at) > 0


# --------------------------------------------------------------- sampling is lossless


def _exact_joint(model, prompt: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """p(t1) * p(t2 | t1) for every (t1, t2): one forward for t1, one batched over all V t1."""
    with torch.no_grad():
        p1 = sampling.probs(model(prompt.unsqueeze(0)).logits[0, -1])  # [V]
        vocab = p1.shape[-1]
        batch = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], dim=1)
        p2 = sampling.probs(model(batch).logits[:, -1])  # [V, V], row t1
    return p1.double().unsqueeze(1) * p2.double()


ROWS = 400  # samples per decode: a row costs ~20x less than a batch-1 decode of its own


def _sample_first_two(model, make_drafter, prompt, k, runs, sampling, **fast):
    """Counts [V, V] of (t1, t2) over `runs` samples, and the pooled stats. The samples are the
    rows of equal batches of at most ROWS copies of the prompt: row b of batch c draws exactly
    what batch-1 `generate(seed=row_seed(c, b))` draws (tests/test_batched.py), and equal
    batches compile once on the compiled path (`fast`: generate_batch's static_cache/compile)."""
    batches = -(-runs // ROWS)
    assert runs % batches == 0, f"{runs} samples do not split into {batches} equal batches"
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    total = DecodeStats()
    for seed in range(batches):
        # K+1 new tokens: the first call drafts K tokens, so t1 and t2 go through verification.
        out = generate_batch(
            model,
            [prompt] * (runs // batches),
            make_drafter(),
            max_new_tokens=k + 1,
            num_draft_tokens=k,
            sampling=sampling,
            seed=seed,
            **fast,
        )
        for tokens in out.tokens:
            counts[tokens[0], tokens[1]] += 1
        total = total + out.stats
    return counts, total


SAMPLING_PROMPT = torch.tensor([1, 5, 77, 140])


def _lookup_prompt(target) -> torch.Tensor:
    """A prompt [bos, a, b, c, a, b]: lookup of [a, b] proposes c, a, b. A random model does not
    copy, so c is chosen (one batched forward over all V candidates) to have a middling target
    probability: accepted in some runs, rejected in others."""
    gen = torch.Generator().manual_seed(7)
    best, best_score = None, -1.0
    for _ in range(4):
        a, b = torch.randint(3, VOCAB, (2,), generator=gen).tolist()
        batch = torch.tensor([[1, a, b, 0, a, b]]).repeat(VOCAB, 1)
        batch[:, 3] = torch.arange(VOCAB)
        with torch.no_grad():
            p = torch.softmax(target(batch).logits[:, -1].float(), -1)
        p_c = p[torch.arange(VOCAB), torch.arange(VOCAB)]  # p(c | [bos, a, b, c, a, b])
        score, c = torch.minimum(p_c, 1 - p_c).max(0)
        if score.item() > best_score:
            best, best_score = batch[c].clone(), score.item()
    assert best_score > 0.1
    return best


def _check_lossless(model, make_drafter, prompt, k, runs, sampling, exact=None):
    exact = _exact_joint(model, prompt, sampling) if exact is None else exact
    counts, stats = _sample_first_two(model, make_drafter, prompt, k, runs, sampling)
    result = chi_square_gof(counts, exact)
    return result, stats


WARPED = SamplingConfig(0.8, top_k=20, top_p=0.9)

CASES = {
    # name: (drafter factory given (target, draft), K, runs, sampling)
    "draft-K1": (lambda t, d: DraftModelDrafter(d), 1, 3000, SamplingConfig(1.0)),
    "draft-K3": (lambda t, d: DraftModelDrafter(d), 3, 1600, SamplingConfig(1.0)),
    "lookup-K3": (lambda t, d: PromptLookupDrafter(), 3, 3000, SamplingConfig(1.0)),
    "draft-K2-warped": (lambda t, d: DraftModelDrafter(d), 2, 2400, WARPED),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_is_lossless(case, pairs):
    target, draft = pairs("llama")
    make, k, runs, sampling = CASES[case]
    prompt = _lookup_prompt(target) if case.startswith("lookup") else SAMPLING_PROMPT
    result, stats = _check_lossless(target, lambda: make(target, draft), prompt, k, runs, sampling)
    # The drafts must have been accepted and rejected, so that every branch ran.
    assert 0 < sum(stats.accepted) < sum(stats.proposed)
    assert stats.proposed[0] == k
    assert result.bins >= 10, result
    assert result.p_value > 1e-3, result


def test_sampling_is_lossless_quick(pairs):
    """A cheap version of the above that always runs (fewer samples, less power)."""
    target, draft = pairs("llama")
    make = lambda: DraftModelDrafter(draft)  # noqa: E731
    result, stats = _check_lossless(target, make, SAMPLING_PROMPT, 2, 600, SamplingConfig(1.0))
    assert 0 < sum(stats.accepted) < sum(stats.proposed)
    assert result.p_value > 1e-3, result


@pytest.mark.slow
def test_lossless_test_has_power(pairs):
    """Negative control: plain sampling from the draft, scored against the target's law, fails."""
    target, draft = pairs("llama")
    plain = SamplingConfig(1.0)
    counts, _ = _sample_first_two(draft, lambda: None, SAMPLING_PROMPT, 1, 1600, plain)
    exact_target = _exact_joint(target, SAMPLING_PROMPT, plain)
    assert chi_square_gof(counts, exact_target).p_value < 1e-6
    # ...while the same samples do fit the draft's own law (the pipeline itself is sound).
    assert chi_square_gof(counts, _exact_joint(draft, SAMPLING_PROMPT, plain)).p_value > 1e-3


class _RawLogitsQ(DraftModelDrafter):
    """The known bug class (transformers #47932): draws from the warped q but reports the raw
    T=1 softmax as q. Acceptance is then decided with the wrong ratio and losslessness breaks."""

    def prepare(self, *args, **kwargs):  # it reads its raw logits
        return super().prepare(*args, **{**kwargs, "logits": True})

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        return Proposal(proposal.tokens, proposal.counts, torch.softmax(proposal.logits, -1), proposal.logits)


@pytest.mark.slow
def test_lossless_test_catches_raw_logits_q(pairs):
    """Negative control with a subtle bug: the same test as the warped case must reject it."""
    target, draft = pairs("llama")
    _, k, runs, sampling = CASES["draft-K2-warped"]
    make = lambda: _RawLogitsQ(draft)  # noqa: E731
    result, _ = _check_lossless(target, make, SAMPLING_PROMPT, k, runs, sampling)
    assert result.p_value < 1e-3, result


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(input_ids=torch.tensor([[5, 6], [7, 8]])), "input_ids"),
        (dict(input_ids=torch.tensor([], dtype=torch.long)), "input_ids"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids"),
        (dict(input_ids=torch.zeros(1, 1, 3, dtype=torch.long)), "input_ids"),
    ],
)
def test_bad_input_raises(kwargs, name, pairs):
    target, draft = pairs("llama")
    args = dict(input_ids=torch.tensor([5, 6, 7]), max_new_tokens=4, num_draft_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        generate(target, DraftModelDrafter(draft), args.pop("input_ids"), **args)
