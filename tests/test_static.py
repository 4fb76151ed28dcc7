"""The static-cache (and compiled) decoding path against the default one.

- the KV store (`KVStore`): incremental feeding, tree verification, keeping a path and padded
  calls through its compiled-step code (run uncompiled) give the logits of its live forwards; a
  forward past the capacity reallocates the store and gives the same logits; a request larger
  than a model's store gets a larger one;
- greedy: token-identical to HF greedy and to the eager decoder (same accepted counts) for every
  drafter kind: target only, draft model, Medusa chain and tree, EAGLE chain and tree;
- sampling: chi-square of the first two tokens against the target's exact law, for every
  drafter kind on the static path;
- heads read the hidden states the verification produced (`start`'s prefill, `accepted`): the
  same states as on the growing store, and no extra target forward;
- compiled: a reduced set of the above (slow: inductor compiles C++), and the fallback when
  compilation is unavailable or fails.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from fixtures import VOCAB, first_line_prompts, windowed_model
from lifecycle_helpers import assert_fast_path_decodes_the_same
from test_decoder import _exact_joint, _sample_first_two
from test_eagle_drafter import _oracle_head
from test_tree import NUM_HEADS, _oracle, informed_medusa
from test_tree import TREE as MEDUSA_TREE

from draftsmith.decoding import compiler as compiler_module
from draftsmith.decoding import generate
from draftsmith.decoding import kv as kv_module
from draftsmith.decoding.compiler import CAPACITY_STEP, make_step
from draftsmith.decoding.drafters import Drafter, DraftModelDrafter, PromptLookupDrafter, Proposal
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.kv import KVStore, capacity_for, model_cache
from draftsmith.decoding.masks import chain_attend, static_mask, tree_attend
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.target import hf_call, right_aligned
from draftsmith.eval.stats import chi_square_gof

ATOL = 1e-5  # fp32: a static-cache forward reads the same numbers through a longer (masked) attention
EAGLE_TREE = {"depth": 3, "top_k": 3, "total_tokens": 10}
K = 4


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:g}"


@torch.no_grad()
def _hf_greedy(model, prompt, max_new_tokens):
    ids = prompt[None]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1] :].tolist()


# ------------------------------------------------------------------------ the KV store


def _stepped(model, batch: int, capacity: int, widths: dict) -> KVStore:
    """A store whose calls of `widths` ({hidden layers: [width, ...]}) run its compiled-step code
    (`make_step`: the whole buffers, the mask built from tensors), uncompiled."""
    kv = KVStore.for_model(model, batch, capacity)
    for layers, ws in widths.items():
        for w in ws:
            kv._compiled[(layers, w)] = (0, make_step(hf_call(model, layers, False), kv))
    return kv


def _feed(model, kv, ids, **kwargs):
    """Feed and keep a chain ids [n] after the row's real tokens."""
    positions = kv.counts[0] + torch.arange(ids.numel())
    out = kv.forward(model, ids[None], positions[None], **kwargs)
    kv.commit_spans(ids.numel())
    return out


