"""Batched speculative decoding (`decoding/`) against batch-1 decoding and HF greedy.

- greedy: every row of a batch of prompts of different lengths equals that row decoded alone
  (`generate`, B = 1) and HF `generate`, for target-only, a draft model, Medusa heads and an
  EAGLE-3 head, and rows accept different numbers of drafts in the same call;
- trees (Medusa, EAGLE-2), prompt lookup and typical acceptance at batch 4: per row the
  target-only greedy tokens, on several families and on both stores of the cache (which agree
  token for token and count for count); chi-square of the first two tokens at T = 1;
- stats: per-row counters equal batch-1's; pooled tau / alpha equal the batch-1 sum;
- eos stops its row only; rows leaving the batch change nothing for the others (also sampled);
- sampling: the joint law of the first two tokens of every prompt equals the target's exact
  p(t1) p(t2 | t1) (chi-square), and row b draws exactly what batch-1 draws with row_seed(seed, b);
- the ragged cache's moves (mask, append, retain, select, compact) on a cache of column ids;
- bad input.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fixtures import FAMILIES, VOCAB, tiny_config

from draftsmith.decoding import DecodeStats, generate, generate_batch, row_seed
from draftsmith.decoding import kv as kv_module
from draftsmith.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.kv import KVStore
from draftsmith.decoding.masks import chain_attend
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.eval.stats import chi_square_gof
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.medusa import MedusaHeads

N_NEW = 24
LENGTHS = (1, 6, 13, 3)  # a one-token prompt: Medusa and EAGLE have no state before its first call
K = {
    "target-only": 0,
    "draft": 3,
    "medusa": 3,
    "eagle3": 4,
    "medusa-tree": 3,
    "eagle-tree": 4,
    "lookup": 3,
    "medusa-typical": 3,
}
MEDUSA_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]
EAGLE_TREE = {"depth": 3, "top_k": 3, "total_tokens": 10}
TYPICAL = (0.09, 0.3)
GREEDY = SamplingConfig()
T1 = SamplingConfig(1.0)


def _prompts(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


PROMPTS = _prompts()
# For the chi-square tests: prompts whose first two tokens are spread over several likely pairs
# (>= 5 pairs with an expected count >= 5 out of 250 samples).
SAMPLING_PROMPTS = _prompts((4, 9, 2, 14), seed=1)


@torch.no_grad()
def _hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    ids = prompt.unsqueeze(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1] :].tolist()


def _train_eagle3(target, prompts, steps=15) -> EagleHead:
    """A real EAGLE-3 head fitted for a few steps on the target's greedy continuations of the
    prompts (next-next token from (token, feature) pairs, teacher forced): its first draft is
    usually right, later ones (fed its own g) often not, so acceptance is ragged."""
    seqs = [torch.cat([p, torch.tensor(_hf_greedy(target, p, N_NEW + 16))]) for p in prompts]
    torch.manual_seed(0)
    head = EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, 1, 2])  # 2 = last layer, post-norm
    with torch.no_grad():
        states = [target(s[None], output_hidden_states=True).hidden_states for s in seqs]
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for seq, hs in zip(seqs, states):
            features = head.project(torch.cat([hs[i][0] for i in head.config.aux_layer_ids], -1))
            _, logits = head(seq[None, 1:-1], features[None, :-2], position_ids=torch.arange(seq.numel() - 2)[None])
            loss = loss + torch.nn.functional.cross_entropy(logits[0], seq[2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def setup(pairs):
    """The llama pair, Medusa heads (at init: copies of the target's lm_head, right when the
    target repeats itself), a fitted EAGLE-3 head, and the HF greedy references."""
    target, draft = pairs("llama")
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(target, num_heads=3).eval()
    head = _train_eagle3(target, PROMPTS)
    references = [_hf_greedy(target, p, N_NEW) for p in PROMPTS]
    return target, draft, heads, head, references


def _drafters(name, setup):
    """(batched drafter, batch-1 drafter) for a name."""
    target, draft, heads, head, _ = setup
    layers = target.config.num_hidden_layers
    return {
        "target-only": lambda: (None, None),
        "draft": lambda: (DraftModelDrafter(draft), DraftModelDrafter(draft)),
        "medusa": lambda: (MedusaDrafter(heads), MedusaDrafter(heads, layers)),  # layers from the heads' config
        "eagle3": lambda: (EagleDrafter(head), EagleDrafter(head)),
        **{kind: (lambda make=make: (make(), make())) for kind, make in _tree_drafters(heads, head).items()},
    }[name]()


def _tree_drafters(heads, head) -> dict:
    """name -> factory of the drafters that verify node by node, or propose ragged chains."""
    return {
        "medusa-tree": lambda: MedusaDrafter(heads, tree=MEDUSA_TREE),
        "eagle-tree": lambda: EagleDrafter(head, tree=EAGLE_TREE),
        "lookup": PromptLookupDrafter,  # proposals of 0..K tokens per row
        "medusa-typical": lambda: MedusaDrafter(heads, tree=MEDUSA_TREE, typical=TYPICAL),
    }


def _batch1(target, drafter, prompt, k, sampling=GREEDY, seed=None, **kwargs):
    return generate(
        target,
        drafter,
        prompt,
        max_new_tokens=kwargs.pop("max_new_tokens", N_NEW),
        num_draft_tokens=max(k, 1),
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=seed,
        **kwargs,
    )


def _ragged_calls(result) -> int:
    """Calls in which the rows still decoding accepted different numbers of drafts."""
    calls = max(len(r.accepted) for r in result.rows)
    return sum(len({r.accepted[j] for r in result.rows if j < len(r.accepted)}) > 1 for j in range(calls))


@pytest.fixture(scope="module")
def greedy_run(setup):
    """`greedy_run(name)` -> (batched result, batch-1 generations per row) at greedy, once per drafter."""
    runs = {}

    def get(name):
        if name not in runs:
            target = setup[0]
            result = generate_batch(
                target, PROMPTS, _drafters(name, setup)[0], num_draft_tokens=K[name], max_new_tokens=N_NEW
            )
            alone = [_batch1(target, _drafters(name, setup)[1], p, K[name]) for p in PROMPTS]
            runs[name] = (result, alone)
        return runs[name]

    return get


# ----------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("name", list(K))
def test_greedy_rows_equal_batch1_and_hf(name, setup, greedy_run):
    references = setup[4]
    result, alone = greedy_run(name)
    for b, prompt in enumerate(PROMPTS):
        assert result.tokens[b] == alone[b].tokens == references[b], f"row {b} (prompt of {prompt.numel()})"
        assert result.stopped[b] == "length"
    if name == "target-only":
        assert result.stats.tau == 1.0 and result.target_calls == N_NEW
        return
    # The comparison only means something if the rows really went their own ways.
    assert sum(result.stats.accepted) > 0
    assert _ragged_calls(result) > 0, [r.accepted for r in result.rows]


@pytest.mark.parametrize("name", list(K))
def test_stats_equal_batch1(name, greedy_run):
    result, alone = greedy_run(name)
    pooled = DecodeStats()
    for b, single in enumerate(alone):
        row, ref = result.rows[b], single.stats
        assert row.num_draft_tokens == ref.num_draft_tokens == K[name]
        assert (row.proposed, row.accepted) == (ref.proposed, ref.accepted), f"row {b}"
        assert (row.reached, row.accepted_at) == (ref.reached, ref.accepted_at), f"row {b}"
        assert row.new_tokens == ref.new_tokens == len(result.tokens[b])
        pooled = pooled + ref
    stats = result.stats
    assert stats.tau == pytest.approx(pooled.tau)
    assert stats.alpha == pytest.approx(pooled.alpha)
    assert stats.alpha_per_position == pytest.approx(pooled.alpha_per_position)
    assert stats.new_tokens == result.new_tokens == pooled.new_tokens
    # Batch timers: one entry per call; every row took part in the calls up to its finish.
    assert len(result.call_seconds) == len(result.drafter_seconds) == len(result.call_rows) == result.target_calls
    assert result.call_rows[0] == len(PROMPTS) and result.call_rows == sorted(result.call_rows, reverse=True)
    assert sum(result.call_rows) == sum(r.target_calls for r in result.rows)
    assert result.target_calls == max(r.target_calls for r in result.rows)
    assert 0 < result.prefill_seconds < min(result.ttft_seconds) <= max(result.finish_seconds) <= result.total_seconds


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_families(family, pairs):
    """Each family's attention takes the ragged 4-D mask and explicit positions; eager too."""
    target, draft = pairs(family)
    prompts = _prompts((4, 1, 9), seed=3)
    for model, drafter in ((target, None), (target, DraftModelDrafter(draft))):
        result = generate_batch(model, prompts, drafter, num_draft_tokens=2, max_new_tokens=12)
        assert result.tokens == [_batch1(target, None, p, 0, max_new_tokens=12).tokens for p in prompts]
    if family == "llama":
        eager = type(target)(target.config).eval()
        eager.load_state_dict(target.state_dict())
        eager.set_attn_implementation("eager")
        result = generate_batch(eager, prompts, DraftModelDrafter(draft), num_draft_tokens=2, max_new_tokens=12)
        assert result.tokens == [_batch1(target, None, p, 0, max_new_tokens=12).tokens for p in prompts]


