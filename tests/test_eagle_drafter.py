"""The EAGLE drafter (chain and EAGLE-2 dynamic tree) through the real decoder.

Stand-in heads follow the EagleHead contract (`draftsmith.heads.eagle`: keys/values appended to
the HF `DynamicCache` the drafter hands them), so these tests do not depend on the head's
implementation:
- `FakeEagleHead`: fc(embed(token), feature) + a learned position embedding, one causal
  attention layer over its cache, an MLP and an lm_head over a (possibly reduced) draft
  vocabulary. Optional hints make it know a greedy continuation of the target: the draft at
  position p fed the reference token p + 1 puts a large logit on reference token p + 2 (or,
  at random positions, a larger one on a wrong token and the right one second, so that tree
  paths leave the first branch). Everything else (cache, mask, features) still changes its
  outputs, so the cache checks below are sharp.
- `TableHead`: logits = table[input token, position]; it ignores the features, so the EAGLE-2
  node selection can be checked against a plain-Python reference.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from fixtures import VOCAB, record_accepted
from torch import nn
from transformers import DynamicCache, LlamaConfig

from draftsmith.decoding import generate
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.decoding.tree import depths
from draftsmith.eval.lossless import check_lossless

FAMILIES = ("llama", "qwen2", "mistral")
ATOL = 1e-4  # fp32: cached vs full forwards of target and draft differ by ~1e-6
TREE = {"depth": 3, "top_k": 3, "total_tokens": 10}
K = 4  # chain length / tree depth asked of the decoder (the tree reaches depth 4 = depth + 1)


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:g}"


# ------------------------------------------------------------------------- stand-in heads


class FakeEagleHead(nn.Module):
    MAX_POSITIONS = 512

    def __init__(self, target, version="eagle3", *, seed=0, draft_vocab=None, hint_seq=None, miss=0.3):
        super().__init__()
        cfg = target.config
        hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
        aux = [layers] if version == "eagle1" else [1, 0, layers]  # any order: concat follows it
        gen = torch.Generator().manual_seed(seed)
        if draft_vocab is None:
            draft_ids = torch.arange(vocab)
        else:  # the hinted tokens, then random others
            order = torch.randperm(vocab, generator=gen)
            if hint_seq is not None:
                order = torch.cat([hint_seq.unique(), order[~torch.isin(order, hint_seq)]])
            draft_ids = order[:draft_vocab].sort().values
        # layer_config: the shape of its one attention layer's HF cache (one head as wide as the state)
        layer = LlamaConfig(hidden_size=hidden, num_attention_heads=1, head_dim=hidden, num_hidden_layers=1)
        self.config = SimpleNamespace(
            version=version,
            aux_layer_ids=aux,
            draft_vocab_size=draft_ids.numel(),
            vocab_size=vocab,
            hidden_size=hidden,
            layer_config=lambda: layer,
        )
        torch.manual_seed(seed)
        self.fc_aux = nn.Linear(len(aux) * hidden, hidden, bias=False) if version == "eagle3" else None
        self.embed = nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone())
        self.fc = nn.Linear(2 * hidden, hidden)
        self.pos = nn.Embedding(self.MAX_POSITIONS, hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, draft_ids.numel())
        with torch.no_grad():
            self.lm_head.weight.mul_(4.0)  # peaked distributions
        self.register_buffer("draft_ids", draft_ids)
        t2d = torch.full((vocab,), -1, dtype=torch.long)
        t2d[draft_ids] = torch.arange(draft_ids.numel())
        self.register_buffer("t2d", t2d)
        # Hints: at position p, input token seq[p + 1] -> seq[p + 2] (draft id; -1 = none).
        expect_in = torch.full((self.MAX_POSITIONS,), -1, dtype=torch.long)
        right = torch.full_like(expect_in, -1)
        wrong = torch.full_like(expect_in, -1)
        if hint_seq is not None:
            for p in range(hint_seq.numel() - 2):
                expect_in[p] = hint_seq[p + 1]
                right[p] = t2d[hint_seq[p + 2]]
                if float(torch.rand((), generator=gen)) < miss:
                    wrong[p] = (right[p] + 1 + p) % draft_ids.numel()
        self.register_buffer("expect_in", expect_in)
        self.register_buffer("right", right)
        self.register_buffer("wrong", wrong)
        self.eval()

    device = property(lambda self: self.fc.weight.device)
    dtype = property(lambda self: self.fc.weight.dtype)

    def project(self, aux):
        return aux if self.fc_aux is None else self.fc_aux(aux)

    def draft_to_target(self, draft_ids):
        return self.draft_ids[draft_ids]

    def target_logits(self, logits):
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_ids] = logits
        return full

    def forward(self, input_ids, hidden, *, position_ids, attention_mask=None, cache=None):
        batch, num = input_ids.shape
        assert hidden.shape[:2] == (batch, num) and position_ids.shape == (batch, num)
        keys = num if cache is None else cache.get_mask_sizes(num, 0)[0]  # a static cache: all its columns
        if attention_mask is None:
            causal = torch.ones(num, keys, dtype=torch.bool).tril(diagonal=keys - num)
            attention_mask = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))[None, None]
        else:
            assert attention_mask.shape == (batch, 1, num, keys), attention_mask.shape
            assert attention_mask.dtype.is_floating_point
        return self.decode(input_ids, hidden, position_ids, attention_mask, cache)

    def decode(self, input_ids, hidden, position_ids, attention_mask, cache):
        """EagleHead.decode's contract: no checks, the mask covers what the cache's update returns."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden], -1)) + self.pos(position_ids)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if cache is not None:
            k, v = (x[:, 0] for x in cache.update(k[:, None], v[:, None], 0))  # [B, heads = 1, S, hidden]
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + attention_mask[:, 0]  # [B, T, S]
        out = x + self.o(scores.softmax(-1) @ v)
        out = out + self.mlp(out)
        logits = self.lm_head(self.norm(out))
        hit = input_ids == self.expect_in[position_ids]
        for table, bonus in ((self.right, 12.0), (self.wrong, 14.0)):
            ids = table[position_ids]
            on = (hit & (ids >= 0)).float()[..., None] * bonus
            logits = logits + torch.zeros_like(logits).scatter_(-1, ids.clamp(min=0)[..., None], on)
        return out, logits