def _tree(model, kv, fed, parents, **kwargs):
    """Feed [last, nodes] with the tree's ancestor mask and depth positions (nothing kept yet)."""
    attend, depths = tree_attend([parents], fed.numel(), model.device)
    return kv.forward(model, fed[None], kv.counts[0] + torch.tensor(depths), attend, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_live_and_step_forwards_agree(family, pairs):
    """Prefill, a chain, rejected drafts, a tree with a kept path (kept columns between holes),
    then more tokens: every output of the compiled-step code (whole buffers) equals the live
    forwards' (the live store starts at 8 columns: it is reallocated on the way)."""
    model, _ = pairs(family)
    layers = (0, model.config.num_hidden_layers)
    growing = KVStore.for_model(model, 1, 8)
    static = _stepped(model, 1, 64, {layers: [12, 5], (): [8, 5]})
    ids = _ids(30, seed=1)
    a, b = (_feed(model, kv, ids[:12], logits_to_keep=1, hidden_layers=layers) for kv in (growing, static))
    _close(b.logits, a.logits, "prefill, last logits")
    for i in layers:
        _close(b.hidden_states[i], a.hidden_states[i], f"prefill, hidden {i}")
    a, b = (_feed(model, kv, ids[12:17], hidden_layers=layers) for kv in (growing, static))
    _close(b.logits, a.logits, "chain of 5")
    _close(b.hidden_states[layers[1]], a.hidden_states[layers[1]], "chain of 5, last hidden")
    for kv in (growing, static):
        kv.retain(14, [0])  # the last 3 were rejected drafts
    parents = [-1, 0, 0, 1, 2, 2, 4]  # after `last` = ids[17]
    a, b = (_tree(model, kv, ids[17:25], parents) for kv in (growing, static))
    _close(b.logits, a.logits, "tree")
    keep = torch.tensor([[True, True, False, True, False, False, True, False]])  # node 0, then 2, then 5
    for kv in (growing, static):
        kv.commit(keep)
    assert static.counts == growing.counts == [18] and torch.equal(static.valid, growing.valid)
    a, b = (_feed(model, kv, ids[25:30]) for kv in (growing, static))
    _close(b.logits, a.logits, "after keeping the path")
    assert growing.capacity > 8 and static.capacity == 64 and len(static.compiled_widths(())) == 2


def test_padded_calls_match_exact_calls(pairs):
    """A call narrower than a compiled width is padded: the padding columns are holes that see
    only themselves, never read. Checked without a compiler by registering the uncompiled step
    as a width-8 graph."""
    model, _ = pairs("llama")
    exact, padded = KVStore.for_model(model, 1, 64), _stepped(model, 1, 64, {(): [8], (2,): [8]})
    ids = _ids(20, seed=2)
    for kv in (exact, padded):
        _feed(model, kv, ids[:9])
    a, b = (_feed(model, kv, ids[9:12], hidden_layers=(2,)) for kv in (exact, padded))
    assert b.logits.shape == a.logits.shape == (1, 3, VOCAB)
    _close(b.logits, a.logits, "padded chain")
    _close(b.hidden_states[2], a.hidden_states[2], "padded chain, hidden")
    a, b = (_tree(model, kv, ids[12:15], [-1, -1]) for kv in (exact, padded))
    _close(b.logits, a.logits, "padded tree")
    for kv in (exact, padded):
        kv.commit(torch.tensor([[True, False, True]]))
    assert padded.length == exact.length == 15  # the padding columns were cut with the tail
    a, b = (_feed(model, kv, ids[15:17]) for kv in (exact, padded))  # the padding's junk is overwritten
    _close(b.logits, a.logits, "after the padded calls")


def test_a_full_store_grows(pairs):
    """A forward past the capacity reallocates the store (the columns kept, no compaction), and so
    does `reserve` when compaction frees too little: the logits are those of a store sized for it."""
    model, _ = pairs("llama")
    capacity = capacity_for(100)
    assert capacity >= 100 and capacity % CAPACITY_STEP == 0
    kv, sized = KVStore.for_model(model, 1, capacity), KVStore.for_model(model, 1, 2 * capacity)
    ids = _ids(capacity + 8, seed=3)
    for store in (kv, sized):
        _feed(model, store, ids[: capacity - 4])
        _feed(model, store, ids[capacity - 4 : capacity - 2])
        store.retain(capacity - 4, [0])
    a, b = (_feed(model, store, ids[capacity - 4 : capacity + 1]).logits for store in (kv, sized))
    assert kv.capacity == 2 * capacity and kv.length == sized.length == capacity + 1
    _close(a, b, "the call that grew the store")
    kv.reserve(2 * capacity)  # no holes: compaction frees nothing
    assert kv.capacity == capacity_for(3 * capacity + 1) and kv.counts == [capacity + 1]
    _close(_feed(model, kv, ids[capacity + 1 :]).logits, _feed(model, sized, ids[capacity + 1 :]).logits, "after")


def test_a_proposal_larger_than_promised_grows_the_store(pairs):
    """A drafter that proposes more than its `proposal_sizes` allow near the end of the sized
    store: the store grows and decoding goes on exactly."""
    target, _ = pairs("llama")

    class Liar(Drafter):
        def proposal_sizes(self, num_tokens):
            return (1,)

        def propose(self, contexts, num_tokens, sampling, generators):  # 40 siblings: depth 1
            return Proposal(tokens=torch.arange(3, 43)[None], counts=[40], parents=[[-1] * 40])

    prompt = _ids(capacity_for(100) - 30, seed=5)
    out = generate(target, Liar(), prompt, max_new_tokens=10, num_draft_tokens=2, static_cache=True)
    assert out.tokens == _hf_greedy(target, prompt, 10)
    assert kv_module._STORES[target]["target", None, 1].capacity > capacity_for(100)


def test_a_larger_request_gets_a_larger_cache(pairs):
    """One static cache per model, role, compile mode and batch size, reused while it holds the
    request; a larger request replaces it (and decodes the same tokens)."""
    target = copy.deepcopy(pairs("qwen2")[0])  # a model of its own: no cache of an earlier test
    small = model_cache(target, "target", 1, capacity_for(10))
    assert small.capacity == CAPACITY_STEP and model_cache(target, "target", 1, CAPACITY_STEP) is small
    assert model_cache(target, "draft", 1, CAPACITY_STEP) is not small  # a model drafting for itself: a second cache
    assert model_cache(target, "target", 2, CAPACITY_STEP) is not small
    prompt = _ids(CAPACITY_STEP + 12, seed=7)
    out = generate(target, None, prompt, max_new_tokens=20, static_cache=True)
    grown = kv_module._STORES[target]["target", None, 1]
    assert grown is not small and grown.capacity >= prompt.numel() + 20
    assert out.tokens == generate(target, None, prompt, max_new_tokens=20).tokens


def test_a_windowed_step_mask_equals_the_live_one():
    """Full and sliding layers (window 3): per kind, the compiled step's mask (`static_mask`) on
    the live and fed columns is the live forward's, through a right-aligned prompt block and a
    chain call; every later column is blocked."""
    model = windowed_model("qwen2", window=3)
    kv = KVStore.for_model(model, 2, 16)
    ids, positions, lo = right_aligned([[5, 6, 7, 8, 9], [5, 6]], [0, 0], "cpu")
    kv.forward(model, ids, positions, chain_attend(5, lo, None, 2, "cpu"))
    kv.commit_spans(5, lo)
    attend, fed = chain_attend(3, None, None, 2, "cpu"), torch.tensor([[5, 6, 7], [2, 3, 4]])
    live = kv.mask(attend, torch.float32, fed)  # also writes the fed positions into the slots
    kv._write_valid()  # the host's bookkeeping into the buffer the step reads
    step = static_mask(kv._valid, kv._slots, torch.tensor(kv.length), attend, fed, torch.float32, kv.window, kv.mixed)
    assert set(step) == set(live) == {"full_attention", "sliding_attention"}
    for kind in step:
        assert torch.equal(step[kind][..., :8], live[kind]), kind
        assert (step[kind][..., 8:] < 0).all(), kind
    assert not torch.equal(live["full_attention"], live["sliding_attention"])  # the window blocks some keys


def test_settings_are_checked(pairs):
    target, _ = pairs("llama")
    prompt = _ids(5, seed=8)
    with pytest.raises(ValueError, match="compile must be"):
        generate(target, None, prompt, max_new_tokens=2, compile="fastest")


# ------------------------------------------------------------------ greedy: every drafter


def _drafters(target, draft, prompt, num_new, seed):
    """name -> (drafter factory, K) for every drafter kind, with heads that know the target's
    greedy continuation of `prompt` (so that long paths and sideways tree paths occur). The
    decode call's static_cache/compile sets the path of every model."""
    layers = target.config.num_hidden_layers
    medusa, _ = _oracle(target, prompt, num_new, seed=seed)
    eagle, _ = _oracle_head(target, prompt, "eagle3", seed, num_new=num_new, draft_vocab=200)
    return {
        "target-only": (lambda: None, 1),
        "draft": (lambda: DraftModelDrafter(draft), 3),
        "prompt-lookup": (lambda: PromptLookupDrafter(), 3),  # proposals of 0..3 tokens
        "medusa-chain": (lambda: MedusaDrafter(medusa, layers), NUM_HEADS),
        "medusa-tree": (lambda: MedusaDrafter(medusa, layers, tree=MEDUSA_TREE), NUM_HEADS),
        "eagle-chain": (lambda: EagleDrafter(eagle), K),
        "eagle-tree": (lambda: EagleDrafter(eagle, tree=EAGLE_TREE), K),
    }


def _check_greedy(target, draft, prompts, num_new, **fast):
    """Every drafter on the fast path (`fast`: generate's static_cache/compile): the tokens of HF
    greedy and the default path's accepted counts."""
    accepted = {}
    for i, prompt in enumerate(prompts):
        reference = _hf_greedy(target, prompt, num_new)
        for name, (make, k) in _drafters(target, draft, prompt, num_new, seed=i).items():
            eager = generate(target, make(), prompt, max_new_tokens=num_new, num_draft_tokens=k)
            out = generate(target, make(), prompt, max_new_tokens=num_new, num_draft_tokens=k, **fast)
            assert eager.tokens == reference, (name, i)
            assert out.tokens == reference, (name, i, "fast path")
            assert out.stats.accepted == eager.stats.accepted, (name, i)
            accepted[name] = accepted.get(name, 0) + sum(out.stats.accepted)
    for name, count in accepted.items():  # the comparison means something only with accepts
        assert name == "target-only" or count > 0, accepted
    return accepted


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_greedy_is_identical_for_every_drafter(family, pairs):
    target, draft = pairs(family)
    prompts = [_ids(1, seed=10), _ids(9, seed=11), _ids(26, seed=12)]
    accepted = _check_greedy(target, draft, prompts, num_new=21, static_cache=True)
    assert accepted["medusa-tree"] > 10 and accepted["eagle-tree"] > 10


def test_self_drafting_with_one_model_object(pairs):
    """The same model as target and draft: two caches (roles), every draft accepted."""
    target, _ = pairs("qwen2")
    prompt = _ids(7, seed=13)
    out = generate(target, DraftModelDrafter(target), prompt, max_new_tokens=20, num_draft_tokens=3, static_cache=True)
    assert out.tokens == _hf_greedy(target, prompt, 20)
    assert out.stats.accepted[:-1] == out.stats.proposed[:-1] and sum(out.stats.accepted) > 10


# ------------------------------------------------------- heads read the verify step's states


class _Observed:
    """Records the target states a drafter is handed: the prefill's, then per call those of
    `last` and the accepted path."""

    def __init__(self, drafter):
        self.drafter, self.states = drafter, []
        start, accepted = drafter.start, drafter.accepted

        def on_start(prompts, prefill, vocab_size):
            self.states.append({i: h[0].clone() for i, h in prefill.items()})
            start(prompts, prefill, vocab_size)

        def on_accepted(num_accepted, committed, hidden):
            self.states.append({i: h[0, : num_accepted[0] + 1].clone() for i, h in hidden.items()})
            accepted(num_accepted, committed, hidden)

        drafter.start, drafter.accepted = on_start, on_accepted


@pytest.mark.parametrize("kind", ["medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree"])
def test_heads_use_the_verification_states(kind, pairs, monkeypatch):
    """The states a head drafts from are the ones the verification forward produced: equal to
    the growing store's, and no target forward beyond the prefill and one per call."""
    target, draft = pairs("llama")
    prompt = _ids(11, seed=14)
    make, k = _drafters(target, draft, prompt, 18, seed=3)[kind]
    forwards, original = [], KVStore.forward

    def counted(self, model, *args, **kwargs):
        forwards.append((static, model))
        return original(self, model, *args, **kwargs)

    monkeypatch.setattr(KVStore, "forward", counted)
    runs = []
    for static in (False, True):
        recorder = _Observed(make())
        runs.append(
            (
                generate(target, recorder.drafter, prompt, max_new_tokens=18, num_draft_tokens=k, static_cache=static),
                recorder,
            )
        )
    (eager, seen_eager), (static, seen_static) = runs
    assert static.tokens == eager.tokens
    calls = sum(sized and model is target for sized, model in forwards)
    assert calls == 1 + static.stats.target_calls  # the prefill, then one per call
    assert len(seen_static.states) == len(seen_eager.states) == static.stats.target_calls  # prefill + all but the last
    for a, b in zip(seen_eager.states, seen_static.states):
        assert a.keys() == b.keys()
        for i in a:
            assert a[i].shape == b[i].shape
            _close(b[i], a[i], f"{kind}: observed layer {i}")


# --------------------------------------------------------------- sampling: chi-square


PLAIN = SamplingConfig(1.0)


def _check_lossless(target, make, prompt, k, runs, sampling=PLAIN, **fast):
    counts, stats = _sample_first_two(target, make, prompt, k, runs, sampling, **fast)
    return chi_square_gof(counts, _exact_joint(target, prompt, sampling)), stats


LOSSLESS_PROMPT = torch.tensor([1, 5, 77, 140, 9])


def _informed_drafters(target, draft):
    """name -> (factory, K, runs): drafters that are right often enough at LOSSLESS_PROMPT for
    every branch (accept, reject, residual) to run within a few hundred decodes. 800 samples: two
    batches of 400 rows, the batch size of every compiled chi-square (tests/test_lossless.py too),
    so that the target's compiled steps are shared."""
    prompt = LOSSLESS_PROMPT
    medusa = informed_medusa(target, prompt)
    eagle, _ = _oracle_head(target, prompt, "eagle3", seed=61, draft_vocab=256, miss=0.0)
    eagle_tree = {"depth": 2, "top_k": 2, "total_tokens": 5}
    return {
        "draft": (lambda: DraftModelDrafter(draft), 2, 800),
        "medusa-chain": (lambda: MedusaDrafter(medusa, 2), 2, 800),
        "medusa-tree": (lambda: MedusaDrafter(medusa, 2, tree=[(0, 0), (0, 1), (1, 0), (2,)]), 2, 800),
        "eagle-chain": (lambda: EagleDrafter(eagle), 2, 800),
        "eagle-tree": (lambda: EagleDrafter(eagle, tree=eagle_tree), 2, 800),
    }


@pytest.mark.parametrize("kind", ["draft", "medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree"])
def test_sampling_is_lossless_on_the_static_path(kind, pairs):
    target, draft = pairs("llama")
    make, k, runs = _informed_drafters(target, draft)[kind]
    result, stats = _check_lossless(target, make, LOSSLESS_PROMPT, k, runs, static_cache=True)
    assert 0 < sum(stats.accepted) < sum(stats.proposed), (kind, stats.accepted[:10])
    assert result.bins >= 10, result
    assert result.p_value > 1e-3, (kind, result)


@pytest.mark.slow
def test_the_lossless_check_has_power_on_the_static_path(pairs):
    """Negative control: a drafter whose q is not what it sampled from (the raw-logits bug of
    tests/test_decoder.py) fails the same check under warped sampling."""
    target, draft = pairs("llama")

    class RawLogitsQ(DraftModelDrafter):
        def prepare(self, *args, **kwargs):  # it reads its raw logits
            return super().prepare(*args, **{**kwargs, "logits": True})

        def propose(self, contexts, num_tokens, sampling, generators):
            proposal = super().propose(contexts, num_tokens, sampling, generators)
            return Proposal(proposal.tokens, proposal.counts, torch.softmax(proposal.logits, -1), proposal.logits)

    warped = SamplingConfig(0.8, top_k=20, top_p=0.9)
    result, _ = _check_lossless(target, lambda: RawLogitsQ(draft), LOSSLESS_PROMPT, 2, 2400, warped, static_cache=True)
    assert result.p_value < 1e-3, result


# ------------------------------------------------------------------------- compilation


def _warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in caught]