@pytest.mark.parametrize("name", ["draft", "medusa", "eagle3"])
def test_compaction_keeps_rows_exact(name, setup, monkeypatch):
    """Compacting at every hole (target and drafter caches) changes no token."""
    moved = []
    original = KVStore.compact_if_wasteful

    def spy(self):
        did = original(self)
        if did:
            moved.append(self)
        return did

    monkeypatch.setattr(kv_module, "COMPACT_WHEN", 0.0)
    monkeypatch.setattr(KVStore, "compact_if_wasteful", spy)
    result = generate_batch(
        setup[0], PROMPTS, _drafters(name, setup)[0], num_draft_tokens=K[name], max_new_tokens=N_NEW
    )
    assert result.tokens == setup[4]
    caches = {id(c): c for c in moved}
    # The target's cache always; the draft model's and the EAGLE head's own caches too.
    assert len(caches) == (1 if name == "medusa" else 2)
    assert len(moved) >= 3


@pytest.fixture(scope="module")
def family_heads(pairs):
    """`family_heads(family)` -> (Medusa heads at init, a fitted EAGLE-3 head) for that target."""
    made = {}

    def get(family):
        if family not in made:
            target, _ = pairs(family)
            torch.manual_seed(0)
            made[family] = (MedusaHeads.for_target(target, num_heads=3).eval(), _train_eagle3(target, PROMPTS))
        return made[family]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_batched_trees_and_lookup_on_both_stores(family, pairs, family_heads):
    """Batch 4: a Medusa tree, an EAGLE-2 tree, prompt lookup and Medusa's typical acceptance
    (exact argmax matching at T = 0) give every row the target-only greedy tokens, on the
    growing and on the preallocated store, which agree token for token and count for count."""
    target, _ = pairs(family)
    alone = [_batch1(target, None, p, 0).tokens for p in PROMPTS]
    accepted = {}
    for name, make in _tree_drafters(*family_heads(family)).items():
        runs = [
            generate_batch(target, PROMPTS, make(), num_draft_tokens=K[name], max_new_tokens=N_NEW, static_cache=static)
            for static in (False, True)
        ]
        growing, static = runs
        for b in range(len(PROMPTS)):
            assert growing.tokens[b] == alone[b], (name, "growing", b)
            assert static.tokens[b] == alone[b], (name, "static", b)
        assert [(r.proposed, r.accepted) for r in static.rows] == [(r.proposed, r.accepted) for r in growing.rows]
        assert not growing.stats.lossy
        accepted[name] = sum(growing.stats.accepted)
    # The comparison only means something if drafts were accepted.
    assert all(n > 0 for n in accepted.values()), accepted