class TableHead(nn.Module):
    """logits = table[input token, position]; out_hidden = the fed hidden (unused)."""

    def __init__(self, table):
        super().__init__()
        vocab = table.shape[0]
        self.config = SimpleNamespace(version="eagle1", aux_layer_ids=[2], draft_vocab_size=vocab, vocab_size=vocab)
        # layer_config: its KV store's shape, one layer of one head of width 1 (written with zeros)
        layer = LlamaConfig(hidden_size=1, num_attention_heads=1, head_dim=1, num_hidden_layers=1)
        self.config.layer_config = lambda: layer
        self.register_buffer("table", table)
        self.dummy = nn.Parameter(torch.zeros(1))

    def project(self, aux):
        return aux

    def draft_to_target(self, ids):
        return ids

    def target_logits(self, logits):
        return logits

    def forward(self, input_ids, hidden, *, position_ids, attention_mask=None, cache=None):
        past = cache.get_seq_length()
        empty = hidden.new_zeros(input_ids.shape[0], 1, input_ids.shape[1], 1)  # [B, heads, T, head_dim]
        cache.update(empty, empty, 0)
        if attention_mask is not None:
            assert attention_mask.shape == (input_ids.shape[0], 1, input_ids.shape[1], past + input_ids.shape[1])
        return hidden, self.table[input_ids, position_ids]


def _oracle_head(target, prompt, version, seed, num_new=24, **kwargs):
    """A FakeEagleHead with hints along the target's greedy continuation of `prompt`."""
    ref = generate(target, None, prompt, max_new_tokens=num_new + 8).tokens
    seq = torch.cat([prompt, torch.tensor(ref)])
    return FakeEagleHead(target, version, seed=seed, hint_seq=seq, **kwargs), ref[:num_new]