def test_unavailable_compiler_falls_back_with_a_message(pairs, monkeypatch):
    target = copy.deepcopy(pairs("gpt_neox")[0])  # a model of its own: no compiled cache of an earlier test
    monkeypatch.setattr(compiler_module, "compile_unavailable", lambda device: "no C++ compiler here (test)")
    prompt = _ids(6, seed=15)
    with pytest.warns(UserWarning, match="torch.compile is off.*no C\\+\\+ compiler here"):
        out = generate(target, None, prompt, max_new_tokens=8, compile=True)
    kv = kv_module._STORES[target]["target", "default", 1]
    assert not kv.compiler.enabled and kv.compiler.error == "no C++ compiler here (test)"
    assert out.tokens == _hf_greedy(target, prompt, 8) and out.stats.compile_seconds == 0.0


def _compiling_fails(monkeypatch, message):
    """Every compiled function raises `message` on its first call (compiling is "available")."""

    def broken(self, fn):
        def compiled(*args):
            raise RuntimeError(message)

        return compiled

    monkeypatch.setattr(compiler_module.Compiler, "wrap", broken)
    monkeypatch.setattr(compiler_module, "compile_unavailable", lambda device: None)


def test_failing_compile_falls_back_with_a_message(pairs, monkeypatch):
    target, draft = (copy.deepcopy(m) for m in pairs("gpt_neox"))
    _compiling_fails(monkeypatch, "C++ compile error: cc1plus not found (test)")
    prompt = _ids(6, seed=16)
    out, messages = _warnings(
        lambda: generate(target, DraftModelDrafter(draft), prompt, max_new_tokens=10, num_draft_tokens=2, compile=True)
    )
    assert any(
        "off for the target: compiling width 3 failed (RuntimeError: C++ compile error" in m for m in messages
    ), messages
    # its own cache; a greedy draft compiles its whole chain (catch-up of width 1, then 2 draft steps)
    assert any("off for the draft: compiling a 2-token chain after width 1 failed" in m for m in messages), messages
    for model, role in ((target, "target"), (draft, "draft")):
        assert not kv_module._STORES[model][role, "default", 1].compiler.enabled
    assert out.tokens == _hf_greedy(target, prompt, 10)


