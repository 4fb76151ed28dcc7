"""Tree speculation: the verification rules on explicit distributions, tree decoding through the
unmodified HF target against plain greedy decoding, cache compaction against a fresh
sequential run, the hidden states handed to drafters, Medusa's (lossy) typical acceptance and
the Medusa tree builder.

Stand-in Medusa heads: `OracleHeads` looks the target's hidden state up in a table (nearest
neighbour) and returns the logits stored for it. Built from a greedy run of the target, it
predicts the true continuation most of the time and puts it at rank 1 otherwise, so that trees
accept long paths, and paths that leave the first branch (the cache compaction then has to
move entries, not just crop).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from fixtures import FAMILIES, VOCAB, record_accepted, windowed_model

from draftsmith.decoding import generate
from draftsmith.decoding.drafters import Drafter, Proposal
from draftsmith.decoding.kv import KVStore
from draftsmith.decoding.masks import tree_attend
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.decoding.medusa_tree import build_medusa_tree, expected_accept_length
from draftsmith.decoding.tree import (
    children_of,
    typical_threshold,
    verify_tree,
    verify_tree_greedy,
    verify_tree_typical,
)
from draftsmith.eval.evaluator import EvalSettings, evaluate
from draftsmith.eval.lossless import check_lossless
from draftsmith.eval.report import compact_table, header, position_table, render_markdown, summary_table, theory_table
from draftsmith.eval.stats import chi_square_gof

ATOL = 1e-5  # fp32: cached vs full forwards differ by ~4e-6


def _close(actual, expected, what):
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:g}"


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ the rules on explicit tensors

V = 5  # small vocabulary: every (t1, t2) pair gets a healthy expected count


def _world(seed: int):
    """p(. | prefix) for every prefix of length 0..3 over V tokens (Dirichlet, fairly peaked)."""
    gen = torch.Generator().manual_seed(seed)

    def dirichlet(*shape):
        g = torch._standard_gamma(torch.full((*shape, V), 0.8, dtype=torch.float64), generator=gen)
        return (g / g.sum(-1, keepdim=True)).float()

    return [dirichlet(), dirichlet(V), dirichlet(V, V), dirichlet(V, V, V)]


def _tree_tokens(world, parents):
    """Candidates like Medusa's: the children of a node are its row's top tokens, in rank order."""
    tokens, prefix = [], []
    children = children_of(parents)
    for i, parent in enumerate(parents):
        up = [] if parent < 0 else prefix[parent]
        rank = children[parent + 1].index(i)
        row = world[len(up)][tuple(up)] if up else world[0]
        token = int(row.argsort(descending=True)[rank])
        tokens.append(token)
        prefix.append(up + [token])
    return tokens, prefix


def _rows(world, prefix):
    """The target distributions of the fed rows: the root, then each node's context."""
    return torch.stack([world[0]] + [world[len(pre)][tuple(pre)] for pre in prefix])


def _sample_pairs(rule, world, parents, tokens, prefix, samples, seed):
    """Counts [V, V] of the first two emitted tokens. When the tree call emits one token, the
    second comes from the next call, i.e. the target's own p(. | t1)."""
    rows = _rows(world, prefix)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(samples):
        path, nxt = rule(rows, parents, tokens, gen)
        emitted = [tokens[i] for i in path] + [nxt]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(world[1][emitted[0]], 1, generator=gen)))
        counts[emitted[0], emitted[1]] += 1
    return counts


def _no_renormalisation(p, parents, tokens, generator=None):
    """A broken rule: accepts sibling j with p(x_j) instead of p(x_j) / (1 - sum p(tried))."""
    children = children_of(parents)
    path, row = [], 0
    while True:
        tried, accepted = [], None
        for c in children[row]:
            if float(torch.rand((), generator=generator)) < float(p[row, tokens[c]]):
                accepted = c
                break
            tried.append(tokens[c])
        if accepted is None:
            residual = p[row].clone()
            residual[tried] = 0.0
            return path, int(torch.multinomial(residual, 1, generator=generator))
        path.append(accepted)
        row = accepted + 1