def test_batch_of_one_and_k_zero(setup):
    """B = 1 is batch-1 decoding; K = 0 with a drafter is target-only."""
    target, draft, *_, references = setup
    one = generate_batch(target, PROMPTS[2:3], DraftModelDrafter(draft), num_draft_tokens=5, max_new_tokens=N_NEW)
    assert one.tokens == [references[2]]
    plain = generate_batch(target, PROMPTS, DraftModelDrafter(draft), num_draft_tokens=0, max_new_tokens=5)
    assert plain.tokens == [r[:5] for r in references]
    assert plain.stats.proposed == [0] * sum(r.target_calls for r in plain.rows) and plain.stats.tau == 1.0


# -------------------------------------------------------------------- eos, max_new_tokens


@pytest.mark.parametrize("name", ["target-only", "draft", "eagle3"])
def test_eos_stops_only_its_row(name, setup):
    target, *_, references = setup
    # A token of row 1's output (past its first few) that no other row emits; and row 3's first
    # token, absent elsewhere, as a second eos id.

    def others(b):
        return {t for c, ref in enumerate(references) if c != b for t in ref}

    middle = next(
        t for j, t in enumerate(references[1]) if j >= 4 and t not in references[1][:j] and t not in others(1)
    )
    ids = [middle] + ([references[3][0]] if references[3][0] not in others(3) else [])
    result = generate_batch(
        target, PROMPTS, _drafters(name, setup)[0], num_draft_tokens=K[name], max_new_tokens=N_NEW, eos_token_id=ids
    )
    for b, ref in enumerate(references):
        hit = next((j for j, t in enumerate(ref) if t in ids), None)
        expected = ref if hit is None else ref[: hit + 1]
        assert result.tokens[b] == expected, f"row {b}"
        assert result.stopped[b] == ("eos" if hit is not None else "length")
        assert result.rows[b].new_tokens == len(expected)
    assert result.stopped[1] == "eos" and result.stopped.count("length") >= 2
    assert result.call_rows[-1] < len(PROMPTS)  # the finished row left the batch


