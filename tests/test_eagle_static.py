"""EAGLE heads on the decoder's preallocated KV store (`static_cache=True` / `compile=`).

The head's cache is the runtime's one KV store (`decoding/kv.py`), grown as it fills on the
default path ("growing" below) and sized up front on the static one:
- the two paths agree token for token (the emitted tokens, every
  proposal and every accepted count) for the EAGLE chain and the EAGLE-2 tree at B = 1 and
  B = 4, and both equal target-only greedy decoding;
- a real `EagleHead` (its attention writes the buffers the store hands it) proposes the
  same on both paths in a batch of rows of different lengths;
- with `compile`, the head's warmed steps (catch-up widths, the tree's frontier with its
  lookback) are what runs, padded to the warmed width, and decode the same (the compiler
  stood in by the identity here: inductor is `tests/test_static.py`'s slow test);
- sampling at T = 1 through an EAGLE-2 tree on the static store is distributed as the target
  (chi-square of the first two tokens against the exact joint, `tests/test_decoder.py`).
Stand-in heads with hints (`test_eagle_drafter._oracle_head`) make drafts accepted often, so
rows accept different lengths and the static store's holes, lookback masks and compaction run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_decoder import _exact_joint
from test_eagle_drafter import _ids, _oracle_head

from draftsmith.decoding import compiler as compiler_module
from draftsmith.decoding import generate_batch
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.eval.stats import chi_square_gof

TREE = {"depth": 3, "top_k": 3, "total_tokens": 10}
K = 4
N_NEW = 12
PROMPTS = [_ids(n, seed=40 + n) for n in (7, 1, 12, 3)]  # a one-token prompt: no pair before its first call


class Proposals(EagleDrafter):
    """Records every proposal (per row: its tokens and parents) and the store it drafted on."""

    def start(self, prompts, prefill, vocab_size):
        super().start(prompts, prefill, vocab_size)
        self.seen, self.static = [], self._capacity is not None  # a store sized up front

    def propose(self, contexts, num_tokens, sampling, generators):
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        rows = [proposal.tokens[b, :c].tolist() for b, c in enumerate(proposal.counts)]
        self.seen.append((rows, proposal.parents))
        return proposal


def _both_stores(target, head, prompts, tree):
    """(growing, static) runs of the same greedy decode: (result, proposals) each."""
    runs = []
    for static in (False, True):
        drafter = Proposals(head, tree=tree)
        out = generate_batch(target, prompts, drafter, num_draft_tokens=K, max_new_tokens=N_NEW, static_cache=static)
        assert drafter.static == static
        runs.append((out, drafter.seen))
    return runs


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_the_two_stores_agree_and_equal_target_only(tree, batch, pairs):
    target, _ = pairs("llama")
    head, _ = _oracle_head(target, PROMPTS[0], "eagle3", seed=3, num_new=N_NEW, draft_vocab=200)
    prompts = PROMPTS[:batch]
    reference = generate_batch(target, prompts, None, max_new_tokens=N_NEW).tokens
    (growing, seen_growing), (static, seen_static) = _both_stores(target, head, prompts, tree)
    assert growing.tokens == static.tokens == reference
    assert [r.accepted for r in static.rows] == [r.accepted for r in growing.rows]
    assert seen_static == seen_growing
    assert sum(static.rows[0].accepted) >= N_NEW // 2  # the hinted row: long accepted runs


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama-layer", "qk_norm"])
def test_a_real_head_proposes_the_same_on_both_stores(pairs, qk_norm):
    """`EagleHead.for_target` (eagle3): its own attention over the store's HF cache, B = 4; with
    `qk_norm` the keys it writes there are normed before RoPE."""
    from draftsmith.heads.eagle import EagleHead

    target, _ = pairs("llama")
    torch.manual_seed(0)
    head = EagleHead.for_target(target, "eagle3", qk_norm=qk_norm).eval()
    reference = generate_batch(target, PROMPTS, None, max_new_tokens=N_NEW).tokens
    for tree in (None, TREE):
        (growing, seen_growing), (static, seen_static) = _both_stores(target, head, PROMPTS, tree)
        assert growing.tokens == static.tokens == reference
        assert seen_static == seen_growing and len(seen_static) >= N_NEW // 2


def test_the_warmed_steps_of_a_compiled_decode_run_and_agree(pairs, monkeypatch):
    """`compile=True` with `Compiler.wrap` as the identity: the EAGLE cache warms one step per
    catch-up width 1..K+1 and the frontier's, the decode runs them (padded) and equals the
    growing store's."""
    target, _ = pairs("llama")
    head, _ = _oracle_head(target, PROMPTS[0], "eagle3", seed=3, num_new=N_NEW, draft_vocab=200)
    head = copy.deepcopy(head)  # its own static caches: none warmed by an earlier test
    monkeypatch.setattr(compiler_module, "compile_unavailable", lambda device: None)
    ran = []

    def wrap(self, fn):
        def counted(*args):
            ran.append((self.owner, args[0].shape[1], args[5].shape[-1]))  # ids' width, attend's span
            return fn(*args)

        return counted

    monkeypatch.setattr(compiler_module.Compiler, "wrap", wrap)
    for tree in (None, TREE):
        growing = generate_batch(target, PROMPTS, Proposals(head, tree=tree), num_draft_tokens=K, max_new_tokens=N_NEW)
        ran.clear()
        drafter = Proposals(head, tree=tree)
        out = generate_batch(target, PROMPTS, drafter, num_draft_tokens=K, max_new_tokens=N_NEW, compile=True)
        assert out.tokens == growing.tokens and [r.accepted for r in out.rows] == [r.accepted for r in growing.rows]
        widths = {(w, span) for owner, w, span in ran if owner == "the eagle"}
        frontier = TREE["top_k"]
        if tree is None:
            assert {w for w, _ in widths} <= set(range(1, K + 2)) and (1, 1) in widths
        else:  # the frontier's step takes the deepest lookback: (depth - 1) * width columns before it
            assert (frontier, frontier * TREE["depth"]) in widths


def test_sampling_through_a_tree_is_lossless_on_the_static_store(pairs):
    """T = 1, EAGLE-2 tree of depth 2, K = 2: the first two tokens of 800 rows (8 batches of
    100) against the target's exact joint."""
    target, _ = pairs("llama")
    prompt = torch.tensor([1, 5, 77, 140, 9])
    head, _ = _oracle_head(target, prompt, "eagle3", seed=61, draft_vocab=256, miss=0.0)
    drafter = Proposals(head, tree={"depth": 2, "top_k": 2, "total_tokens": 5})
    sampling = SamplingConfig(1.0)
    counts = torch.zeros(target.config.vocab_size, target.config.vocab_size, dtype=torch.float64)
    accepted = proposed = 0
    for seed in range(8):
        out = generate_batch(
            target,
            [prompt] * 100,
            drafter,
            num_draft_tokens=2,
            max_new_tokens=3,
            sampling=sampling,
            seed=seed,
            static_cache=True,
        )
        assert drafter.static
        for tokens in out.tokens:
            counts[tokens[0], tokens[1]] += 1
        accepted += sum(sum(r.accepted) for r in out.rows)
        proposed += sum(sum(r.proposed) for r in out.rows)
    assert 0 < accepted < proposed  # accepted and rejected nodes: every branch ran
    result = chi_square_gof(counts, _exact_joint(target, prompt, sampling))
    assert result.bins >= 10, result
    assert result.p_value > 1e-3, result