SHAPES = {
    "4 siblings": [-1, -1, -1, -1],
    "chain of 3": [-1, 0, 1],
    "wide and deep": [-1, -1, 0, 0, 0, 2, 2],  # siblings 2/3/2, depth 3
    "two levels": [-1, -1, -1, 0, 0, 1, 3],
}


def _exact(world):
    return world[0].double()[:, None] * world[1].double()  # p(t1) p(t2 | t1)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_tree_emits_the_target_distribution(shape):
    parents = SHAPES[shape]
    world = _world(seed=len(shape))
    tokens, prefix = _tree_tokens(world, parents)
    counts = _sample_pairs(verify_tree, world, parents, tokens, prefix, samples=8000, seed=1)
    exact = _exact(world)
    first = chi_square_gof(counts.sum(1), exact.sum(1))
    pairs = chi_square_gof(counts, exact)
    assert first.p_value > 1e-3, (shape, first)
    assert pairs.p_value > 1e-3 and pairs.bins >= 10, (shape, pairs)


def test_verify_tree_with_a_repeated_sibling_token():
    """A token repeated among siblings (EAGLE trees can do that) must not be emitted twice as often."""
    parents = [-1, -1, -1, 1]
    world = _world(seed=11)
    top = world[0].argsort(descending=True).tolist()
    tokens = [top[1], top[0], top[1], int(world[1][top[0]].argmax())]
    prefix = [[tokens[0]], [tokens[1]], [tokens[2]], [tokens[1], tokens[3]]]
    counts = _sample_pairs(verify_tree, world, parents, tokens, prefix, samples=6000, seed=2)
    assert chi_square_gof(counts, _exact(world)).p_value > 1e-3


def test_the_distribution_test_catches_a_missing_renormalisation():
    """Negative control: the same test must reject a rule that forgets to renormalise."""
    parents = SHAPES["4 siblings"]
    world = _world(seed=len("4 siblings"))
    tokens, prefix = _tree_tokens(world, parents)
    counts = _sample_pairs(_no_renormalisation, world, parents, tokens, prefix, samples=8000, seed=1)
    assert chi_square_gof(counts.sum(1), world[0]).p_value < 1e-6


def test_verify_tree_greedy_walks_the_argmax():
    parents = [-1, -1, 0, 0, 1, 3]
    tokens = [7, 8, 5, 6, 6, 9]
    # argmax per row: root, then node 0..5
    assert verify_tree_greedy([8, 1, 6, 1, 1, 1, 1], parents, tokens) == ([1, 4], 1)
    assert verify_tree_greedy([7, 6, 1, 1, 9, 1, 3], parents, tokens) == ([0, 3, 5], 3)
    assert verify_tree_greedy([4, 1, 1, 1, 1, 1, 1], parents, tokens) == ([], 4)


