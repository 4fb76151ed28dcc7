"""Medusa heads over a reduced draft vocabulary: the projections hold the draft tokens' rows, the
logits land in the target vocabulary (-inf elsewhere), the trainer masks what the heads cannot draft,
decoding stays greedy-identical and lossless, and vLLM's layout carries it as truncated_vocab_size and
a token_map, both ways."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import VOCAB, assert_lossless, tiny_model
from lifecycle_helpers import losses, toy_recipe, write_recipe
from safetensors.torch import load_file, save_file

from draftsmith.decoding import generate, generate_batch
from draftsmith.decoding.medusa import MedusaDrafter
from draftsmith.distill.vocab import build_vocab_map
from draftsmith.heads.medusa import MedusaError, MedusaHeads, export_medusa, load_medusa, save_medusa
from draftsmith.train.medusa import MedusaRecipe, head_parameters, main

VD = 96  # draft tokens of the toy target's VOCAB


def _vocab_map(seed=0):
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(seed))
    return build_vocab_map(counts, VD, "data-hash")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_the_heads_place_the_draft_rows_logits_in_the_target_vocabulary(target):
    vmap = _vocab_map()
    heads = MedusaHeads.for_target(target, num_heads=2, vocab_map=vmap)
    assert heads.lm_heads[0].weight.shape == (VD, target.config.hidden_size) and heads.config.reduced
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        logits = heads(hidden)  # [2, 3, V]
        full = target.get_output_embeddings()(hidden)  # the blocks start as the identity: the target's rows
    inside = vmap.t2d
    assert logits.shape == (2, 3, VOCAB) and torch.isinf(logits[..., ~inside]).all()
    torch.testing.assert_close(logits[0][..., inside], full[..., inside])
    assert torch.equal(heads.draft_ids(), vmap.target_ids())
    with pytest.raises(MedusaError, match="draft_vocab_size=4 with vocab_size=8, share_lm_head=True"):
        MedusaHeads.for_target(target).config.__class__(vocab_size=8, draft_vocab_size=4, share_lm_head=True)
    with pytest.raises(ValueError, match="share_lm_head projects with the target's whole lm_head"):
        MedusaRecipe(target="t", data="d", out="o", share_lm_head=True, draft_vocab_size=64)
    full_size, _ = head_parameters(MedusaRecipe(target="t", data="d", out="o", num_heads=2), target)
    reduced, _ = head_parameters(MedusaRecipe(target="t", data="d", out="o", num_heads=2, draft_vocab_size=VD), target)
    assert full_size - reduced == 2 * (VOCAB - VD) * target.config.hidden_size


@pytest.fixture(scope="module")
def trained(toy_dir, toy_data, tmp_path_factory):
    """(out, the heads) of a short training with a draft vocabulary of VD tokens, hard-label CE."""
    out = tmp_path_factory.mktemp("medusa-vocab") / "run"
    values = toy_recipe(toy_dir, toy_data, out, num_heads=3, draft_vocab_size=VD, log_every=1, eval_every=6)
    recipe = write_recipe(out.parent / "r.yaml", **values | {"heldout_fraction": 0.2, "lr": 1e-2})
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    return out, load_medusa(out / "heads")


@pytest.mark.parametrize("loss", ["ce", "forward_kl"])
def test_the_trainer_learns_over_the_draft_vocabulary(toy_dir, toy_data, tmp_path, loss):
    out = tmp_path / "run"
    values = toy_recipe(toy_dir, toy_data, out, num_heads=3, draft_vocab_size=VD, loss=loss, log_every=1)
    recipe = write_recipe(tmp_path / "r.yaml", **values | {"heldout_fraction": 0.2, "lr": 1e-2, "eval_every": 6})
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    values = losses(out)
    assert all(v == v for v in values) and sum(values[-3:]) / 3 < values[0], values
    heads = load_medusa(out / "heads")
    assert heads.config.draft_vocab_size == VD and int(heads.t2d.sum()) == VD


def test_decoding_is_greedy_identical_and_lossless(trained, toy_dir):
    from draftsmith.heads.models import load_causal_lm

    _, heads = trained
    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 9, 3)]
    reference = generate_batch(target, prompts, None, max_new_tokens=16).tokens
    out = generate_batch(target, prompts, MedusaDrafter(heads), num_draft_tokens=3, max_new_tokens=16)
    assert out.tokens == reference
    one = generate(target, MedusaDrafter(heads), prompts[0], max_new_tokens=16, num_draft_tokens=3)
    assert one.tokens == reference[0]
    # both branches of the verifier run: about 5% of these drafts are accepted on the flat toy target
    assert_lossless(target, MedusaDrafter(heads), prompts[0], 300, 1, rate=(0.01, 0.95))


def test_vllm_layout_carries_the_token_map_both_ways(trained, tmp_path):
    _, heads = trained
    vllm = export_medusa(heads, tmp_path / "vllm", "vllm")
    config = json.loads((vllm / "config.json").read_text())
    weights = load_file(str(vllm / "model.safetensors"))
    assert (config["vocab_size"], config["truncated_vocab_size"]) == (VOCAB, VD)
    assert torch.equal(weights["token_map"], heads.draft_ids()) and weights["lm_heads.0.weight"].shape[0] == VD
    back = load_medusa(vllm)
    hidden = torch.randn(2, heads.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden), heads(hidden))
    again = load_medusa(save_medusa(back, tmp_path / "hf"))
    assert torch.equal(again.d2t, heads.d2t) and torch.equal(again.t2d, heads.t2d)
    with pytest.raises(MedusaError, match="FasterDecoding's layout has no token map"):
        export_medusa(heads, tmp_path / "medusa", "medusa")
    # full-vocabulary rows with a token map (as vLLM accepts): the map's rows are kept
    full = torch.zeros(VOCAB, heads.config.hidden_size)
    full[heads.draft_ids()] = weights["lm_heads.0.weight"]
    save_file(weights | {"lm_heads.0.weight": full}, str(vllm / "model.safetensors"))
    torch.testing.assert_close(load_medusa(vllm).lm_heads[0].weight, heads.lm_heads[0].weight)
    save_file(weights, str(vllm / "model.safetensors"))
    (vllm / "config.json").write_text(json.dumps(config | {"truncated_vocab_size": VOCAB}))  # no map: full rows
    with pytest.raises(MedusaError, match=f"config.json says vocab_size={VOCAB} but the weights have {VD}"):
        load_medusa(vllm)
    (vllm / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in weights.items() if k != "token_map"}, str(vllm / "model.safetensors"))
    with pytest.raises(MedusaError, match=f"truncated_vocab_size={VD} < vocab_size={VOCAB} needs a token_map"):
        load_medusa(vllm)
