"""The static-cache (and compiled) decoding path against the default one.

- the adapter: incremental feeding, tree verification, `keep` and padded calls give the logits
  of the dynamic-cache `CausalLMAdapter`; a forward past the preallocated length raises and
  writes nothing; `reserve` grows the cache without losing what it holds;
- greedy: token-identical to HF greedy and to the eager decoder (same accepted counts) for every
  drafter kind: target only, draft model, Medusa chain and tree, EAGLE chain and tree;
- sampling: chi-square of the first two tokens against the target's exact law, for every
  drafter kind on the static path;
- heads read the hidden states the verification produced (`observe`): the same states as on
  the dynamic path, and no extra target forward;
- compiled: a reduced set of the above (slow: inductor compiles C++), and the fallback when
  compilation is unavailable or fails.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.eval.runtime import DecodeStats, generate
from draftsmith.eval.runtime.drafters import Drafter, DraftModelDrafter, MedusaDrafter, PromptLookupDrafter, Proposal
from draftsmith.eval.runtime.eagle import EagleDrafter
from draftsmith.eval.runtime.sampling import SamplingConfig
from draftsmith.eval.stats import chi_square_gof
from draftsmith.heads import static_target
from draftsmith.heads.static_target import StaticCacheOverflow, StaticCausalLMAdapter, static_adapter
from draftsmith.heads.target import CausalLMAdapter, tree_attention_mask
from fixtures import VOCAB, tiny_config
from test_eagle_drafter import FakeCache, _oracle_head
from test_tree import NUM_HEADS, _oracle, informed_medusa
from test_tree import TREE as MEDUSA_TREE

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


# ------------------------------------------------------------------------------ adapter


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_adapter_matches_the_dynamic_cache(family, pairs):
    """Prefill, a chain, a crop, a tree with `keep` (entries move), then more tokens: every
    output equals the dynamic-cache adapter's."""
    model, _ = pairs(family)
    dynamic, static = CausalLMAdapter(model), StaticCausalLMAdapter(model, 64)
    ids = _ids(30, seed=1)
    layers = (0, model.config.num_hidden_layers)
    for adapter in (dynamic, static):
        adapter.reset()
    a, b = (x.forward(ids[None, :12], logits_to_keep=1, hidden_layers=layers) for x in (dynamic, static))
    _close(b.logits, a.logits, "prefill, last logits")
    for i in layers:
        _close(b.hidden_states[i], a.hidden_states[i], f"prefill, hidden {i}")
    a, b = (x.forward(ids[None, 12:17], hidden_layers=layers) for x in (dynamic, static))
    _close(b.logits, a.logits, "chain of 5")
    _close(b.hidden_states[layers[1]], a.hidden_states[layers[1]], "chain of 5, last hidden")
    for x in (dynamic, static):
        x.crop(14)
    parents = [-1, 0, 0, 1, 2, 2, 4]
    mask, depth = tree_attention_mask(parents, past_len=14)
    positions = (14 + depth)[None]
    a, b = (x.forward(ids[None, 17:24], position_ids=positions, attention_mask=mask) for x in (dynamic, static))
    _close(b.logits, a.logits, "tree")
    for x in (dynamic, static):
        x.keep(14, [0, 2, 5])  # node 0, then the second branch: entries 16 and 19 move to 15, 16
    assert static.seq_len == dynamic.seq_len == 17
    a, b = (x.forward(ids[None, 24:30]) for x in (dynamic, static))
    _close(b.logits, a.logits, "after keep")


def test_padded_calls_match_exact_calls(pairs):
    """A call narrower than a compiled width is padded: junk rows past the length, never seen.
    Checked without a compiler by registering the uncompiled step as a width-8 graph."""
    model, _ = pairs("llama")
    exact, padded = StaticCausalLMAdapter(model, 64), StaticCausalLMAdapter(model, 64)
    for key in (((), False), ((2,), False)):
        padded._compiled[(key, 8)] = padded._eager_step(key)
    ids = _ids(20, seed=2)
    for x in (exact, padded):
        x.reset()
        x.forward(ids[None, :9])
    a, b = (x.forward(ids[None, 9:12], hidden_layers=(2,)) for x in (exact, padded))
    assert b.logits.shape == a.logits.shape == (1, 3, VOCAB)
    _close(b.logits, a.logits, "padded chain")
    _close(b.hidden_states[2], a.hidden_states[2], "padded chain, hidden")
    mask, depth = tree_attention_mask([-1, -1, 0], past_len=12)
    a, b = (x.forward(ids[None, 12:15], position_ids=(12 + depth)[None], attention_mask=mask) for x in (exact, padded))
    _close(b.logits, a.logits, "padded tree")
    for x in (exact, padded):
        x.keep(12, [1, 2])
    a, b = (x.forward(ids[None, 15:17]) for x in (exact, padded))  # the padding's junk is overwritten
    _close(b.logits, a.logits, "after the padded calls")


