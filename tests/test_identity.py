"""The greedy identity check (eval/identity.py): exact in fp32, rounding at near-ties in bf16, and a
real mismatch (a wrong token) caught in both."""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoder import PROMPTS

from draftsmith.decoding import generate
from draftsmith.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from draftsmith.eval.identity import TIE_ULPS, compare_greedy, describe_identity, gaps_in_ulps, ulp

N_NEW = 32


def test_ulp_is_the_spacing_of_the_dtype():
    assert float(ulp(torch.tensor(48.0), torch.bfloat16)) == 0.25  # [32, 64): 2^5 / 2^7
    assert float(ulp(torch.tensor(-1.0), torch.float32)) == 2.0**-23
    assert float(ulp(torch.tensor(0.75), torch.float16)) == 2.0**-11
    assert float(ulp(torch.tensor(0.0), torch.bfloat16)) > 0  # a zero row does not divide by zero


def _decodes(target, drafter, prompts, k=4):
    return [generate(target, drafter, p, max_new_tokens=N_NEW, num_draft_tokens=k).tokens for p in prompts]


def test_target_only_tokens_have_no_gap_in_fp32(pairs):
    target, _ = pairs("llama")
    for prompt in PROMPTS[:4]:
        tokens = generate(target, None, prompt, max_new_tokens=N_NEW).tokens
        assert float(gaps_in_ulps(target, prompt, tokens).max()) <= 1.0  # the argmax, up to fp32 order


def test_fp32_rows_are_identical(pairs):
    target, draft = pairs("llama")
    reference = _decodes(target, None, PROMPTS)
    check = compare_greedy(target, PROMPTS, _decodes(target, DraftModelDrafter(draft), PROMPTS), reference)
    assert check == {"verdict": "identical", "prompts_differing": 0, "prompts": len(PROMPTS)}
    assert describe_identity(check) == "yes"


def test_a_wrong_token_is_a_mismatch(pairs):
    """A decoder that emitted the target's 2nd choice once: whole logits below the best, caught."""
    target, _ = pairs("llama")
    reference = _decodes(target, None, PROMPTS[:3])
    answers = copy.deepcopy(reference)
    prompt, row = PROMPTS[1], answers[1]
    with torch.no_grad():
        logits = target(input_ids=torch.cat([prompt, torch.tensor(row[:5])])[None]).logits[0, -1]
    row[5] = int(logits.topk(2).indices[1])
    check = compare_greedy(target, PROMPTS[:3], answers, reference)
    assert check["verdict"] == "mismatch" and check["prompts_differing"] == 1 and check["parted_at"] == [5]
    assert check["max_gap_ulps"] > TIE_ULPS and describe_identity(check).startswith("NO (1/3 prompts")


def test_bf16_rows_part_only_at_near_ties(pairs):
    """In bf16 a verify of K + 1 tokens rounds otherwise than one token at a time: rows may part, but
    every token they emit stays within the tolerance of the best logit, as target-only's own do."""
    target, draft = (copy.deepcopy(m).to(torch.bfloat16) for m in pairs("llama"))
    reference = _decodes(target, None, PROMPTS)
    for drafter in (DraftModelDrafter(draft), PromptLookupDrafter(max_ngram=3)):
        check = compare_greedy(target, PROMPTS, _decodes(target, drafter, PROMPTS), reference)
        assert check["verdict"] in ("identical", "rounding"), check
        if check["verdict"] == "rounding":
            assert check["max_gap_ulps"] <= TIE_ULPS and check["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stale_context_is_a_mismatch(pairs, dtype):
    """Tokens decoded from the wrong context (a bug that keeps a stale KV entry would do this): the
    prompt's last token dropped. Caught whatever the dtype's rounding."""
    target = copy.deepcopy(pairs("llama")[0]).to(dtype)
    prompts = [p for p in PROMPTS if len(p) >= 4][:6]
    reference = _decodes(target, None, prompts)
    stale = [generate(target, None, p[:-1], max_new_tokens=N_NEW).tokens for p in prompts]
    assert compare_greedy(target, prompts, stale, reference)["verdict"] == "mismatch"
