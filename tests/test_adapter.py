"""CausalLMAdapter against the plain reference: one full forward of the unmodified HF model.

Every optimised path of the adapter (incremental feeding against its KV cache, cropping after
a rejection, tree verification with a 4-D mask and explicit positions) must reproduce what a
full recompute of the same tokens gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.heads.target import CausalLMAdapter, tree_attention_mask
from fixtures import FAMILIES, HEAD_SCALE, VOCAB, tiny_config, tiny_model


ATOL = 1e-5  # fp32; observed differences between cached and full forwards are ~4e-6
ATTN = ("sdpa", "eager")


def _model(family: str, attn: str):
    model = tiny_model(family)
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    return model


def _random_ids(length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=gen)


@torch.no_grad()
def _full(model, ids: torch.Tensor):
    return model(ids, output_hidden_states=True)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL:g}"


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_feeding_matches_full_forward(family, attn):
    model = _model(family, attn)
    ids = _random_ids(30, seed=1)
    full = _full(model, ids)
    adapter = CausalLMAdapter(model)
    layers = (0, 1, adapter.num_layers)  # embeddings, a middle layer, the final (post-norm) one
    assert len(full.hidden_states) == adapter.num_layers + 1
    adapter.reset()
    assert adapter.seq_len == 0

    garbage = _random_ids(4, seed=2)
    # (action, argument): feed ids[start:stop], or feed garbage and crop back to the length.
    steps = [
        ("feed", (0, 9)),  # prefill
        ("feed", (9, 10)),  # one token (a plain decode step)
        ("feed", (10, 14)),  # a chunk (a verified chain)
        ("garbage", 3),  # rejected drafts...
        ("feed", (14, 15)),  # ...cropped away, decoding continues
        ("garbage", 4),
        ("garbage", 1),
        ("feed", (15, 22)),
        ("feed", (22, 30)),
    ]
    for action, arg in steps:
        if action == "garbage":
            before = adapter.seq_len
            adapter.forward(garbage[:, :arg])
            assert adapter.seq_len == before + arg
            adapter.crop(before)
            assert adapter.seq_len == before
            continue
        start, stop = arg
        assert adapter.seq_len == start
        out = adapter.forward(ids[:, start:stop], hidden_layers=layers)
        assert adapter.seq_len == stop
        assert out.logits.shape == (1, stop - start, VOCAB)
        _close(out.logits, full.logits[:, start:stop], f"logits of tokens {start}:{stop}")
        assert sorted(out.hidden_states) == sorted(layers)
        for layer in layers:
            _close(
                out.hidden_states[layer],
                full.hidden_states[layer][:, start:stop],
                f"hidden state {layer} of tokens {start}:{stop}",
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_to_zero_and_logits_to_keep(family):
    model = tiny_model(family)
    ids = _random_ids(12, seed=3)
    full = _full(model, ids)
    adapter = CausalLMAdapter(model)
    adapter.reset()
    adapter.forward(ids[:, :5])
    adapter.crop(5)  # a no-op
    assert adapter.seq_len == 5
    adapter.crop(0)
    assert adapter.seq_len == 0
    out = adapter.forward(ids, logits_to_keep=1)
    assert out.logits.shape == (1, 1, VOCAB)
    assert out.hidden_states == {}
    _close(out.logits, full.logits[:, -1:], "last logits after crop(0)")
    # reset() starts over as well
    adapter.reset()
    _close(adapter.forward(ids).logits, full.logits, "logits after reset()")


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


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_verification_matches_path_recompute(family, attn):
    model = _model(family, attn)
    past = _random_ids(10, seed=4)
    adapter = CausalLMAdapter(model)
    adapter.reset()
    adapter.forward(past)
    mask, depth = tree_attention_mask(PARENTS, past_len=past.shape[1])
    assert mask.shape == (1, 1, len(PARENTS), past.shape[1] + len(PARENTS))
    assert depth.tolist() == [len(_path(i)) - 1 for i in range(len(PARENTS))]
    tokens = torch.tensor([TREE_TOKENS])
    last = adapter.num_layers
    out = adapter.forward(
        tokens,
        position_ids=(past.shape[1] + depth).unsqueeze(0),
        attention_mask=mask,
        hidden_layers=(last,),
    )
    assert out.logits.shape == (1, len(PARENTS), VOCAB)
    for node in range(len(PARENTS)):
        path = torch.tensor([[TREE_TOKENS[i] for i in _path(node)]])
        full = _full(model, torch.cat([past, path], dim=1))
        _close(out.logits[0, node], full.logits[0, -1], f"tree node {node} logits")
        hidden = out.hidden_states[last][0, node]
        _close(hidden, full.hidden_states[last][0, -1], f"tree node {node} hidden state")

    # Accept the branch 0 -> 2 -> 5: crop the tree away, feed the branch as a chain, continue.
    adapter.crop(past.shape[1])
    branch = torch.tensor([[TREE_TOKENS[i] for i in _path(5)] + [7, 8]])
    full = _full(model, torch.cat([past, branch], dim=1))
    _close(adapter.forward(branch).logits, full.logits[:, past.shape[1] :], "chain after the tree")


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_mask_matters(family):
    """Control: without the tree mask (all visible) node 2 would see its sibling-branch node 1."""
    model = tiny_model(family)
    past = _random_ids(6, seed=5)
    adapter = CausalLMAdapter(model)
    adapter.reset()
    adapter.forward(past)
    mask, depth = tree_attention_mask(PARENTS, past_len=6)
    positions = (6 + depth).unsqueeze(0)
    tokens = torch.tensor([TREE_TOKENS])
    good = adapter.forward(tokens, position_ids=positions, attention_mask=mask).logits
    adapter.crop(6)
    open_mask = torch.zeros_like(mask)
    bad = adapter.forward(tokens, position_ids=positions, attention_mask=open_mask).logits
    assert (good[0, 2:] - bad[0, 2:]).abs().max() > 1e-2


def test_errors_leave_the_cache_untouched():
    model = tiny_model("llama")
    adapter = CausalLMAdapter(model)
    adapter.reset()
    adapter.forward(_random_ids(5, seed=6))
    tokens = torch.tensor([TREE_TOKENS[:3]])
    mask, depth = tree_attention_mask([-1, 0, 0], past_len=5)
    positions = (5 + depth).unsqueeze(0)

    with pytest.raises(ValueError, match="crop"):
        adapter.crop(6)  # longer than the cache
    with pytest.raises(ValueError, match="bool"):
        adapter.forward(tokens, position_ids=positions, attention_mask=mask == 0)
    with pytest.raises(ValueError, match="mask"):
        adapter.forward(tokens, position_ids=positions, attention_mask=mask[..., 5:])  # no past
    with pytest.raises(ValueError, match="mask"):
        adapter.forward(tokens, position_ids=positions, attention_mask=mask[0])  # 3-D
    with pytest.raises(ValueError, match="mask"):
        adapter.forward(tokens[:, :2], position_ids=positions[:, :2], attention_mask=mask)
    assert adapter.seq_len == 5

    with pytest.raises(ValueError, match="parent"):
        tree_attention_mask([-1, 1], past_len=0)  # a node cannot be its own parent
    with pytest.raises(ValueError, match="parent"):
        tree_attention_mask([-1, 2, 0], past_len=0)  # parents come first


def test_crop_to_a_negative_length_raises():
    adapter = CausalLMAdapter(tiny_model("llama"))
    adapter.reset()
    adapter.forward(_random_ids(5, seed=7))
    with pytest.raises(ValueError, match="crop"):
        adapter.crop(-2)
    assert adapter.seq_len == 5


def test_crop_past_a_sliding_window():
    """Sliding-window targets (Mistral, Gemma) must crop after the window is full."""
    config = tiny_config("mistral")
    config.sliding_window = 6  # the fixtures disable it; real Mistral checkpoints use 4096
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    ids = _random_ids(20, seed=8)
    full = _full(model, ids)
    adapter = CausalLMAdapter(model)
    adapter.reset()
    _close(adapter.forward(ids[:, :10]).logits, full.logits[:, :10], "prefill past the window")
    adapter.forward(_random_ids(3, seed=9))  # rejected drafts
    adapter.crop(10)
    _close(adapter.forward(ids[:, 10:]).logits, full.logits[:, 10:], "after the crop")
