"""The decoding runtime's KV store (`decoding/kv.py`) against the plain
reference: one full forward of the unmodified HF model.

Every move the decoder makes on a target's cache (incremental feeding with explicit positions,
dropping rejected drafts, tree verification with an ancestor mask and depth positions, keeping
an accepted path between holes) must reproduce what a full recompute of the same tokens gives,
on a store sized for the test and on one that starts too small and grows while fed.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import FAMILIES, VOCAB, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from draftsmith.decoding.kv import KVStore
from draftsmith.decoding.masks import tree_attend

ATOL = 1e-5  # fp32; observed differences between cached and full forwards are ~4e-6
ATTN = ("sdpa", "eager")
STORES = ("grown", "sized")


# A test runs on every family, attention implementation and store that its arguments name.
@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=ATTN)
def attn(request):
    return request.param


@pytest.fixture(params=STORES)
def store(request):
    return request.param


def _model(family: str, attn: str):
    model = tiny_model(family)
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    return model


def _cache(model, store: str) -> KVStore:
    """ "grown": 8 columns, reallocated by the first feed (and later ones); "sized": 64."""
    return KVStore.for_model(model, 1, 8 if store == "grown" else 64, owner="the test model")


def _random_ids(length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=gen)


@torch.no_grad()
def _full(model, ids: torch.Tensor):
    return model(ids, output_hidden_states=True)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:g}"


def _feed(model, kv, ids, **kwargs):
    """A chain of ids [1, n] after the row's real tokens (positions follow on)."""
    positions = kv.counts[0] + torch.arange(ids.shape[1])
    return kv.forward(model, ids, positions[None], **kwargs)


def test_incremental_feeding_matches_full_forward(family, attn, store):
    model = _model(family, attn)
    ids = _random_ids(30, seed=1)
    full = _full(model, ids)
    kv = _cache(model, store)
    num_layers = model.config.num_hidden_layers
    layers = (0, 1, num_layers)  # embeddings, a middle layer, the final (post-norm) one
    assert len(full.hidden_states) == num_layers + 1
    assert kv.counts == [0] and kv.length == 0

    garbage = _random_ids(4, seed=2)
    # (action, argument): feed ids[start:stop], or feed garbage and drop it again (rejected
    # drafts: kept by no row, so cut at once; or committed whole and retained as none).
    steps = [
        ("feed", (0, 9)),  # prefill
        ("feed", (9, 10)),  # one token (a plain decode step)
        ("feed", (10, 14)),  # a chunk (a verified chain)
        ("garbage", 3),  # rejected drafts...
        ("feed", (14, 15)),  # ...dropped, decoding continues
        ("retained", 4),
        ("garbage", 1),
        ("feed", (15, 22)),
        ("feed", (22, 30)),
    ]
    for action, arg in steps:
        if action != "feed":
            before = kv.length
            _feed(model, kv, garbage[:, :arg])
            if action == "garbage":
                kv.commit(torch.zeros(1, arg, dtype=torch.bool))
            else:
                kv.commit_spans(arg)
                assert kv.length == before + arg
                kv.retain(before, [0])
            assert kv.length == before and kv.counts == [before]
            continue
        start, stop = arg
        assert kv.counts == [start]
        out = _feed(model, kv, ids[:, start:stop], hidden_layers=layers)
        kv.commit_spans(stop - start)
        assert kv.counts == [stop]
        assert out.logits.shape == (1, stop - start, VOCAB)
        _close(out.logits, full.logits[:, start:stop], f"logits of tokens {start}:{stop}")
        assert sorted(out.hidden_states) == sorted(layers)
        for layer in layers:
            _close(
                out.hidden_states[layer],
                full.hidden_states[layer][:, start:stop],
                f"hidden state {layer} of tokens {start}:{stop}",
            )


def test_drop_everything_and_logits_to_keep(family, store):
    model = tiny_model(family)
    ids = _random_ids(12, seed=3)
    full = _full(model, ids)
    kv = _cache(model, store)
    _feed(model, kv, ids[:, :5])
    kv.commit_spans(5)
    kv.retain(0, [5])  # a no-op
    assert kv.counts == [5] and kv.length == 5
    kv.retain(0, [0])
    assert kv.counts == [0] and kv.length == 0
    out = _feed(model, kv, ids, logits_to_keep=1)
    kv.commit_spans(ids.shape[1])
    assert out.logits.shape == (1, 1, VOCAB)
    assert out.hidden_states == {}
    _close(out.logits, full.logits[:, -1:], "last logits after dropping everything")
    kv.reset()  # starts over as well
    _close(_feed(model, kv, ids).logits, full.logits, "logits after reset()")