class Recorder(EagleDrafter):
    """Records what the decoder tells the drafter (batch 1), and checks the cache at every step."""

    def start(self, prompts, prefill, vocab_size):
        super().start(prompts, prefill, vocab_size)
        self.events, self.observed, self.roots, self.paths, self.proposals = [], [], [], [], []
        if prefill:
            self.events.append("prefill")
            self.observed.append({i: h[0].clone() for i, h in prefill.items()})

    def propose(self, contexts, num_tokens, sampling, generators):
        proposal = super().propose(contexts, num_tokens, sampling, generators)
        if proposal.counts[0]:
            assert self._real[0] == len(contexts[0]) - 1  # every committed pair, nothing more
            self.roots.append((len(contexts[0]), self._root[0][0].clone()))
        assert self.kv.length == self._real[0], "speculative entries left in the draft cache"
        self.proposals.append(proposal)
        self.events.append("propose")
        return proposal

    def accepted(self, num_accepted, committed, hidden):
        super().accepted(num_accepted, committed, hidden)
        n = num_accepted[0]
        proposal = self.proposals[-1] if self.proposals else None
        record_accepted(self, proposal, committed, n, {i: h[0, : n + 1].clone() for i, h in hidden.items()})
        assert self.kv.length == self._real[0], "speculative entries left in the draft cache"


def _start(drafter, context, prefill=None):
    """`drafter.start` for one prompt; `prefill`: {layer: [P - 1, H]} states (None: none)."""
    prefill = {} if prefill is None else {i: h[None] for i, h in prefill.items()}
    drafter.start([context.tolist()], prefill, VOCAB)


def _propose(drafter, context, num_tokens):
    return drafter.propose([context.tolist()], [num_tokens], SamplingConfig(), [None])


@torch.no_grad()
def _fresh_features(target, head, seq):
    """f_t for every t of `seq` from one full target forward."""
    states = target(seq[None], output_hidden_states=True).hidden_states
    return head.project(torch.cat([states[i][0] for i in head.config.aux_layer_ids], -1))


# --------------------------------------------------------------- greedy = target-only greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_target_only(family, pairs):
    target, _ = pairs(family)
    accepted = sideways = 0
    for version, draft_vocab in (("eagle1", None), ("eagle3", 200)):
        for length, seed in ((1, 3), (6, 4), (17, 5)):
            prompt = _ids(length, seed)
            head, reference = _oracle_head(target, prompt, version, seed, draft_vocab=draft_vocab)
            assert generate(target, None, prompt, max_new_tokens=24).tokens == reference
            for tree in (None, TREE):
                drafter = Recorder(head, tree=tree)
                out = generate(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=K)
                assert out.tokens == reference, (family, version, length, "tree" if tree else "chain")
                accepted += sum(out.stats.accepted)
                sideways += sum(path != list(range(len(path))) for path in drafter.paths)
    # The hints make the draft right most of the time: long accepts, and tree paths that leave
    # the first branch (the verifier compacts the target cache; the draft cache is cropped).
    assert accepted > 60 and sideways >= 3, (accepted, sideways)


# -------------------------------------------------------------------- the draft's own state


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_cache_holds_the_real_pairs(tree, temperature, pairs):
    """Before each proposal the draft state equals a fresh draft run over the whole committed
    sequence (token t+1 with the target's f_t at position t): no speculative leftovers, no
    missing or shifted pairs, whatever was accepted."""
    target, _ = pairs("llama")
    prompt = _ids(9, seed=21)
    head, _ = _oracle_head(target, prompt, "eagle3", seed=21, draft_vocab=240)
    drafter = Recorder(head, tree=tree)
    out = generate(target, drafter, prompt, max_new_tokens=30, num_draft_tokens=K, temperature=temperature, seed=2)
    seq = torch.cat([prompt, torch.tensor(out.tokens)])
    features = _fresh_features(target, head, seq)
    with torch.no_grad():
        fresh, _ = head(seq[None, 1:], features[None, :-1], position_ids=torch.arange(seq.numel() - 1)[None])
    assert len(drafter.roots) >= 5
    for length, root in drafter.roots:
        _close(root, fresh[0, length - 2], f"draft state at context length {length}")
    if temperature == 0.0:  # the hints follow the greedy path: accepts and rejections
        assert 0 < sum(out.stats.accepted) < K * out.stats.target_calls


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_gets_the_aux_states(version, temperature, pairs):
    target, _ = pairs("qwen2")
    prompt = _ids(7, seed=12)
    head, _ = _oracle_head(target, prompt, version, seed=12)
    assert EagleDrafter(head).target_layers == tuple(head.config.aux_layer_ids)
    for tree in (None, TREE):
        drafter = Recorder(head, tree=tree)
        out = generate(target, drafter, prompt, max_new_tokens=20, num_draft_tokens=K, temperature=temperature, seed=3)
        seq = torch.cat([prompt, torch.tensor(out.tokens)])
        with torch.no_grad():
            full = target(seq[None], output_hidden_states=True).hidden_states
        for layer in head.config.aux_layer_ids:
            observed = torch.cat([h[layer] for h in drafter.observed])
            # Every committed token but the newest, in order (the last call's are not handed over).
            assert observed.shape == (seq.numel() - 1 - (out.stats.accepted[-1] + 1), full[layer].shape[-1])
            _close(observed, full[layer][0, : observed.shape[0]], f"observed states of layer {layer}")
        assert drafter.events[0] == "prefill" and "accepted" in drafter.events


