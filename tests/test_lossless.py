"""`check_lossless` (the `draftsmith check-lossless` instrument) on every path of the decoder:
the batched loop and the preallocated/compiled caches pass the real decoder and catch planted
bugs (an always-accept rule; q taken from the raw logits while the draft samples from warped
ones, at T = 1 with top-k)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.lossless import check_lossless
from draftsmith.eval.runtime import DraftModelDrafter, Proposal
from draftsmith.eval.runtime import loop as runtime_loop
from draftsmith.eval.runtime.sampling import draw

PROMPT = torch.tensor([1, 5, 77, 140])
TOP_K = 20  # the warped case: top-k keeps q != softmax(raw logits)
PATHS = {"batched": dict(batch_size=4), "static": dict(batch_size=4, static_cache=True)}


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


def _check(target, drafter, samples=1600, **path):
    return check_lossless(target, drafter, PROMPT, num_draft_tokens=2, temperature=1.0, top_k=TOP_K,
                          samples=samples, progress=False, **path)  # fmt: skip


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
def test_the_compiled_path_passes_and_catches_raw_q(pairs):
    target, draft = pairs("llama")
    good = _check(target, DraftModelDrafter(draft), batch_size=4, compile=True)
    assert good.passed, good.describe()
    bad = _check(target, RawLogitsQ(draft), samples=2400, batch_size=4, compile=True)
    assert not bad.passed, bad.describe()


@pytest.mark.parametrize("kwargs, match", [(dict(samples=50), "samples"), (dict(samples=2.5), "samples"),
                                           (dict(batch_size=0), "batch_size")])  # fmt: skip
def test_bad_settings_are_refused(kwargs, match, pairs):
    target, draft = pairs("llama")
    with pytest.raises(ValueError, match=match):
        check_lossless(target, DraftModelDrafter(draft), PROMPT, progress=False, **kwargs)