def test_verify_tree_typical_rule():
    # Rows: the root, node 0, node 1 (peaked), node 2.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4, [0.97, 0.01, 0.01, 0.01], [0.25] * 4]))
    p = torch.softmax(logits, -1)
    threshold = typical_threshold(p, epsilon=0.09, delta=0.3)
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(threshold, torch.clamp(0.3 * torch.exp(-entropy), max=0.09))
    # Root children 3 (p=0.05, fails), 2 (0.15 passes); below node 1 (token 2): token 1 with
    # p=0.01 < threshold of a peaked row: stop, sample there.
    path, nxt, kl = verify_tree_typical(logits, p, [-1, -1, 1], [3, 2, 1], 1.0, 0.09, 0.3)
    assert path == [1] and nxt in range(4)
    assert kl == pytest.approx(-math.log(0.15), rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        verify_tree_typical(logits, p, [-1], [0], 0.0, 0.09, 0.3)


# ------------------------------------------------------------------------- stand-in heads


class OracleHeads(torch.nn.Module):
    """The MedusaHeads interface over a lookup table: state -> per-head logits."""

    def __init__(self, states: torch.Tensor, table: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(num_heads=table.shape[0], hidden_size=states.shape[-1])
        self.register_buffer("states", states.float())
        self.register_buffer("table", table.float())  # [num_heads, N, V]

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        index = torch.cdist(flat, self.states).argmin(-1)
        out = self.table[:num_heads, index]
        return out.reshape(out.shape[0], *hidden.shape[:-1], self.table.shape[-1])


NUM_HEADS = 3


@torch.no_grad()
def informed_medusa(target, prompt):
    """Two heads that know the target's first two greedy distributions after `prompt` (read off
    the state of prompt[-2], which the prefill hands over), random elsewhere: right often
    enough for every branch of a sampled verification (accept, reject, residual) to run."""
    out = target(prompt[None], output_hidden_states=True)
    first = out.logits[0, -1]
    second = target(torch.cat([prompt, first.argmax()[None]])[None]).logits[0, -1]
    states = out.hidden_states[target.config.num_hidden_layers][0]
    table = torch.randn(2, states.shape[0], VOCAB, generator=torch.Generator().manual_seed(0))
    table[0, -2], table[1, -2] = first, second
    return OracleHeads(states, table)


@torch.no_grad()
def _oracle(target, prompt, num_new, seed=0, miss=0.3):
    """Heads that know the greedy continuation: head k at position t puts token t + 2 + k at
    rank 0, or (with probability `miss`) at rank 1 below a wrong token."""
    ref = generate(target, None, prompt, max_new_tokens=num_new + NUM_HEADS + 2).tokens
    seq = torch.cat([prompt, torch.tensor(ref)])
    layers = target.config.num_hidden_layers
    states = target(seq[None], output_hidden_states=True).hidden_states[layers][0]
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(NUM_HEADS, seq.numel(), VOCAB, generator=gen)
    for t in range(seq.numel()):
        for k in range(NUM_HEADS):
            if t + 2 + k >= seq.numel():
                continue
            right = int(seq[t + 2 + k])
            table[k, t, right] = 10.0
            if float(torch.rand((), generator=gen)) < miss:
                table[k, t, (right + 1 + t) % VOCAB] = 12.0
    return OracleHeads(states, table), ref[:num_new]


ORACLE_ACCURACY = [[0.7, 0.3, 0.0]] * NUM_HEADS
TREE = build_medusa_tree(ORACLE_ACCURACY, 10)


class Recorder(MedusaDrafter):
    """Records what the decoder tells the drafter (batch 1): the target states it is handed (the
    prefill's, then per call those of `last` and the accepted path), the depth asked for and
    each accepted path (node indices, read off the committed tokens)."""

    def start(self, prompts, prefill, vocab_size):
        super().start(prompts, prefill, vocab_size)
        self.events, self.observed, self.paths, self.asked, self.ends_inner = [], [], [], [], []
        states = prefill.get(self.target_layers[0])
        if states is not None:
            self.events.append("prefill")
            self.observed.append(states[0].clone())
        self._last = None

    def propose(self, contexts, num_tokens, sampling, generators):
        self.asked.append(num_tokens[0])
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        self._last = proposal
        self.events.append("propose")
        return proposal

    def accepted(self, num_accepted, committed, hidden):
        super().accepted(num_accepted, committed, hidden)
        n = num_accepted[0]
        proposal, self._last = self._last, None
        if record_accepted(self, proposal, committed, n, hidden[self.target_layers[0]][0, : n + 1].clone()):
            end = self.paths[-1][-1] if self.paths[-1] else -1
            self.ends_inner.append(end in proposal.parents[0])  # the path's last node has children


def test_tree_is_what_the_drafter_promises():
    assert len(TREE) == 10 and max(len(p) for p in TREE) == NUM_HEADS
    assert any(p[-1] == 1 for p in TREE)  # branches leave rank 0


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_greedy_matches_target_only(family, pairs):
    target, _ = pairs(family)
    layers = target.config.num_hidden_layers
    sideways = accepted = 0
    for length, seed in ((1, 3), (6, 4), (17, 5)):
        prompt = _ids(length, seed)
        heads, reference = _oracle(target, prompt, num_new=24, seed=seed)
        assert generate(target, None, prompt, max_new_tokens=24).tokens == reference
        for tree in (None, TREE):
            drafter = Recorder(heads, layers, tree=tree)
            out = generate(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=NUM_HEADS)
            assert out.tokens == reference, (family, length, "tree" if tree else "chain")
            accepted += sum(out.stats.accepted)
            # A path that is not [0, 1, 2, ...] of the node list forces a real compaction.
            sideways += sum(path != list(range(len(path))) for path in drafter.paths)
    assert accepted > 40 and sideways >= 3, (accepted, sideways)


def test_tree_greedy_with_a_sliding_window_matches_target_only():
    """A window (4) narrower than the sequence: tree nodes sit at depth positions, and the
    sliding layers' mask reads positions, not columns."""
    target = windowed_model("qwen2", window=4)
    prompt = _ids(8, seed=6)
    reference = generate(target, None, prompt, max_new_tokens=12).tokens
    heads, _ = _oracle(target, prompt, num_new=12, seed=6)
    for static in (False, True):
        out = generate(
            target,
            MedusaDrafter(heads, 3, tree=TREE),
            prompt,
            max_new_tokens=12,
            num_draft_tokens=NUM_HEADS,
            static_cache=static,
        )
        assert out.tokens == reference and sum(out.stats.accepted) > 0, static


# --------------------------------------------------------------------- cache compaction

PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4]  # node tree of tests/test_adapter.py
TREE_TOKENS = [17, 250, 99, 123, 123, 40, 17, 301]
STORES = ("grown", "sized")


def _cache(model, store):
    """ "grown": 8 columns, reallocated while fed; "sized": 64."""
    return KVStore.for_model(model, 1, 8 if store == "grown" else 64, owner="the test model")


def _verify_then_keep(model, store, past, last, path):
    """Feed `past`, then [last, tree] with the tree's ancestor mask and depth positions, and
    keep `last` and the nodes of `path`: the cache a verification leaves behind."""
    kv = _cache(model, store)
    kv.forward(model, past[None], torch.arange(past.numel())[None])
    kv.commit_spans(past.numel())
    base = past.numel()
    attend, depths = tree_attend([PARENTS], 1 + len(PARENTS), model.device)
    fed = torch.cat([last, torch.tensor(TREE_TOKENS)])[None]
    kv.forward(model, fed, base + torch.tensor(depths), attend)
    keep = torch.zeros(1, fed.shape[1], dtype=torch.bool)
    keep[0, [0] + [i + 1 for i in path]] = True
    kv.commit(keep)
    return kv


def _after(model, kv, after):
    positions = kv.counts[0] + torch.arange(after.numel())
    return kv.forward(model, after[None], positions[None]).logits


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_matches_a_fresh_sequential_run(family, store, pairs):
    """A tree forward that keeps a path (the second root branch, three deep: kept columns sit
    between holes) leaves the cache sequential decoding of that path leaves."""
    model, _ = pairs(family)
    past, last, after = _ids(9, seed=8), torch.tensor([55]), _ids(3, seed=9)
    path = [1, 4, 7]
    kv = _verify_then_keep(model, store, past, last, path)
    assert kv.counts == [past.numel() + 1 + len(path)]
    logits = _after(model, kv, after)
    sequential = torch.cat([past, last, torch.tensor([TREE_TOKENS[i] for i in path]), after])
    with torch.no_grad():
        full = model(sequential[None]).logits[:, -after.numel() :]
    _close(logits, full, f"logits after keep ({store})")


def test_keep_rejects_a_block_it_was_not_fed(pairs):
    model, _ = pairs("llama")
    kv = _verify_then_keep(model, "growing", _ids(5, seed=10), torch.tensor([4]), [0])
    with pytest.raises(RuntimeError, match="out of step"):
        kv.commit(torch.ones(1, 20, dtype=torch.bool))  # nothing was fed


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_keep_with_a_wrong_path_changes_the_logits(family, store, pairs):
    """The comparison above can fail: keeping a sibling branch gives different logits."""
    model, _ = pairs(family)
    past, last, after = _ids(9, seed=8), torch.tensor([55]), _ids(3, seed=9)
    kv = _verify_then_keep(model, store, past, last, [0, 3])  # 17 -> 123 (first branch)
    wrong = _after(model, kv, after)
    sequential = torch.cat([past, last, torch.tensor([250, 123]), after])  # 250 -> 123 (second)
    with torch.no_grad():
        right = model(sequential[None]).logits[:, -3:]
    assert (wrong - right).abs().max() > 1e-2


# ----------------------------------------------------------------------- observe(hidden)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_gets_the_committed_states(family, temperature, pairs):
    """The states a drafter is handed (prefill, then per call `last` and the accepted path) are
    the target's states of the committed tokens, in order, with no gap: a full forward's."""
    target, _ = pairs(family)
    layers = target.config.num_hidden_layers
    prompt = _ids(7, seed=12)
    heads, _ = _oracle(target, prompt, num_new=20, seed=12)
    for tree in (None, TREE):
        drafter = Recorder(heads, layers, tree=tree)
        out = generate(
            target, drafter, prompt, max_new_tokens=20, num_draft_tokens=NUM_HEADS, temperature=temperature, seed=3
        )
        seq = torch.cat([prompt, torch.tensor(out.tokens)])
        with torch.no_grad():
            full = target(seq[None], output_hidden_states=True).hidden_states[layers][0]
        observed = torch.cat(drafter.observed)
        # Every committed token but the newest, in order: the prompt's, then per call `last`
        # and the accepted drafts; the last call's are not handed over (the row is done).
        assert observed.shape == (seq.numel() - 1 - (out.stats.accepted[-1] + 1), full.shape[-1])
        _close(observed, full[: observed.shape[0]], f"observed states ({'tree' if tree else 'chain'})")
        calls = out.stats.target_calls
        assert drafter.events[0] == "prefill"
        per_call = drafter.events[1:]
        # No proposal at a call whose budget is one token (the bonus only).
        assert per_call.count("accepted") == calls - 1 and calls - 1 <= per_call.count("propose") <= calls
        assert all(a != b for a, b in zip(per_call, per_call[1:]))  # propose, accepted, propose, ...
        if tree is not None:
            assert [len(p) for p in drafter.paths] == out.stats.accepted[: len(drafter.paths)]
            if temperature == 0.0:
                assert sum(len(p) for p in drafter.paths) > 5


def test_one_token_prompt_proposes_nothing_first(pairs):
    target, _ = pairs("llama")
    prompt = _ids(1, seed=13)
    heads, reference = _oracle(target, prompt, num_new=10, seed=13)
    drafter = Recorder(heads, 2, tree=TREE)
    out = generate(target, drafter, prompt, max_new_tokens=10, num_draft_tokens=NUM_HEADS)
    assert out.tokens == reference
    assert out.stats.proposed[0] == 0 and sum(out.stats.proposed[1:]) > 0
    assert drafter.events[0] == "propose" and drafter.observed[0].shape[0] == 1  # no prefill: `last` only


# ------------------------------------------------------------------- stats and the budget


class FixedTree(Drafter):
    """Always proposes the same depth-4 tree, ignoring how many tokens were asked for."""

    def __init__(self, probs=False):
        self.probs = probs

    def propose(self, contexts, num_tokens, sampling, generators):
        rows = len(contexts)
        tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11]]).expand(rows, -1)
        probs = torch.full((rows, 7, VOCAB), 1.0 / VOCAB) if self.probs else None
        return Proposal(tokens=tokens, counts=[7] * rows, probs=probs, parents=[[-1, -1, 0, 1, 2, 4, 5]] * rows)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_budget_is_respected_with_trees(temperature, pairs):
    target, _ = pairs("llama")
    prompt = _ids(6, seed=14)
    heads, _ = _oracle(target, prompt, num_new=12, seed=14)
    for make in (lambda: FixedTree(), lambda: MedusaDrafter(heads, 2, tree=TREE)):
        for k in (1, 2, 4):
            for n in (1, 2, 3, 5, 8):
                out = generate(
                    target, make(), prompt, max_new_tokens=n, num_draft_tokens=k, temperature=temperature, seed=n
                )
                assert len(out.tokens) == n == out.stats.new_tokens
                assert sum(a + 1 for a in out.stats.accepted) == n
                assert all(a < k + 1 for a in out.stats.accepted)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_stats_count_depths(temperature, pairs):
    target, _ = pairs("qwen2")
    prompt = _ids(10, seed=15)
    heads, _ = _oracle(target, prompt, num_new=30, seed=15)
    drafter = Recorder(heads, 2, tree=TREE)
    out = generate(
        target,
        drafter,
        prompt,
        max_new_tokens=30,
        num_draft_tokens=NUM_HEADS,
        temperature=temperature,
        seed=1,
        measure_distances=True,
    )
    stats = out.stats
    assert stats.num_draft_tokens == NUM_HEADS
    assert stats.proposed[0] == len(TREE)  # nodes per call (every TREE path is one node)
    accepted = [a for a, k in zip(stats.accepted, stats.proposed) if k]  # calls that verified a tree
    assert accepted[: len(drafter.paths)] == [len(p) for p in drafter.paths] and sum(accepted) > 0
    assert len(drafter.paths) >= len(accepted) - 1  # the last call's path is not handed over
    depths = [min(k, NUM_HEADS) for k in drafter.asked]
    calls = list(zip(accepted, depths))

    def reached(inner_ends):  # depth i + 1 is reached below a path of length i only where its end has children
        return [
            sum(i < n or (i == n < d and inner) for (n, d), inner in zip(calls, inner_ends)) for i in range(NUM_HEADS)
        ]

    # The last call's path is not handed over: its end may be either.
    assert stats.reached in (reached(drafter.ends_inner + [True]), reached(drafter.ends_inner + [False]))
    assert stats.accepted_at == [sum(i < n for n, _ in calls) for i in range(NUM_HEADS)]
    # Distances of a tree: expected acceptance at depth 1 only, no KL.
    assert stats.distance_count == [stats.reached[0], 0, 0]
    assert stats.kl_count == [0, 0, 0]
    if temperature == 0.0:
        assert stats.accept_prob_sum[0] == stats.accepted_at[0]
    else:
        assert 0 < stats.accept_prob_sum[0] < stats.reached[0]
    assert not stats.lossy and stats.lossy_kl_per_token == 0.0