# A small tree: nodes 0 and 1 are siblings at depth 0, 2 and 3 are siblings under 0, 5 and 6
# siblings under 2; node 4 hangs under 1, 7 under 4. Nodes 3 and 4 carry the same token (same
# token, different branches) and node 6 repeats node 0's token (same token, different depth).
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4]
TREE_TOKENS = [17, 250, 99, 123, 123, 40, 17, 301]


def _path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


def _tree_forward(model, kv, past, *, attend=None, hidden_layers=()):
    """Cache past[:-1]; feed [past[-1], tree nodes] with the tree's ancestor mask (or `attend`)
    and depth positions, as a verification does."""
    _feed(model, kv, past[:, :-1])
    kv.commit_spans(past.shape[1] - 1)
    tree, depths = tree_attend([PARENTS], 1 + len(PARENTS), model.device)
    fed = torch.cat([past[:, -1:], torch.tensor([TREE_TOKENS])], dim=1)
    positions = past.shape[1] - 1 + torch.tensor(depths)
    out = kv.forward(model, fed, positions, tree if attend is None else attend, hidden_layers=hidden_layers)
    return out, depths[0]


def test_tree_verification_matches_path_recompute(family, attn, store):
    model = _model(family, attn)
    past = _random_ids(10, seed=4)
    kv = _cache(model, store)
    last = model.config.num_hidden_layers
    out, depths = _tree_forward(model, kv, past, hidden_layers=(last,))
    assert depths == [0] + [len(_path(i)) for i in range(len(PARENTS))]
    assert out.logits.shape == (1, 1 + len(PARENTS), VOCAB)
    _close(out.logits[0, 0], _full(model, past).logits[0, -1], "the fed last token's logits")
    for node in range(len(PARENTS)):
        path = torch.tensor([[TREE_TOKENS[i] for i in _path(node)]])
        full = _full(model, torch.cat([past, path], dim=1))
        _close(out.logits[0, node + 1], full.logits[0, -1], f"tree node {node} logits")
        hidden = out.hidden_states[last][0, node + 1]
        _close(hidden, full.hidden_states[last][0, -1], f"tree node {node} hidden state")

    # Accept the branch 0 -> 2 -> 5: keep `last` and its nodes where they were fed (holes in
    # between), then decode on: the logits of sequential decoding of that branch.
    keep = torch.zeros(1, 1 + len(PARENTS), dtype=torch.bool)
    keep[0, [0] + [i + 1 for i in _path(5)]] = True
    kv.commit(keep)
    assert kv.counts == [past.shape[1] + 3]
    after = torch.tensor([[7, 8]])
    branch = torch.tensor([[TREE_TOKENS[i] for i in _path(5)]])
    full = _full(model, torch.cat([past, branch, after], dim=1))
    _close(_feed(model, kv, after).logits, full.logits[:, -2:], "chain after the tree")


def test_tree_mask_matters(family, store):
    """Control: without the tree mask (all visible) node 2 would see its sibling-branch node 1."""
    model = tiny_model(family)
    past = _random_ids(6, seed=5)
    good, _ = _tree_forward(model, _cache(model, store), past)
    everything = torch.ones(1, 1 + len(PARENTS), 1 + len(PARENTS), dtype=torch.bool)
    bad, _ = _tree_forward(model, _cache(model, store), past, attend=everything)
    assert (good.logits[0, 3:] - bad.logits[0, 3:]).abs().max() > 1e-2


def test_errors_leave_the_cache_untouched():
    model = tiny_model("llama")
    kv = _cache(model, "grown")
    _feed(model, kv, _random_ids(5, seed=6))
    kv.commit_spans(5)
    with pytest.raises(ValueError, match="retain"):
        kv.retain(0, [6])  # longer than the cache
    with pytest.raises(ValueError, match="retain"):
        kv.retain(0, [-2])
    with pytest.raises(ValueError, match="retain"):
        kv.retain(6, [0])  # past its end
    with pytest.raises(RuntimeError, match="out of step"):
        kv.commit_spans(3)  # nothing was fed
    assert kv.counts == [5] and kv.length == 5

    with pytest.raises(ValueError, match="parent"):
        tree_attend([[1]], 2, model.device)  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parent"):
        tree_attend([[-1, 2, 0]], 4, model.device)  # parents come first


def test_an_unsupported_layer_kind_is_refused(store):
    """Full and sliding-window layers are taken (tests/test_sliding_window.py); any other kind
    (here Llama-4's chunked attention) is refused, naming it."""
    config = tiny_config("qwen2")
    config.layer_types, config.attention_chunk_size = ["full_attention", "chunked_attention"], 4
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="runs full-attention, sliding-window .*chunked_attention"):
        _cache(model, store)