def test_failing_compile_of_the_heads_falls_back(pairs, monkeypatch):
    target = copy.deepcopy(pairs("llama")[0])
    _compiling_fails(monkeypatch, "inductor failed (test)")
    prompt = _ids(9, seed=18)
    reference = _hf_greedy(target, prompt, 10)
    medusa, _ = _oracle(target, prompt, 10)
    layers = target.config.num_hidden_layers
    out, messages = _warnings(
        lambda: generate(
            target, MedusaDrafter(medusa, layers), prompt, max_new_tokens=10, num_draft_tokens=3, compile=True
        )
    )
    assert any("compiling the Medusa heads failed (RuntimeError: inductor failed" in m for m in messages), messages
    assert out.tokens == reference and out.stats.compile_seconds < 1.0


def _real_head(target, version, seed=0):
    from draftsmith.heads.eagle import EagleHead

    torch.manual_seed(seed)
    return EagleHead.for_target(target, version).eval()


class Proposals(EagleDrafter):
    def start(self, prompts, prefill, vocab_size):
        super().start(prompts, prefill, vocab_size)
        self.seen = []

    def propose(self, contexts, num_tokens, sampling, generators):
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        self.seen.append((proposal.tokens[0, : proposal.counts[0]].tolist(), proposal.parents))
        return proposal