def test_sampled_rows_do_not_depend_on_the_others(setup):
    """Same seed with and without eos: a row cut at eos is the free row's prefix, and every row
    without that eos is unchanged although the batch around it shrank."""
    target, draft, *_ = setup
    free = generate_batch(
        target, PROMPTS, DraftModelDrafter(draft), num_draft_tokens=3, max_new_tokens=N_NEW, sampling=T1, seed=11
    ).tokens
    eos = free[2][len(free[2]) // 3]
    out = generate_batch(
        target,
        PROMPTS,
        DraftModelDrafter(draft),
        num_draft_tokens=3,
        max_new_tokens=N_NEW,
        sampling=T1,
        seed=11,
        eos_token_id=eos,
    )
    cut = 0
    for b, row in enumerate(free):
        expected = row if eos not in row else row[: row.index(eos) + 1]
        assert out.tokens[b] == expected, f"row {b}"
        cut += len(expected) < len(row)
    assert cut >= 1


@pytest.mark.parametrize("sampling", [GREEDY, T1])
def test_max_new_tokens_is_exact(sampling, setup):
    target, draft, *_ = setup
    for n in (1, 2, 3, 5, 7):
        result = generate_batch(
            target, PROMPTS, DraftModelDrafter(draft), num_draft_tokens=3, max_new_tokens=n, sampling=sampling, seed=n
        )
        for row, tokens in zip(result.rows, result.tokens):
            assert len(tokens) == n == row.new_tokens
            assert sum(a + 1 for a in row.accepted) == n
            assert all(0 <= a <= p <= 3 for a, p in zip(row.accepted, row.proposed))


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("name", ["draft", "medusa", "eagle3", "medusa-tree", "eagle-tree", "lookup", "medusa-typical"])
def test_sampled_rows_equal_batch1_with_the_row_seed(name, setup):
    """Row b makes the very draws of batch-1 `generate(seed=row_seed(seed, b))`: sampled draft
    tokens (draft model), the acceptance test, the residual and the bonus; the recursive
    rejection over a tree's siblings; Medusa's typical rule (lossy at T = 1, and said so)."""
    target = setup[0]
    sampling = SamplingConfig(0.9, top_k=40, top_p=0.95) if name == "draft" else T1
    result = generate_batch(
        target,
        PROMPTS,
        _drafters(name, setup)[0],
        num_draft_tokens=K[name],
        max_new_tokens=N_NEW,
        sampling=sampling,
        seed=7,
    )
    for b, prompt in enumerate(PROMPTS):
        single = _batch1(target, _drafters(name, setup)[1], prompt, K[name], sampling, seed=row_seed(7, b))
        assert result.tokens[b] == single.tokens, f"row {b}"
        assert result.rows[b].accepted == single.stats.accepted
        assert result.rows[b].lossy == single.stats.lossy == (name == "medusa-typical")
    assert sum(result.stats.accepted) > 0


def _exact_joint(model, prompt: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """p(t1) * p(t2 | t1) for every (t1, t2) from plain forwards: [V, V]."""
    with torch.no_grad():
        p1 = sampling.probs(model(prompt.unsqueeze(0)).logits[0, -1])
        batch = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB).unsqueeze(1)], dim=1)
        p2 = sampling.probs(model(batch).logits[:, -1])
    return p1.double().unsqueeze(1) * p2.double()