def test_overflow_raises_and_writes_nothing(pairs):
    model, _ = pairs("llama")
    adapter = StaticCausalLMAdapter(model, 100)
    capacity = adapter.capacity
    assert capacity >= 100 and capacity % static_target.CAPACITY_STEP == 0
    ids = _ids(capacity, seed=3)
    adapter.reset()
    adapter.forward(ids[None, : capacity - 4])
    reference = adapter.forward(ids[None, capacity - 4 : capacity - 2]).logits
    adapter.crop(capacity - 4)
    with pytest.raises(StaticCacheOverflow, match=rf"holds {capacity - 4} tokens and 5 more.*preallocated for {capacity}"):
        adapter.forward(_ids(5, seed=4)[None])
    assert adapter.seq_len == capacity - 4
    _close(adapter.forward(ids[None, capacity - 4 : capacity - 2]).logits, reference, "after the refused call")
    with pytest.raises(StaticCacheOverflow):  # a greedy chain that runs out of room mid-way
        adapter.greedy_chain(ids[None, :1], 6)
    assert isinstance(StaticCacheOverflow("x"), ValueError)


def test_a_proposal_larger_than_promised_cannot_overflow(pairs):
    """A drafter that proposes more than its `proposal_sizes` allow gets a clear error near the end of
    the preallocated cache, not a write past it."""
    target, _ = pairs("llama")

    class Liar(Drafter):
        def proposal_sizes(self, num_tokens):
            return (1,)

        def propose(self, context, num_tokens, sampling, generator=None):
            return Proposal(tokens=torch.arange(3, 43), parents=[-1] * 40)  # 40 siblings: depth 1

    adapter = StaticCausalLMAdapter(target, 100)
    prompt = _ids(adapter.capacity - 30, seed=5)
    with pytest.raises(StaticCacheOverflow, match="static KV cache overflow"):
        generate(adapter, Liar(), prompt, max_new_tokens=10, num_draft_tokens=2)


def test_reserve_grows_and_keeps_the_entries(pairs):
    model, _ = pairs("qwen2")
    adapter, dynamic = StaticCausalLMAdapter(model, 10), CausalLMAdapter(model)
    small = adapter.capacity
    ids = _ids(small + 40, seed=6)
    for x in (adapter, dynamic):
        x.reset()
        x.forward(ids[None, :50])
    adapter.reserve(small + 40)
    assert adapter.capacity >= small + 40 and adapter.seq_len == 50
    a, b = (x.forward(ids[None, 50 : small + 40]) for x in (dynamic, adapter))
    _close(b.logits, a.logits, "after growing")


def test_generate_sizes_the_cache_for_the_request(pairs):
    target, _ = pairs("llama")
    adapter = StaticCausalLMAdapter(target, 8)
    prompt = _ids(140, seed=7)
    out = generate(adapter, None, prompt, max_new_tokens=20)
    assert adapter.capacity >= 160
    assert out.tokens == generate(target, None, prompt, max_new_tokens=20).tokens


def test_sliding_window_models_are_refused():
    config = tiny_config("mistral")
    config.sliding_window = 6
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="sliding window.*static_cache=False"):
        StaticCausalLMAdapter(model, 32)