class LeafThenBranch(Drafter):
    """Depth 1: the target's next greedy token as a leaf, then a wrong token with a child."""

    def __init__(self, reference: list[int], prompt_length: int):
        self.reference, self.prompt_length = reference, prompt_length

    def propose(self, contexts, num_tokens, sampling, generators):
        right = self.reference[len(contexts[0]) - self.prompt_length]
        wrong = (right + 1) % VOCAB
        return Proposal(tokens=torch.tensor([[wrong, right, 3]]), counts=[3], parents=[[-1, -1, 0]])


def test_a_path_ending_at_a_leaf_is_no_rejection_below_it(pairs):
    """Every call accepts the leaf at depth 1: depth 2 is never reached (the leaf has no
    children), so alpha at depth 2 is undefined rather than 0."""
    target, _ = pairs("llama")
    prompt = _ids(6, seed=21)
    reference = generate(target, None, prompt, max_new_tokens=12).tokens
    out = generate(target, LeafThenBranch(reference, prompt.numel()), prompt, max_new_tokens=12, num_draft_tokens=2)
    assert out.tokens == reference
    assert out.stats.accepted == [1] * 6
    assert out.stats.reached == [6, 0] and out.stats.accepted_at == [6, 0]
    assert out.stats.alpha_per_position == [1.0, None]