def _first_two_fits(setup, copies, k=2, seed=3):
    """T = 1, draft model: `copies` copies of each of 4 prompts of different lengths decode in ONE batch (every
    row its own generator, K drafts, so t1 and t2 both go through verification). Per prompt, the
    chi-square fits of the (t1, t2) histogram to the target's exact law and to the draft's."""
    target, draft, *_ = setup
    prompts = [SAMPLING_PROMPTS[i % len(SAMPLING_PROMPTS)] for i in range(copies * len(SAMPLING_PROMPTS))]
    result = generate_batch(
        target, prompts, DraftModelDrafter(draft), num_draft_tokens=k, max_new_tokens=k + 1, sampling=T1, seed=seed
    )
    stats = result.stats
    assert 0 < sum(stats.accepted) < sum(stats.proposed)  # accept, residual and bonus all ran
    assert stats.proposed.count(k) == len(prompts)  # every row drafted K at its first call
    fits = []
    for p, prompt in enumerate(SAMPLING_PROMPTS):
        counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for tokens in result.tokens[p :: len(SAMPLING_PROMPTS)]:
            counts[tokens[0], tokens[1]] += 1
        fits.append(
            (
                chi_square_gof(counts, _exact_joint(target, prompt, T1)),
                chi_square_gof(counts, _exact_joint(draft, prompt, T1)),
            )
        )
    return fits


def test_sampling_is_lossless_per_row_quick(setup):
    """250 samples per prompt: every prompt fits the target's law; the draft's law is rejected
    somewhere (the test can fail)."""
    fits = _first_two_fits(setup, copies=250)
    for p, (target_fit, _) in enumerate(fits):
        assert target_fit.bins >= 5 and target_fit.p_value > 1e-3, (p, target_fit)
    assert min(draft_fit.p_value for _, draft_fit in fits) < 1e-6, fits


