"""`check_lossless` (the `draftsmith check-lossless` instrument) on every path of the decoder:
the batched loop and the preallocated/compiled caches pass the real decoder and catch planted
bugs (an always-accept rule; q taken from the raw logits while the draft samples from warped
ones, at T = 1 with top-k; a bonus token drawn from the last draft's distribution at K = 3)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decoding import DraftModelDrafter, Proposal
from draftsmith.decoding import loop as runtime_loop
from draftsmith.decoding.sampling import draw, verify_chain
from draftsmith.eval.lossless import check_lossless
from draftsmith.eval.stats import pit_uniformity, token_cdf

PROMPT = torch.tensor([1, 5, 77, 140])
TOP_K = 20  # the warped case: top-k keeps q != softmax(raw logits)
# 400 rows per decode (a sample costs ~20x less than in a batch of its own); on the compiled path
# the batch size of test_static's compiled chi-squares too, so that their compiled steps are shared.
BATCH = 400
PATHS = {"batched": dict(batch_size=BATCH), "static": dict(batch_size=BATCH, static_cache=True)}


class RawLogitsQ(DraftModelDrafter):
    """Samples from the warped q but reports the raw T = 1 softmax as q (transformers #47932)."""

    def prepare(self, *args, **kwargs):  # it reads its raw logits
        return super().prepare(*args, **{**kwargs, "logits": True})

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        return Proposal(proposal.tokens, proposal.counts, torch.softmax(proposal.logits, -1), proposal.logits)


def _always_accept(p, draft_tokens, q, generator=None):
    """A broken rule: keeps every draft, then draws the bonus from p_K."""
    batch, k = draft_tokens.shape
    accepted = torch.full((batch,), k, dtype=torch.long, device=p.device)
    return accepted, draw(p[:, k], generator)


def _bonus_off_by_one(p, draft_tokens, q, generator=None):
    """A broken bonus: when all K drafts are accepted, it is drawn from p_K-1 (the last draft's
    distribution) instead of p_K. Tokens 1..K are untouched: only the bonus test can see it."""
    accepted, nxt = verify_chain(p, draft_tokens, q, generator)
    k = draft_tokens.shape[1]
    return accepted, torch.where(accepted == k, draw(p[:, k - 1], generator), nxt)


def _check(target, drafter, samples=1600, **path):
    return check_lossless(
        target,
        drafter,
        PROMPT,
        num_draft_tokens=2,
        temperature=1.0,
        top_k=TOP_K,
        samples=samples,
        progress=False,
        **path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_the_real_decoder_passes(path, pairs):
    target, draft = pairs("llama")
    result = _check(target, DraftModelDrafter(draft), **PATHS[path])
    assert result.samples == 1600 and 0 < result.acceptance_rate < 1
    assert result.passed, result.describe()


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_an_always_accept_rule_is_caught(path, pairs, monkeypatch):
    target, draft = pairs("llama")
    monkeypatch.setattr(runtime_loop, "verify_chain", _always_accept)
    result = _check(target, DraftModelDrafter(draft), samples=800, **PATHS[path])
    assert not result.passed, result.describe()


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_q_from_raw_logits_is_caught(path, pairs):
    target, draft = pairs("llama")
    result = _check(target, RawLogitsQ(draft), samples=2400, **PATHS[path])
    assert not result.passed, result.describe()


@pytest.mark.slow
@pytest.mark.xdist_group("compiled")  # with tests/test_static.py's compiled tests: the same compiled steps
def test_the_compiled_path_passes_and_catches_raw_q(pairs):
    target, draft = pairs("llama")
    good = _check(target, DraftModelDrafter(draft), batch_size=BATCH, compile=True)
    assert good.passed, good.describe()
    bad = _check(target, RawLogitsQ(draft), samples=2400, batch_size=BATCH, compile=True)
    assert not bad.passed, bad.describe()


def test_the_bonus_token_is_tested_at_k_3_and_an_off_by_one_bonus_is_caught(pairs, monkeypatch):
    target, _ = pairs("llama")
    self_draft = DraftModelDrafter(target)  # q = p: every draft accepted, every token 4 is a bonus
    options = dict(num_draft_tokens=3, temperature=1.0, top_k=TOP_K, samples=400, batch_size=BATCH, progress=False)
    good = check_lossless(target, self_draft, PROMPT, **options)
    assert good.acceptance_rate == 1.0 and good.bonus_token is not None and good.passed, good.describe()
    assert "token 4 (bonus) | t1..t3:" in good.describe()
    monkeypatch.setattr(runtime_loop, "verify_chain", _bonus_off_by_one)
    bad = check_lossless(target, self_draft, PROMPT, **options)
    assert min(bad.first_token.p_value, bad.first_two_tokens.p_value) >= bad.threshold  # blind to it
    assert bad.bonus_token.p_value < bad.threshold and not bad.passed, bad.describe()


def test_pit_uniformity_passes_exact_samples_and_fails_shifted_ones():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(600, 50, generator=g), -1)  # every sample its own context
    exact = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    assert pit_uniformity(*token_cdf(exact, probs), generator=g).p_value > 1e-3
    shifted = torch.multinomial(probs.roll(1, dims=-1), 1, generator=g).squeeze(-1)  # the neighbour's law
    assert pit_uniformity(*token_cdf(shifted, probs), generator=g).p_value < 1e-3
    zero = probs.clone()
    zero[0, exact[0]] = 0.0
    assert pit_uniformity(*token_cdf(exact, zero)).p_value == 0.0  # an impossible token


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(samples=50), "samples"),
        (dict(samples=2.5), "samples"),
        (dict(batch_size=0), "batch_size"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=2.0), "threshold"),
    ],
)
def test_bad_settings_are_refused(kwargs, match, pairs):
    target, draft = pairs("llama")
    with pytest.raises(ValueError, match=match):
        check_lossless(target, DraftModelDrafter(draft), PROMPT, progress=False, **kwargs)
