"""The decoder on every family of `heads/toy.py`'s MATRIX (the decoder families users target, hybrids
of attention and recurrent layers included), tiny and random:

- greedy decoding is HF `generate`'s, token for token, at batch 1 and 3 (prompts of 7, 12 and 3
  tokens: left padding in the prefill), target-only and through three drafters: the target as its
  own draft (every draft accepted: each call keeps every column), a noisy copy of it (drafts
  rejected at every depth: each row keeps its own prefix, its recurrent state rolled back to it),
  prompt lookup and, on the attention-only families, an EAGLE-2 tree of an untrained EAGLE-3 head; with an eos that ends rows at different calls (rows leave the batch);
- on a hybrid (Qwen3.5: Gated DeltaNet + attention) sampling is lossless (chi-square at T = 1 with
  top-k and at T = 0.7 with top-p), and a rollback that keeps the last fed column's state is caught;
- what is refused is refused in one line: trees and --compile on a hybrid, MiniMax (its own cache
  class keeps no per-token states).
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.decoding import DraftModelDrafter, generate, generate_batch, recurrent
from draftsmith.decoding.drafters import PromptLookupDrafter
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.recurrent import state_layers
from draftsmith.eval.lossless import check_lossless
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.toy import MATRIX, tiny_model, tiny_pair

REFUSED = {"minimax"}
FAMILIES = sorted(set(MATRIX) - REFUSED)
HYBRID = "qwen3_5_text"
NEW = 12


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=gen) for n in (7, 12, 3)]


def _hf_greedy(model, prompt, eos=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, prompt.numel() :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_is_the_targets_own(family):
    target, noisy = tiny_pair(family)
    prompts = _prompts()
    expected = [_hf_greedy(target, p) for p in prompts]
    drafters = {
        "target-only": None,
        "self-draft": DraftModelDrafter(target, name="self"),
        "noisy draft": DraftModelDrafter(noisy),
        "prompt lookup": PromptLookupDrafter(),
    }
    if not state_layers(target.config, "the target"):  # trees: an untrained EAGLE-3 head's EAGLE-2 tree
        layers = target.config.get_text_config().num_hidden_layers
        head = EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, layers // 2, layers])
        drafters["eagle tree"] = EagleDrafter(head, tree={"depth": 2, "top_k": 2, "total_tokens": 5})
    for name, drafter in drafters.items():
        batch = generate_batch(target, prompts, drafter, max_new_tokens=NEW, num_draft_tokens=3)
        assert batch.tokens == expected, f"{family}, {name}, batch 3"
    assert (
        generate(target, DraftModelDrafter(noisy), prompts[1], max_new_tokens=NEW, num_draft_tokens=3).tokens
        == (expected[1])
    ), f"{family}, noisy draft, batch 1"
    # A stop token that ends one row early: the others go on without it (their states selected).
    eos = expected[0][4]
    stopped = generate_batch(
        target, prompts, DraftModelDrafter(noisy), max_new_tokens=NEW, num_draft_tokens=3, eos_token_id=eos
    )
    assert stopped.tokens == [_hf_greedy(target, p, eos) for p in prompts], f"{family}, eos {eos}"


def test_the_self_draft_of_a_hybrid_accepts_everything_and_the_noisy_one_rejects():
    """The two drafters above reach both ends: full acceptance, and rejections at every depth."""
    target, noisy = tiny_pair(HYBRID)
    prompts = _prompts()
    for drafter, low, high in ((DraftModelDrafter(target), 1.0, 1.0), (DraftModelDrafter(noisy), 0.0, 0.9)):
        rows = generate_batch(target, prompts, drafter, max_new_tokens=NEW, num_draft_tokens=3).rows
        rate = sum(map(sum, (r.accepted for r in rows))) / sum(map(sum, (r.proposed for r in rows)))
        assert low <= rate <= high, rate


def _lossless(target, drafter, k=2, **sampling):
    prompt = torch.tensor([1, 5, 77, 140])
    return check_lossless(
        target, drafter, prompt, num_draft_tokens=k, samples=1600, batch_size=400, progress=False, **sampling
    )


@pytest.fixture(scope="module")
def close_pair():
    """A hybrid target and a close draft (acceptance ~0.4-0.7: every verification branch is taken)."""
    target = tiny_model(HYBRID)
    draft = tiny_model(HYBRID)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            if "norm" not in name:
                weight.add_(torch.randn(weight.shape, generator=gen) * 0.1 * weight.std())
    return target, draft


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=20), dict(temperature=0.7, top_p=0.9)])
def test_sampling_on_a_hybrid_is_lossless(close_pair, sampling):
    target, draft = close_pair
    result = _lossless(target, DraftModelDrafter(draft), **sampling)
    assert 0.1 < result.acceptance_rate < 0.9 and result.passed, result.describe()


def test_a_rollback_that_keeps_the_last_columns_state_is_caught(close_pair, monkeypatch):
    """K = 1: after a rejection the second token comes from the next call, whose state must not
    hold the rejected draft; a store that keeps every fed column's state fails the chi-square."""
    target, draft = close_pair
    commit = recurrent.RowStates.commit
    monkeypatch.setattr(
        recurrent.RowStates, "commit", lambda self, first, end: commit(self, first, [self._width] * len(end))
    )
    result = _lossless(target, DraftModelDrafter(draft), k=1, temperature=1.0, top_k=20)
    assert not result.passed, result.describe()


def test_trees_compile_and_minimax_are_refused_in_one_line():
    target = tiny_model(HYBRID)
    head = EagleHead.for_target(target, "eagle3", aux_layer_ids=[1, 2, 3])
    tree = EagleDrafter(head, tree={"depth": 2, "top_k": 2, "total_tokens": 4})
    with pytest.raises(ValueError, match=r"proposes trees, but the target has recurrent layers.*decode it as a chain"):
        generate(target, tree, _prompts()[0], max_new_tokens=4)
    with pytest.raises(
        ValueError, match=r"recurrent layers .*runs uncompiled \(drop --compile; --static-cache works\)"
    ):
        generate(target, None, _prompts()[0], max_new_tokens=4, compile=True)
    static = generate(target, DraftModelDrafter(target), _prompts()[0], max_new_tokens=NEW, static_cache=True)
    assert static.tokens == _hf_greedy(target, _prompts()[0])
    with pytest.raises(ValueError, match=r"MiniMaxForCausalLM\) keeps its recurrent state in its own cache class"):
        generate(tiny_model("minimax"), None, _prompts()[0], max_new_tokens=4)


def test_a_tokenizer_longer_than_the_logits_is_taken_for_the_target_and_its_self_draft(tmp_path, run_cli):
    """One added token past the output matrix (never emitted by either model): accepted for the
    target, and so for the same folder as its own draft; the two checks agree."""
    from draftsmith.heads.toy import tiny_tokenizer

    folder = tmp_path / "target"
    tiny_model("llama").save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert len(tokenizer) == 321
    tokenizer.save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n', encoding="utf-8")
    common = ["--prompts", prompts, "--max-new-tokens", 4, "--device", "cpu", "--no-progress", "--out", tmp_path / "e"]
    code, _, err = run_cli(["eval", "--target", folder, "--drafter", f"draft:self={folder}", *common])
    assert code == 0, err