def test_one_token_prompt_proposes_nothing_first(pairs):
    target, _ = pairs("mistral")
    prompt = _ids(1, seed=13)
    head, reference = _oracle_head(target, prompt, "eagle1", seed=13, num_new=10)
    for tree in (None, TREE):
        drafter = Recorder(head, tree=tree)
        out = generate(target, drafter, prompt, max_new_tokens=10, num_draft_tokens=K)
        assert out.tokens == reference
        assert out.stats.proposed[0] == 0 and sum(out.stats.proposed[1:]) > 0
        assert drafter.observed[0][2].shape[0] == 1  # `last` only: no prefill happened
    # Called directly with nothing observed: an empty proposal, not an error.
    drafter = EagleDrafter(head)
    _start(drafter, prompt)
    assert _propose(drafter, prompt, 3).counts == [0]


def test_chain_proposal_is_the_draft_argmax(pairs):
    """Chain: argmax at every step, mapped to target ids; logits scattered to the target vocab."""
    target, _ = pairs("llama")
    prompt = _ids(8, seed=31)
    head = FakeEagleHead(target, "eagle3", seed=31, draft_vocab=150)
    drafter = EagleDrafter(head)
    drafter.prepare(1, None, False, 5, SamplingConfig(temperature=1.0), logits=True)
    _start(drafter, prompt, _states(target, prompt[:-1], head))
    proposal = drafter.propose([prompt.tolist()], [5], SamplingConfig(temperature=1.0), [None])
    assert proposal.probs is None and proposal.parents is None and proposal.counts == [5]
    tokens, logits = proposal.tokens[0], proposal.logits[0]
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    assert torch.equal(logits.argmax(-1), tokens)
    assert bool(torch.isin(tokens, head.draft_ids).all())
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.draft_ids] = False
    assert bool(torch.isinf(logits[:, outside]).all())
    # Sequential reference: feed the draft's own g with each drafted token.
    scores = _path_logq(head, target, prompt, tokens.tolist(), return_logits=True)
    for i, step in enumerate(scores):
        _close(logits[i, head.draft_ids], step, f"chain logits at step {i}")
    assert drafter.kv.length == prompt.numel() - 1  # the 4 speculative entries are cut at once


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_with_the_real_eagle_head(version, pairs):
    """`EagleHead.for_target` with its own DynamicCache (reduced vocabulary for eagle3): greedy chain
    and tree decodes equal target-only greedy, and the draft state before each proposal equals
    a fresh run of the head over the committed sequence."""
    from draftsmith.distill.vocab import build_vocab_map
    from draftsmith.heads.eagle import EagleHead

    target, _ = pairs("qwen2")
    vocab = target.config.vocab_size
    vmap = None
    if version == "eagle3":  # every third id never seen: a gappy draft vocabulary of 200
        vmap = build_vocab_map(torch.arange(vocab).flip(0) * (torch.arange(vocab) % 3 != 0), 200, "test-data")
    head = EagleHead.for_target(target, version, vocab_map=vmap).eval()
    prompt = _ids(10, seed=71)
    reference = generate(target, None, prompt, max_new_tokens=16).tokens
    for tree in (None, TREE):
        drafter = Recorder(head, tree=tree)
        out = generate(target, drafter, prompt, max_new_tokens=16, num_draft_tokens=K)
        assert out.tokens == reference, (version, "tree" if tree else "chain")
        if tree is not None:
            proposal = next(p for p in drafter.proposals if p.counts[0])
            _check_structure(proposal, TREE["total_tokens"], max_depth=TREE["depth"] + 1)
            if vmap is not None:
                assert bool(vmap.t2d[proposal.tokens].all())  # target ids of draft-vocabulary tokens
        seq = torch.cat([prompt, torch.tensor(out.tokens)])
        features = _fresh_features(target, head, seq)
        with torch.no_grad():
            fresh, _ = head(seq[None, 1:], features[None, :-1], position_ids=torch.arange(seq.numel() - 1)[None])
        for length, root in drafter.roots:
            _close(root, fresh[0, length - 2], f"draft state at context length {length}")