def _lookup_prompts(target) -> list[torch.Tensor]:
    """Four prompts [extra..., a, b, c, a, b] of lengths 6..9: lookup of [a, b] proposes c, a,
    b. A random model does not copy, so c is chosen (one batched forward over every candidate)
    to have a middling target probability: accepted in some runs, rejected in others."""
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for extra in range(4):
        head = torch.randint(3, VOCAB, (extra,), generator=gen).tolist()
        a, b = torch.randint(3, VOCAB, (2,), generator=gen).tolist()
        batch = torch.tensor([[1, *head, a, b, 0, a, b]]).repeat(VOCAB, 1)
        batch[:, extra + 3] = torch.arange(VOCAB)
        with torch.no_grad():
            p = torch.softmax(target(batch).logits[:, -1].float(), -1)
        p_c = p[torch.arange(VOCAB), torch.arange(VOCAB)]  # p(c | the prompt with c)
        score, c = torch.minimum(p_c, 1 - p_c).max(0)
        assert score > 0.05, score
        prompts.append(batch[c].clone())
    return prompts


def _informed_medusa(target, prompts):
    """Two Medusa heads that know the target's first two greedy distributions after each prompt
    (read off the state of its second-last token, which the prefill hands over), random
    elsewhere: right often enough at T = 1 for every branch of the verification to run."""
    from test_tree import OracleHeads

    layers = target.config.num_hidden_layers
    states, rows = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = target(prompt[None], output_hidden_states=True)
            first = out.logits[0, -1]
            second = target(torch.cat([prompt, first.argmax()[None]])[None]).logits[0, -1]
            states.append(out.hidden_states[layers][0])
            rows.append((first, second))
    states = torch.cat(states)
    table = torch.randn(2, states.shape[0], VOCAB, generator=torch.Generator().manual_seed(0))
    end = 0
    for prompt, (first, second) in zip(prompts, rows):
        end += prompt.numel()
        table[0, end - 2], table[1, end - 2] = first, second
    return MedusaDrafter(OracleHeads(states, table), layers, tree=[(0, 0), (0, 1), (1, 0), (2,)])


def _tree_fits(target, make, prompts, k, runs):
    """T = 1, batch 4 (the four prompts), `runs` seeds: per prompt, the chi-square fit of the
    (t1, t2) histogram to the target's exact law; and the pooled stats."""
    counts = [torch.zeros(VOCAB, VOCAB, dtype=torch.float64) for _ in prompts]
    stats = DecodeStats()
    for seed in range(runs):
        result = generate_batch(
            target, prompts, make(), num_draft_tokens=k, max_new_tokens=k + 1, sampling=T1, seed=seed
        )
        for c, tokens in zip(counts, result.tokens):
            c[tokens[0], tokens[1]] += 1
        stats = stats + result.stats
    return [chi_square_gof(c, _exact_joint(target, p, T1)) for c, p in zip(counts, prompts)], stats


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa-tree", "eagle-tree", "lookup"])
def test_trees_and_lookup_are_lossless_at_batch_4(kind, setup):
    """The first two tokens of every row of a batch of 4 follow the target's p(t1) p(t2 | t1)
    at T = 1 for a Medusa tree, an EAGLE-2 tree and prompt lookup (verified node by node with
    the recursive rejection rule, or as ragged chains)."""
    target = setup[0]
    if kind == "lookup":
        prompts, make, k = _lookup_prompts(target), PromptLookupDrafter, 3
    elif kind == "medusa-tree":
        prompts, k = SAMPLING_PROMPTS, 2
        drafter = _informed_medusa(target, prompts)
        make = lambda: drafter  # noqa: E731  (stateless between requests: start() resets it)
    else:
        prompts, k = SAMPLING_PROMPTS, 3
        head = _train_eagle3(target, prompts)
        make = lambda: EagleDrafter(head, tree={"depth": 2, "top_k": 2, "total_tokens": 5})  # noqa: E731
    fits, stats = _tree_fits(target, make, prompts, k, runs=600)
    assert 0 < sum(stats.accepted) < sum(stats.proposed), kind  # accept, residual and bonus all ran
    for p, fit in enumerate(fits):
        assert fit.bins >= 5 and fit.p_value > 1e-3, (kind, p, fit)