def test_tree_errors(pairs):
    target, _ = pairs("llama")
    prompt = _ids(5, seed=16)
    heads, _ = _oracle(target, prompt, num_new=4, seed=16)
    with pytest.raises(ValueError, match="deeper than the number of heads"):
        MedusaDrafter(heads, 2, tree=[(0,), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match=">= 0"):
        MedusaDrafter(heads, 2, tree=[(0, -1)])
    with pytest.raises(ValueError, match="empty"):
        MedusaDrafter(heads, 2, tree=[])
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="probs"):
            generate(
                target, FixedTree(probs=True), prompt, max_new_tokens=4, num_draft_tokens=3, temperature=temperature
            )


class ConstantHeads(torch.nn.Module):
    """Heads whose logits do not depend on the state: [num_heads, V]."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(num_heads=logits.shape[0])
        self.register_buffer("logits", logits)

    def forward(self, hidden, num_heads=None):
        logits = self.logits[:num_heads]
        k, v = logits.shape
        return logits.view(k, *[1] * (hidden.dim() - 1), v).expand(k, *hidden.shape[:-1], v)


def test_medusa_tree_nodes_and_truncation():
    # Ranks: head 0 -> 1, 2, 3, ...; head 1 -> 0, 2, 3, ...; head 2 -> 4, 3, 2, ...
    heads = ConstantHeads(torch.tensor([[0.0, 5, 4, 3, 1], [9, 0, 8, 7, 0], [0, 0, 1, 2, 3]]))
    drafter = MedusaDrafter(heads, 2, tree=[(1, 0), (0, 2, 1), (0,), (1, 1)])
    context = [[1, 2]]
    drafter.start([[1]], {}, 5)  # a one-token prompt: no state yet
    assert drafter.propose(context, [3], None, [None]).counts == [0]  # nothing observed yet
    drafter.accepted([0], torch.tensor([[2]]), {2: torch.zeros(1, 1, 4)})
    prop = drafter.propose(context, [3], None, [None])
    # Nodes by depth, then first appearance: (1), (0) | (1,0), (0,2), (1,1) | (0,2,1).
    assert prop.tokens.tolist() == [[2, 1, 0, 3, 2, 3]] and prop.counts == [6]
    assert prop.parents == [[-1, -1, 0, 1, 0, 3]]
    assert prop.probs is None
    short = drafter.propose(context, [1], None, [None])
    assert short.tokens.tolist() == [[2, 1]] and short.parents == [[-1, -1]]
    chain = MedusaDrafter(heads, 2)
    chain.prepare(1, None, False, 2, None, logits=True)
    chain.start([[1]], {}, 5)
    chain.accepted([0], torch.tensor([[2]]), {2: torch.zeros(1, 1, 4)})
    out = chain.propose(context, [2], None, [None])
    assert out.tokens.tolist() == [[1, 0]] and out.parents is None and out.logits.shape == (1, 2, 5)
    assert chain.max_depth == 3 and drafter.max_depth == 3


# -------------------------------------------------------------- typical acceptance (lossy)


def test_typical_acceptance_is_reported_lossy(pairs):
    target, _ = pairs("llama")
    prompt = _ids(8, seed=17)
    heads, _ = _oracle(target, prompt, num_new=24, seed=17, miss=1.0)  # rank 0 always wrong
    lossless = generate(
        target,
        MedusaDrafter(heads, 2, tree=TREE),
        prompt,
        max_new_tokens=24,
        num_draft_tokens=3,
        temperature=1.0,
        seed=0,
    )
    assert not lossless.stats.lossy and lossless.stats.lossy_kl_per_token == 0.0
    # A permissive threshold accepts the heads' low-probability first choices.
    for drafter, kwargs in (
        (MedusaDrafter(heads, 2, tree=TREE, typical=(1e-3, 1e-3)), {}),
        (MedusaDrafter(heads, 2), {"typical": (1e-3, 1e-3)}),  # a chain, typical by argument
    ):
        out = generate(
            target, drafter, prompt, max_new_tokens=24, num_draft_tokens=3, temperature=1.0, seed=0, **kwargs
        )
        stats = out.stats
        assert stats.lossy and stats.tau > lossless.stats.tau
        assert stats.lossy_kl_per_token > 0.1, stats.lossy_kl_per_token
        assert len(out.tokens) == 24 and all(0 <= t < VOCAB for t in out.tokens)
        merged = lossless.stats + stats
        assert merged.lossy and merged.lossy_kl_sum == pytest.approx(stats.lossy_kl_sum)
    # At T = 0 the typical rule is exact argmax matching: greedy and lossless.
    greedy = generate(
        target, MedusaDrafter(heads, 2, tree=TREE, typical=(0.09, 0.3)), prompt, max_new_tokens=24, num_draft_tokens=3
    )
    assert greedy.tokens == generate(target, None, prompt, max_new_tokens=24).tokens
    assert not greedy.stats.lossy


def test_reports_label_lossy_rows(pairs):
    target, _ = pairs("llama")
    prompt = _ids(8, seed=18)
    heads, _ = _oracle(target, prompt, num_new=8, seed=18, miss=1.0)
    methods = {
        "medusa": MedusaDrafter(heads, 2, tree=TREE),
        "medusa-typical": MedusaDrafter(heads, 2, tree=TREE, typical=(1e-3, 1e-3)),
    }
    settings = EvalSettings(num_draft_tokens=3, max_new_tokens=8, temperature=1.0, repeats=1)
    report = evaluate(target, methods, [prompt], settings, progress=False)
    assert report["lossless"] is False
    rows = {row["method"]: row for row in report["methods"]}
    assert rows["medusa-typical"]["lossy"] and rows["medusa-typical"]["lossy_kl_per_token"] > 0
    assert not rows["medusa"]["lossy"] and not rows["target-only"]["lossy"]
    kl = f"{rows['medusa-typical']['lossy_kl_per_token']:.3f}"
    for table in (summary_table(report), compact_table(report), position_table(report), theory_table(report)):
        lines = [line for line in table.splitlines() if "medusa-typical" in line]
        assert lines and all("medusa-typical (LOSSY typical)" in line for line in lines), table
        assert not any("medusa (LOSSY" in line for line in table.splitlines())
    for table in (summary_table(report), compact_table(report)):
        assert kl in next(line for line in table.splitlines() if "LOSSY" in line)
    assert "NOT lossless for medusa-typical" in header(report)
    assert "(LOSSY typical)" in render_markdown(report)


# -------------------------------------------------------------------- Medusa tree builder

ACCURACY = [[0.6, 0.3, 0.1], [0.5, 0.4], [0.9]]


def test_build_medusa_tree_takes_the_most_likely_nodes():
    # Path probabilities: (0) .6, (1) .3 = (0,0) .3 (tie: shallower first), (0,0,0) .27,
    # (0,1) .24, (0,1,0) .216, (1,0) .15, (1,0,0) .135, (1,1) .12, ...
    assert build_medusa_tree(ACCURACY, 8) == [(0,), (1,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0), (1, 0), (1, 0, 0)]
    assert build_medusa_tree(ACCURACY, 1) == [(0,)]
    assert len(build_medusa_tree(ACCURACY, 100)) == 3 + 6 + 6  # every node there is


def test_expected_accept_length_by_hand():
    tree = build_medusa_tree(ACCURACY, 8)
    assert expected_accept_length(tree, ACCURACY) == pytest.approx(0.6 + 0.3 + 0.3 + 0.27 + 0.24 + 0.216 + 0.15 + 0.135)
    assert expected_accept_length([(0, 0, 0)], ACCURACY) == pytest.approx(0.6 + 0.3 + 0.27)  # prefixes count
    assert expected_accept_length([(1,), (1,)], ACCURACY) == pytest.approx(0.3)  # once
    with pytest.raises(ValueError, match="deeper"):
        expected_accept_length([(0, 0, 0, 0)], ACCURACY)


def test_build_medusa_tree_is_optimal_on_random_tables():
    gen = torch.Generator().manual_seed(19)
    for _ in range(5):
        acc = (torch.rand(3, 4, generator=gen) * 0.5).tolist()
        everything = build_medusa_tree(acc, 10_000)
        best = sorted(
            (
                expected_accept_length([p], acc) - expected_accept_length([p[:-1]], acc)
                if len(p) > 1
                else expected_accept_length([p], acc)
            )
            for p in everything
        )[::-1]
        for n in (1, 5, 12):
            tree = build_medusa_tree(acc, n)
            assert expected_accept_length(tree, acc) == pytest.approx(sum(best[:n]))


# ------------------------------------------------------------- end to end: lossless sampling


@pytest.mark.slow
def test_sampled_tree_decode_is_lossless(pairs):
    """check_lossless (chi-square of t1 and (t1, t2) against the exact target law) on a Medusa
    tree whose heads know the target's distributions at the prompt."""
    target, _ = pairs("llama")
    prompt = torch.tensor([1, 5, 77, 140, 9])
    drafter = MedusaDrafter(informed_medusa(target, prompt), 2, tree=[(0, 0), (0, 1), (1, 0), (2,)])
    result = check_lossless(target, drafter, prompt, num_draft_tokens=2, samples=2500, batch_size=500, progress=False)
    # accepted / proposed nodes: at most 2 of the 6 nodes can be accepted in a call.
    assert 0.05 < result.acceptance_rate < 1 / 3, result.describe()
    assert result.passed, result.describe()