# ------------------------------------------------------------------------- the dynamic tree


def _states(target, tokens, head):
    with torch.no_grad():
        states = target(tokens[None], output_hidden_states=True).hidden_states
    return {i: states[i][0] for i in head.config.aux_layer_ids}


@torch.no_grad()
def _path_logq(head, target, context, path, return_logits=False):
    """Cumulative log q of a path of target ids below `context`, drafted one step at a time
    (the head reads target ids; its logits are over the draft vocabulary)."""
    features = _fresh_features(target, head, context[:-1])
    cache = DynamicCache()
    real = context.numel() - 1
    g, logits = head(context[None, 1:], features[None], position_ids=torch.arange(real)[None], cache=cache)
    g, logits = g[0, -1], logits[0, -1]
    total, out = 0.0, []
    for step, token in enumerate(path):
        out.append(logits)
        total += float(torch.log_softmax(logits, -1)[head.t2d[token]])
        t = torch.tensor([[token]])
        g, logits = head(t, g[None, None], position_ids=torch.tensor([[real + step]]), cache=cache)
        g, logits = g[0, -1], logits[0, -1]
    return out if return_logits else total


def _check_structure(proposal, total, max_depth):
    """Row 0 of a tree proposal: `total` nodes, parents first, within `max_depth`, no twins."""
    parents, count = proposal.parents[0], proposal.counts[0]
    assert len(parents) == count == total
    assert all(-1 <= q < i for i, q in enumerate(parents))  # parents kept, topological order
    assert max(depths(parents)) <= max_depth
    nodes = [(parents[i], int(proposal.tokens[0, i])) for i in range(len(parents))]
    assert len(set(nodes)) == len(nodes), "two siblings with the same token"


def _paths(proposal):
    """Root-to-node token paths of every node of row 0 of a tree proposal."""
    out = []
    for i, q in enumerate(proposal.parents[0]):
        out.append((out[q] if q >= 0 else ()) + (int(proposal.tokens[0, i]),))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_nodes_score_as_sequential_drafting(family, pairs):
    """Every node's cumulative log q (reported in `last_scores`) equals drafting its path one
    token at a time from a fresh cache: the tree mask, positions and fed g are right. Twice,
    the second time after three more tokens were committed (`accepted` with their states)."""
    target, _ = pairs(family)
    seq = _ids(14, seed=41)
    head = FakeEagleHead(target, "eagle3", seed=41, draft_vocab=220)
    drafter = EagleDrafter(head, tree={"depth": 4, "top_k": 3, "total_tokens": 12})
    _start(drafter, seq[:8], _states(target, seq[:7], head))
    for length in (8, 11):
        if length == 11:  # seq[8:11] committed: the pairs of the fed seq[7] and 2 accepted drafts
            hidden = {i: h[None, 7:10] for i, h in _states(target, seq[:10], head).items()}
            drafter.accepted([2], seq[None, 8:11], hidden)
        context = seq[:length]
        proposal = _propose(drafter, context, 8)
        _check_structure(proposal, 12, max_depth=5)
        assert drafter.max_depth == 5
        scores = drafter.last_scores[0]
        for path, score in zip(_paths(proposal), scores.tolist(), strict=True):
            expected = _path_logq(head, target, context, list(path))
            assert score == pytest.approx(expected, abs=ATOL), path
        # Kept nodes are the best-scoring ones: scores never rise along a path.
        for i, q in enumerate(proposal.parents[0]):
            if q >= 0:
                assert scores[i] <= scores[q]