def test_settings_are_checked(pairs):
    target, _ = pairs("llama")
    prompt = _ids(5, seed=8)
    with pytest.raises(ValueError, match="adapter is used as it is"):
        generate(CausalLMAdapter(target), None, prompt, max_new_tokens=2, static_cache=True)
    with pytest.raises(ValueError, match="compile must be"):
        generate(target, None, prompt, max_new_tokens=2, compile="fastest")
    with pytest.raises(ValueError, match="logits_to_keep"):
        StaticCausalLMAdapter(target, 16).forward(prompt[None], logits_to_keep=3)
    adapter = StaticCausalLMAdapter(target, 16)
    adapter.forward(prompt[None, :2])
    mask, depth = tree_attention_mask([-1, 0], past_len=2)
    mask[..., 0] = torch.finfo(mask.dtype).min  # a node that does not see the whole cache
    with pytest.raises(ValueError, match="see the whole cache"):
        adapter.forward(prompt[None, 2:4], position_ids=(2 + depth)[None], attention_mask=mask)
    # One adapter per model and role: a model drafting for itself gets a second cache.
    assert static_adapter(target, 10) is static_adapter(target, 10)
    assert static_adapter(target, 10, role="draft") is not static_adapter(target, 10)


# ------------------------------------------------------------------ greedy: every drafter


def _drafters(target, draft, prompt, num_new, seed):
    """name -> (drafter factory, K) for every drafter kind, with heads that know the target's
    greedy continuation of `prompt` (so that long paths and sideways tree paths occur). The
    factories take the draft model's static_cache/compile settings (heads have no model)."""
    layers = target.config.num_hidden_layers
    medusa, _ = _oracle(target, prompt, num_new, seed=seed)
    eagle, _ = _oracle_head(target, prompt, "eagle3", seed, num_new=num_new, draft_vocab=200)
    return {
        "target-only": (lambda **fast: None, 1),
        "draft": (lambda **fast: DraftModelDrafter(draft, **fast), 3),
        "prompt-lookup": (lambda **fast: PromptLookupDrafter(), 3),  # proposals of 0..3 tokens
        "medusa-chain": (lambda **fast: MedusaDrafter(medusa, layers, compile=fast.get("compile", False)), NUM_HEADS),
        "medusa-tree": (lambda **fast: MedusaDrafter(medusa, layers, tree=MEDUSA_TREE, compile=fast.get("compile", False)), NUM_HEADS),
        "eagle-chain": (lambda **fast: EagleDrafter(eagle, cache_factory=FakeCache, **fast), K),
        "eagle-tree": (lambda **fast: EagleDrafter(eagle, tree=EAGLE_TREE, cache_factory=FakeCache, **fast), K),
    }


def _check_greedy(target, draft, prompts, num_new, **fast):
    """Every drafter on the fast path (`fast`: generate's static_cache/compile, also given to
    the draft model): the tokens of HF greedy and the eager decoder's accepted counts."""
    accepted = {}
    for i, prompt in enumerate(prompts):
        reference = _hf_greedy(target, prompt, num_new)
        for name, (make, k) in _drafters(target, draft, prompt, num_new, seed=i).items():
            eager = generate(target, make(), prompt, max_new_tokens=num_new, num_draft_tokens=k)
            out = generate(target, make(**fast), prompt, max_new_tokens=num_new, num_draft_tokens=k, **fast)
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
    out = generate(target, DraftModelDrafter(target, static_cache=True), prompt, max_new_tokens=20,
                   num_draft_tokens=3, static_cache=True)
    assert out.tokens == _hf_greedy(target, prompt, 20)
    assert out.stats.accepted[:-1] == out.stats.proposed[:-1] and sum(out.stats.accepted) > 10


# ------------------------------------------------------- heads read the verify step's states