def _same_proposals(target, head, prompt, tree, **fast):
    """The real EagleHead (decode through the model's own layers) proposes the same tokens on
    the fast path as on the default one, along the same decode."""
    eager, quick = Proposals(head, tree=tree), Proposals(head, tree=tree)
    a = generate(target, eager, prompt, max_new_tokens=21, num_draft_tokens=K)
    b = generate(target, quick, prompt, max_new_tokens=21, num_draft_tokens=K, **fast)
    assert b.tokens == a.tokens and b.stats.accepted == a.stats.accepted
    assert quick.seen == eager.seen and len(eager.seen) > 3
    return b


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_a_real_eagle_head_proposes_the_same_on_the_static_path(version, pairs):
    target, _ = pairs("llama")
    head = _real_head(target, version)
    for tree in (None, EAGLE_TREE):
        # the prompt's long catch-up (fed uncompiled), then catch-ups of 1..K + 1 pairs
        _same_proposals(target, head, _ids(26, seed=12), tree, static_cache=True)
        _same_proposals(target, head, _ids(2, seed=13), tree, static_cache=True)


COMPILED = pytest.mark.xdist_group("compiled")  # one worker: these share the session's compiled graphs


@pytest.mark.slow
@COMPILED
def test_a_real_eagle_head_compiled(pairs):
    target, _ = pairs("llama")
    head = _real_head(target, "eagle3")
    for tree in (None, EAGLE_TREE):  # the target and the head compiled, each on its static store
        _same_proposals(target, head, _ids(26, seed=12), tree, compile=True)
        _same_proposals(target, head, _ids(9, seed=14), tree, compile=True)