@pytest.mark.slow
def test_sampling_is_lossless_per_row(setup):
    """1200 samples per prompt: each prompt fits the target's law and rejects the draft's."""
    fits = _first_two_fits(setup, copies=1200, seed=5)
    for p, (target_fit, draft_fit) in enumerate(fits):
        assert target_fit.bins >= 12 and target_fit.p_value > 1e-3, (p, target_fit)
        assert draft_fit.p_value < 1e-3, (p, draft_fit)


# --------------------------------------------------------------------------- ragged cache


def _forward(kv: KVStore, ids: list[list[int]]) -> None:
    """What a model forward does to the store: write one column per fed token (value = id; 0 on
    padding rows)."""
    x = kv._physical(torch.tensor(ids, dtype=torch.float32)[:, None, :, None], torch.zeros)  # [B, 1, T, 1]
    blank = torch.zeros(len(ids), x.shape[2], dtype=torch.long)
    kv.run(lambda ids, positions, mask, cache: cache.update(x, x + 0.5, 0), blank, blank)


def _rows(kv: KVStore) -> list[list[int]]:
    layer, live = kv.cache.layers[0], kv.length
    keys, values = layer.keys[:, 0, :live, 0], layer.values[:, 0, :live, 0]
    assert torch.equal(values, keys + 0.5)
    return [keys[b][kv.valid[b]].long().tolist() for b in range(keys.shape[0])]


def test_ragged_cache_moves(monkeypatch):
    kv = KVStore((1, 1, 1), 3, 4)  # one layer of one head of width 1; grown as it fills
    # A right-aligned prompt block: rows of 3, 1 and 2 real tokens.
    mask = kv.mask(chain_attend(3, [0, 2, 1], None, 3, kv.device), torch.float32)
    assert mask.shape == (3, 1, 3, 3)
    seen = mask[:, 0] == 0
    assert seen[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]  # padding sees itself
    assert seen[2].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    _forward(kv, [[10, 11, 12], [0, 0, 20], [0, 30, 31]])
    kv.commit_spans(3, [0, 2, 1], None)
    assert _rows(kv) == [[10, 11, 12], [20], [30, 31]] and kv.counts == [3, 1, 2]
    # A verification block of 3: rows keep 1, 3 and 2 of it; no column is dropped (max = 3).
    past = kv.mask(chain_attend(3, None, [3, 3, 2], 3, kv.device), torch.float32)[:, 0] == 0
    assert past[1, :, :3].tolist() == [[False, False, True]] * 3  # row 1's padding is invisible
    assert past[2, 2].tolist() == [False, True, True, True, True, True]  # its own padding column sees itself
    _forward(kv, [[13, 14, 15], [21, 22, 23], [32, 33, 34]])
    kv.commit_spans(3, None, [1, 3, 2])
    assert _rows(kv) == [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]] and kv.length == 6
    # Speculation: 2 columns fed whole, then rows keep 1, 0, 1: the common tail (the second) is cut.
    _forward(kv, [[16], [24], [35]])
    kv.commit_spans(1)
    _forward(kv, [[17], [25], [36]])
    kv.commit_spans(1)
    kv.retain(6, [1, 0, 1])
    assert kv.length == 7 and _rows(kv) == [[10, 11, 12, 13, 16], [20, 21, 22, 23], [30, 31, 32, 33, 35]]
    assert kv.counts == [5, 4, 5]
    with pytest.raises(ValueError, match="retain"):
        kv.retain(6, [2, 0, 0])
    # Row 0 leaves; then compaction (forced) right-aligns the survivors.
    kv.select(torch.tensor([1, 2]), [1, 2])
    assert _rows(kv) == [[20, 21, 22, 23], [30, 31, 32, 33, 35]]
    monkeypatch.setattr(kv_module, "COMPACT_WHEN", 0.0)
    assert kv.compact_if_wasteful()
    assert kv.length == 5 and kv.valid.tolist() == [[False, True, True, True, True], [True] * 5]
    assert _rows(kv) == [[20, 21, 22, 23], [30, 31, 32, 33, 35]]
    assert not kv.compact_if_wasteful()  # nothing left to gain
    # A tree block [last, a, b, c] (b a child of a, c a sibling of a): row 0 keeps last, a, b;
    # row 1 last and c. Kept columns stay where they were fed; the tail no row keeps is cut.
    _forward(kv, [[80, 81, 82, 83], [70, 71, 72, 73]])
    kv.commit(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool))
    assert kv.length == 9 and kv.counts == [7, 7]
    assert _rows(kv) == [[20, 21, 22, 23, 80, 81, 82], [30, 31, 32, 33, 35, 70, 73]]
    _forward(kv, [[84, 85], [74, 75]])
    kv.commit(torch.tensor([[1, 0], [1, 0]], dtype=torch.bool))
    assert kv.length == 10 and _rows(kv) == [[20, 21, 22, 23, 80, 81, 82, 84], [30, 31, 32, 33, 35, 70, 73, 74]]
    with pytest.raises(RuntimeError, match="out of step"):
        kv.commit_spans(2)  # the bookkeeping must follow the forwards