def _reference_tree(table, token, position, depth, top_k, total):
    """EAGLE-2 node selection in plain Python over a token/position table: the root's top-k,
    `depth` expansions of the best-k frontier, then the best `total` of all generated nodes."""

    def logq(tok, pos):
        return torch.log_softmax(table[tok, pos], -1).tolist()

    def best(items, k):  # (score, path) by score, earlier first among equals (a stable sort)
        return sorted(items, key=lambda item: -item[0])[:k]

    frontier = best([(s, (t,)) for t, s in enumerate(logq(token, position))], top_k)
    generated = list(frontier)
    for step in range(depth):
        children = []
        for score, path in frontier:
            row = logq(path[-1], position + 1 + step)
            children += [(score + s, path + t) for s, t in best([(s, (t,)) for t, s in enumerate(row)], top_k)]
        generated += children
        frontier = best(children, top_k)
    ranked = sorted(generated, key=lambda item: (-item[0], len(item[1])))
    return {path for _, path in ranked[:total]}, ranked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_keeps_the_most_likely_nodes(seed):
    vocab, positions = 16, 12
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, positions, vocab, generator=gen) * 2.5
    head = TableHead(table)
    context = torch.tensor([3, 7, 1, 9])
    for depth, top_k, total in ((3, 3, 14), (2, 4, 30), (0, 5, 3), (4, 2, 100)):
        tree = {"depth": depth, "top_k": top_k, "total_tokens": total}
        drafter = EagleDrafter(head, tree=tree)
        _start(drafter, context, {2: torch.zeros(3, 4)})
        proposal = _propose(drafter, context, 10)
        expected, ranked = _reference_tree(table, 9, 2, depth, top_k, total)
        _check_structure(proposal, min(total, len(ranked)), max_depth=depth + 1)
        assert set(_paths(proposal)) == expected, (depth, top_k, total)
        assert drafter.kv.length == 3  # the real pairs: one column per frontier node was cut


def test_tree_ties_keep_ancestors():
    """Near one-hot rows: log q = 0 exactly along the argmax chain, so a node ties with all
    of its ancestors; the kept set must still hold every kept node's parent."""
    vocab = 8
    table = torch.zeros(vocab, 12, vocab)
    for tok in range(vocab):
        table[tok, :, (tok + 3) % vocab] = 60.0  # log_softmax = 0.0 in fp32
        table[tok, :, (tok + 5) % vocab] = 1.0
    head = TableHead(table)
    drafter = EagleDrafter(head, tree={"depth": 4, "top_k": 2, "total_tokens": 4})
    context = torch.tensor([1, 2])
    _start(drafter, context, {2: torch.zeros(1, 4)})
    proposal = _propose(drafter, context, 8)
    _check_structure(proposal, 4, max_depth=5)
    assert proposal.parents == [[-1, 0, 1, 2]] and proposal.tokens.tolist() == [[5, 0, 3, 6]]
    assert drafter.last_scores.tolist() == [[0.0] * 4]


def test_tree_is_truncated_to_the_tokens_asked(pairs):
    target, _ = pairs("llama")
    prompt = _ids(6, seed=51)
    head = FakeEagleHead(target, "eagle1", seed=51)
    drafter = EagleDrafter(head, tree={"depth": 5, "top_k": 4, "total_tokens": 30})
    _start(drafter, prompt, _states(target, prompt[:-1], head))
    for asked in (1, 2, 3, 8):
        proposal = _propose(drafter, prompt, asked)
        expect = {1: 4, 2: 4 + 16}.get(asked, 30)  # all nodes while fewer than total exist
        _check_structure(proposal, expect, max_depth=min(asked, 6))


def test_tree_settings_are_checked(pairs):
    head = TableHead(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="total_tokens"):
        EagleDrafter(head, tree={"depth": 3, "top_k": 2})
    with pytest.raises(ValueError, match="unknown: \\['width'\\]"):
        EagleDrafter(head, tree={"depth": 3, "top_k": 2, "total_tokens": 4, "width": 2})
    with pytest.raises(ValueError, match="top_k >= 1"):
        EagleDrafter(head, tree={"depth": 3, "top_k": 0, "total_tokens": 4})
    assert EagleDrafter(head).max_depth is None  # a chain: as asked


# ------------------------------------------------------------- end to end: lossless sampling


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, {"depth": 2, "top_k": 2, "total_tokens": 5}], ids=["chain", "tree"])
def test_sampled_decode_is_lossless(tree, pairs):
    """check_lossless (chi-square of t1 and (t1, t2) against the exact target law)."""
    target, _ = pairs("llama")
    prompt = torch.tensor([1, 5, 77, 140, 9])
    head, _ = _oracle_head(target, prompt, "eagle3", seed=61, draft_vocab=256, miss=0.0)
    drafter = EagleDrafter(head, tree=tree)
    result = check_lossless(target, drafter, prompt, num_draft_tokens=2, samples=1200, progress=False)
    assert 0.05 < result.acceptance_rate < 0.95, result.describe()
    assert result.passed, result.describe()