@pytest.mark.slow
@COMPILED
def test_compiled_greedy_is_identical_for_every_drafter(pairs):
    target, draft = pairs("llama")
    prompts = [_ids(9, seed=11)]  # one prompt: every head kind compiles per prompt (oracle heads)
    _check_greedy(target, draft, prompts, num_new=21, compile=True)
    kv = kv_module._STORES[target]["target", "default", 1]
    assert kv.compiler.enabled and kv.compiler.error is None
    # target-only, K + 1 of the chains, every proposal size of prompt lookup, the trees' sizes + 1
    assert {1, 2, 3, 4, 5, 11}.issubset({width for _, width in kv._compiled})
    assert kv.compiler.seconds > 0
    # Warm: a second run compiles nothing.
    out = generate(target, DraftModelDrafter(draft), prompts[0], max_new_tokens=21, num_draft_tokens=3, compile=True)
    assert out.stats.compile_seconds < 0.5 and out.tokens == _hf_greedy(target, prompts[0], 21)


@pytest.mark.slow
@COMPILED
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_compiled_heads_take_prompts_of_every_length(kind, pairs):
    """A head's first input comes from the prefill, whose shapes and strides follow the prompt's
    length: more lengths than dynamo's recompile limit (8) must still decode on the compiled heads."""
    target, _ = pairs("llama")
    if kind == "medusa":
        medusa, _ = _oracle(target, _ids(9, seed=11), 6)
        drafter = MedusaDrafter(medusa, target.config.num_hidden_layers)
    else:
        eagle, _ = _oracle_head(target, _ids(9, seed=11), "eagle3", 11, num_new=6, draft_vocab=200)
        drafter = EagleDrafter(eagle)
    for length in range(5, 15):
        prompt = _ids(length, seed=length)
        out = generate(target, drafter, prompt, max_new_tokens=6, num_draft_tokens=NUM_HEADS, compile=True)
        assert out.tokens == _hf_greedy(target, prompt, 6), length