def test_default_compaction_bounds_the_holes(setup, monkeypatch):
    """With the default threshold, after every check the holes of a cache (columns past its
    longest row's real tokens) are less than COMPACT_WHEN of it; and compaction did happen."""
    target, draft, *_ = setup
    checks = []
    original = KVStore.compact_if_wasteful

    def spy(self):
        did = original(self)
        checks.append((did, self.length - max(self.counts), self.length))
        return did

    monkeypatch.setattr(KVStore, "compact_if_wasteful", spy)
    prompts = _prompts((2, 9, 5, 7), seed=4)
    result = generate_batch(target, prompts, DraftModelDrafter(draft), num_draft_tokens=4, max_new_tokens=40)
    assert all(waste < kv_module.COMPACT_WHEN * length for _, waste, length in checks if waste), checks
    assert any(did for did, _, _ in checks)
    assert result.tokens == [_batch1(target, None, p, 0, max_new_tokens=40).tokens for p in prompts]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompts=[]), ValueError, "prompts is empty"),
        (dict(prompts=[torch.tensor([5, 6]), torch.tensor([], dtype=torch.long)]), ValueError, r"prompts\[1\]"),
        (dict(prompts=[torch.zeros(1, 0, dtype=torch.long)]), ValueError, r"prompts\[0\]"),
        (dict(prompts=[torch.tensor([[5, 6], [7, 8]])]), ValueError, r"prompts\[0\]"),
        (dict(prompts=[torch.tensor([5.0, 6.0])]), ValueError, r"prompts\[0\]"),
        (dict(prompts=torch.tensor([[5, 6]])), TypeError, "list"),
        (dict(num_draft_tokens=-1), ValueError, "num_draft_tokens"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=-2), ValueError, "max_new_tokens"),
        (dict(prompts=[torch.tensor([5]), torch.arange(3, 503)]), ValueError, r"prompts\[1\].*512"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(sampling=1.0), TypeError, "SamplingConfig"),
    ],
)
def test_bad_input_raises(kwargs, error, match, setup):
    target, draft, *_ = setup
    args = dict(prompts=[torch.tensor([5, 6, 7]), torch.tensor([8])], num_draft_tokens=2, max_new_tokens=20)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        generate_batch(target, args.pop("prompts"), DraftModelDrafter(draft), **args)


def test_unsupported_drafters_and_targets_raise(setup):
    target, _, heads, head, _ = setup
    with pytest.raises(ValueError, match="target_num_layers"):
        MedusaDrafter(SimpleNamespace(config=SimpleNamespace(num_heads=2)))
    with pytest.raises(TypeError, match="Drafter"):
        generate_batch(target, PROMPTS, object(), max_new_tokens=4)
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2")
    config.layer_types, config.attention_chunk_size = ["full_attention", "chunked_attention"], 4
    chunked = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="runs full-attention, sliding-window .*but the target has chunked_attention"):
        generate_batch(chunked, PROMPTS, max_new_tokens=4)