class _Counting(StaticCausalLMAdapter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


class _Observed:
    """Wraps a drafter's `observe` to record what it was handed."""

    def __init__(self, drafter):
        self.drafter, self.states = drafter, []
        inner = drafter.observe

        def observe(hidden):
            self.states.append({i: h.clone() for i, h in hidden.items()})
            inner(hidden)

        drafter.observe = observe


@pytest.mark.parametrize("kind", ["medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree"])
def test_heads_use_the_verification_states(kind, pairs):
    """The states a head drafts from are the ones the verification forward produced: equal to
    the dynamic path's, and no target forward beyond the prefill and one per call."""
    target, draft = pairs("llama")
    prompt = _ids(11, seed=14)
    make, k = _drafters(target, draft, prompt, 18, seed=3)[kind]
    runs = []
    for adapter in (CausalLMAdapter(target), _Counting(target, 64)):
        recorder = _Observed(make())
        runs.append((generate(adapter, recorder.drafter, prompt, max_new_tokens=18, num_draft_tokens=k), recorder, adapter))
    (eager, seen_eager, _), (static, seen_static, counting) = runs
    assert static.tokens == eager.tokens
    assert counting.calls == 1 + static.stats.target_calls  # the prefill, then one per call
    assert len(seen_static.states) == len(seen_eager.states) == counting.calls
    for a, b in zip(seen_eager.states, seen_static.states):
        assert a.keys() == b.keys()
        for i in a:
            assert a[i].shape == b[i].shape
            _close(b[i], a[i], f"{kind}: observed layer {i}")


# --------------------------------------------------------------- sampling: chi-square


def _exact_joint(model, prompt, sampling):
    """p(t1) p(t2 | t1) for every (t1, t2): one forward for t1, one batched over all V t1."""
    with torch.no_grad():
        p1 = sampling.probs(model(prompt[None]).logits[0, -1])
        batch = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        p2 = sampling.probs(model(batch).logits[:, -1])
    return p1.double()[:, None] * p2.double()


PLAIN = SamplingConfig(1.0)


def _check_lossless(target, make, prompt, k, runs, sampling=PLAIN, **fast):
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    stats = DecodeStats()
    for seed in range(runs):
        out = generate(target, make(), prompt, max_new_tokens=k + 1, num_draft_tokens=k,
                       temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                       seed=seed, **fast)
        counts[out.tokens[0], out.tokens[1]] += 1
        stats = stats + out.stats
    return chi_square_gof(counts, _exact_joint(target, prompt, sampling)), stats


LOSSLESS_PROMPT = torch.tensor([1, 5, 77, 140, 9])


def _informed_drafters(target, draft, **fast):
    """name -> (factory, K, runs): drafters that are right often enough at LOSSLESS_PROMPT for
    every branch (accept, reject, residual) to run within a few hundred decodes."""
    prompt = LOSSLESS_PROMPT
    medusa = informed_medusa(target, prompt)
    eagle, _ = _oracle_head(target, prompt, "eagle3", seed=61, draft_vocab=256, miss=0.0)
    eagle_tree = {"depth": 2, "top_k": 2, "total_tokens": 5}
    compile = fast.get("compile", False)
    return {
        "draft": (lambda: DraftModelDrafter(draft, **fast), 2, 1000),
        "medusa-chain": (lambda: MedusaDrafter(medusa, 2, compile=compile), 2, 800),
        "medusa-tree": (lambda: MedusaDrafter(medusa, 2, tree=[(0, 0), (0, 1), (1, 0), (2,)], compile=compile), 2, 800),
        "eagle-chain": (lambda: EagleDrafter(eagle, cache_factory=FakeCache, **fast), 2, 800),
        "eagle-tree": (lambda: EagleDrafter(eagle, tree=eagle_tree, cache_factory=FakeCache, **fast), 2, 800),
    }


@pytest.mark.parametrize("kind", ["draft", "medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree"])
def test_sampling_is_lossless_on_the_static_path(kind, pairs):
    target, draft = pairs("llama")
    make, k, runs = _informed_drafters(target, draft, static_cache=True)[kind]
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
        def propose(self, context, num_tokens, sampling, generator=None):
            proposal = super().propose(context, num_tokens, sampling, generator)
            return Proposal(proposal.tokens, torch.softmax(proposal.logits, -1), proposal.logits)

    warped = SamplingConfig(0.8, top_k=20, top_p=0.9)
    result, _ = _check_lossless(target, lambda: RawLogitsQ(draft, static_cache=True), LOSSLESS_PROMPT, 2, 2400,
                                warped, static_cache=True)
    assert result.p_value < 1e-3, result


# ------------------------------------------------------------------------- compilation


def test_unavailable_compiler_falls_back_with_a_message(pairs, monkeypatch):
    target, _ = pairs("gpt_neox")
    monkeypatch.setattr(static_target, "compile_unavailable", lambda device: "no C++ compiler here (test)")
    with pytest.warns(UserWarning, match="torch.compile is off.*no C\\+\\+ compiler here"):
        adapter = StaticCausalLMAdapter(target, 32, compile=True)
    assert not adapter.compile and adapter.compile_error == "no C++ compiler here (test)"
    prompt = _ids(6, seed=15)
    out = generate(adapter, None, prompt, max_new_tokens=8)
    assert out.tokens == _hf_greedy(target, prompt, 8) and out.stats.compile_seconds == 0.0


def _compiling_fails(monkeypatch, message):
    """Every compiled function raises `message` on its first call (compiling is "available")."""

    def broken(self, fn):
        def compiled(*args):
            raise RuntimeError(message)

        return compiled

    monkeypatch.setattr(static_target.Compiler, "wrap", broken)
    monkeypatch.setattr(static_target, "compile_unavailable", lambda device: None)


def test_failing_compile_falls_back_with_a_message(pairs, monkeypatch):
    target, draft = pairs("gpt_neox")
    _compiling_fails(monkeypatch, "C++ compile error: cc1plus not found (test)")
    adapter = StaticCausalLMAdapter(target, 32, compile=True)
    drafter = DraftModelDrafter(copy.deepcopy(draft), compile=True)
    prompt = _ids(6, seed=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(adapter, drafter, prompt, max_new_tokens=10, num_draft_tokens=2)
    messages = [str(w.message) for w in caught]
    assert any("compiling width 3 failed (RuntimeError: C++ compile error" in m for m in messages), messages
    assert any("chain failed" in m for m in messages), messages  # the drafter's own adapter
    assert not adapter.compile and not drafter.adapter.compile
    assert out.tokens == _hf_greedy(target, prompt, 10)


def test_failing_compile_of_the_heads_falls_back(pairs, monkeypatch):
    target, _ = pairs("llama")
    _compiling_fails(monkeypatch, "inductor failed (test)")
    prompt = _ids(9, seed=18)
    reference = _hf_greedy(target, prompt, 10)
    medusa, _ = _oracle(target, prompt, 10)
    layers = target.config.num_hidden_layers
    adapter = StaticCausalLMAdapter(target, 64)  # uncompiled: only the heads fail
    for drafter, what in (
        (EagleDrafter(_real_head(target, "eagle3"), compile=True), "an EAGLE chain proposal failed"),
        (MedusaDrafter(medusa, layers, compile=True), "the Medusa heads failed"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(adapter, drafter, prompt, max_new_tokens=10, num_draft_tokens=3)
        assert any(what in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert out.tokens == reference and out.stats.compile_seconds < 1.0


def _real_head(target, version, seed=0):
    from draftsmith.heads.eagle import EagleHead

    torch.manual_seed(seed)
    return EagleHead.for_target(target, version).eval()


class Proposals(EagleDrafter):
    def start(self, prompt_ids):
        super().start(prompt_ids)
        self.seen = []

    def propose(self, context, num_tokens, sampling, generator=None):
        proposal = super().propose(context, num_tokens, sampling, generator)
        self.seen.append((proposal.tokens.tolist(), proposal.parents))
        return proposal


def _same_proposals(target, head, prompt, tree, **fast):
    """The real EagleHead (decode through the model's own layers) proposes the same tokens on
    the fast path as eagerly, along the same decode."""
    eager, quick = Proposals(head, tree=tree), Proposals(head, tree=tree, **fast)
    a = generate(target, eager, prompt, max_new_tokens=21, num_draft_tokens=K)
    b = generate(target, quick, prompt, max_new_tokens=21, num_draft_tokens=K, **fast)
    assert b.tokens == a.tokens and b.stats.accepted == a.stats.accepted
    assert quick.seen == eager.seen and len(eager.seen) > 3
    return b


def test_eagle_static_cache_overflow_raises_and_writes_nothing(pairs):
    target, _ = pairs("llama")
    head = _real_head(target, "eagle3", seed=3)
    drafter = EagleDrafter(head, static_cache=True)
    drafter.reserve(8, 3, SamplingConfig())  # room for 8 pairs + a proposal: 128 slots
    capacity = drafter.fast.cache.capacity
    context = _ids(capacity + 2, seed=19)
    drafter.start(context)
    with torch.no_grad():
        hidden = target(context[None], output_hidden_states=True).hidden_states
    drafter.observe({i: hidden[i][0] for i in drafter.target_layers})
    assert len(drafter.propose(context[:6], 3, SamplingConfig())) == 3  # fits: the buffers now exist
    before = drafter.fast.cache.keys.clone()
    with pytest.raises(StaticCacheOverflow, match=f"preallocated for {capacity}.*nothing was written"):
        drafter.propose(context, 3, SamplingConfig())
    assert torch.equal(drafter.fast.cache.keys, before)


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_a_real_eagle_head_proposes_the_same_on_the_static_path(version, pairs):
    target, _ = pairs("llama")
    head = _real_head(target, version)
    for tree in (None, EAGLE_TREE):
        # the prompt's long catch-up (fed uncompiled), then catch-ups of 1..K + 1 pairs
        _same_proposals(target, head, _ids(26, seed=12), tree, static_cache=True)
        _same_proposals(target, head, _ids(2, seed=13), tree, static_cache=True)


@pytest.mark.slow
def test_a_real_eagle_head_compiled(pairs):
    target, _ = pairs("llama")
    head = _real_head(target, "eagle3")
    for tree in (None, EAGLE_TREE):
        out = _same_proposals(target, head, _ids(26, seed=12), tree, compile=True)
        assert out.stats.compile_seconds > 0  # the first request compiles the proposal
        out = _same_proposals(target, head, _ids(9, seed=14), tree, compile=True)
        assert out.stats.compile_seconds < 0.5  # shared by every drafter over the head
    from draftsmith.eval.runtime.eagle import _static_draft

    fast = _static_draft(head, True)
    assert fast.compiler.error is None and set(fast._compiled) == {("chain", K), ("tree", EAGLE_TREE["depth"], EAGLE_TREE["top_k"])}


@pytest.mark.slow
def test_compiled_greedy_is_identical_for_every_drafter(pairs):
    target, draft = pairs("llama")
    prompts = [_ids(9, seed=11)]  # one prompt: every head kind compiles per prompt (oracle heads)
    _check_greedy(target, draft, prompts, num_new=21, compile=True)
    adapter = static_adapter(target, 64, compile=True)
    assert adapter.compile and adapter.compile_error is None
    # target-only, K + 1 of the chains, every proposal size of prompt lookup, the trees' sizes + 1
    assert {1, 2, 3, 4, 5, 11}.issubset(adapter.compiled_widths)
    assert adapter.compile_seconds > 0
    # Warm: a second run compiles nothing.
    out = generate(target, DraftModelDrafter(draft, compile=True), prompts[0], max_new_tokens=21,
                   num_draft_tokens=3, compile=True)
    assert out.stats.compile_seconds < 0.5 and out.tokens == _hf_greedy(target, prompts[0], 21)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "medusa-tree", "eagle-tree"])  # the EAGLE chain: its greedy identity
def test_compiled_sampling_is_lossless(kind, pairs):
    target, draft = pairs("llama")
    make, k, runs = _informed_drafters(target, draft, compile=True)[kind]
    result, stats = _check_lossless(target, make, LOSSLESS_PROMPT, k, runs, compile=True)
    assert 0 < sum(stats.accepted) < sum(stats.proposed), (kind, stats.accepted[:10])
    assert result.p_value > 1e-3, (kind, result)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_greedy_is_identical(pairs):
    target, draft = (copy.deepcopy(m).cuda() for m in pairs("llama"))
    prompt = _ids(12, seed=17).cuda()
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    for drafter in (None, DraftModelDrafter(draft, compile=True)):
        out = generate(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=3, compile=True)
        assert out.tokens == reference
    assert static_adapter(target, 64, compile=True).compile_error is None



@pytest.mark.parametrize("flag", ["--static-cache", pytest.param("--compile", marks=pytest.mark.slow)])
def test_eval_command_on_the_fast_path(flag, toy_dir, tmp_path, run_cli):
    """`draftsmith eval --static-cache / --compile` decodes the same tokens as the default path
    (greedy: the same acceptance counts) and says which path it timed."""
    import json

    def evaluate(out, *extra):
        args = ["eval", "--target", toy_dir / "target", "--draft", toy_dir / "draft", "--prompts", toy_dir / "prompts.jsonl",
                "--limit", 3, "--max-new-tokens", 12, "-k", 3, "--repeats", 1, "--no-distances", "--device", "cpu", "--out", out, *extra]  # fmt: skip
        code, stdout, _ = run_cli(args)
        assert code == 0
        return json.loads((out / "report.json").read_text()), stdout

    plain, _ = evaluate(tmp_path / "plain")
    fast, stdout = evaluate(tmp_path / "fast", flag)
    assert ("compiled (default): compile time" if flag == "--compile" else "static KV cache") in stdout
    rows = {r["method"]: r for r in plain["methods"]}
    for row in fast["methods"]:
        assert (row["new_tokens"], row["target_calls"]) == (rows[row["method"]]["new_tokens"], rows[row["method"]]["target_calls"])
    assert fast["settings"]["static_cache"] is True