@pytest.mark.slow
@COMPILED
@pytest.mark.parametrize("kind", ["draft", "medusa-tree", "eagle-tree"])  # the EAGLE chain: its greedy identity
def test_compiled_sampling_is_lossless(kind, pairs):
    target, draft = pairs("llama")
    make, k, runs = _informed_drafters(target, draft)[kind]
    result, stats = _check_lossless(target, make, LOSSLESS_PROMPT, k, runs, compile=True)
    assert 0 < sum(stats.accepted) < sum(stats.proposed), (kind, stats.accepted[:10])
    assert result.p_value > 1e-3, (kind, result)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_greedy_is_identical(pairs):
    target, draft = (copy.deepcopy(m).cuda() for m in pairs("llama"))
    prompt = _ids(12, seed=17).cuda()
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    for drafter in (None, DraftModelDrafter(draft)):
        out = generate(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=3, compile=True)
        assert out.tokens == reference
    assert kv_module._STORES[target]["target", "default", 1].compiler.error is None


@pytest.mark.parametrize("flag", ["--static-cache", pytest.param("--compile", marks=[pytest.mark.slow, COMPILED])])
def test_eval_command_on_the_fast_path(flag, toy_dir, tmp_path, run_cli):
    """`draftsmith eval --static-cache / --compile` decodes the same tokens as the default path
    (greedy: the same acceptance counts) and says which path it timed. The prompts are the first
    lines of the toy prompts: their requests fit the 128-slot cache of the compiled tests above,
    so that `--compile` builds the graphs they built (found in inductor's cache)."""
    prompts = first_line_prompts(toy_dir, tmp_path / "prompts.jsonl", 3)
    settings = dict(prompts=prompts, limit=3, max_new_tokens=12, k=3, progress=True)
    _, fast, stdout = assert_fast_path_decodes_the_same(
        run_cli, toy_dir, flag, tmp_path, "--draft", toy_dir / "draft", **settings
    )
    assert ("compiled (default): compile time" if flag == "--compile" else "static KV cache") in stdout
    assert fast["settings"]["static_cache"] is True
