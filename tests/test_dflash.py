"""DFlash block drafters: the head, the anchored-block training, the drafter in the one decoder.

The decoder tests use a head fitted in-process (a few dozen steps of `dflash_losses`) to the toy
target's own greedy continuations of a few prompts, then decode those prompts: the head is right
often enough that whole blocks are accepted, so identity and losslessness are tested where the
verifier's every branch (accept, reject, bonus) runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import fixtures
import pytest
import torch
from fixtures import VOCAB
from lifecycle_helpers import (
    assert_loss_falls,
    assert_two_heads_evaluate,
    cache_hidden_args,
    eval_error_args,
    head_recipe,
    toy_recipe,
)
from safetensors.torch import load_file

from draftsmith.decoding.dflash import DFlashDrafter
from draftsmith.distill.losses import DIVERGENCES
from draftsmith.heads.blocks import choose_mask_token
from draftsmith.heads.dflash import DFlashConfig, DFlashError, DFlashHead
from draftsmith.heads.dflash_formats import load_dflash, save_dflash
from draftsmith.train.blocks import (
    anchor_block_mask,
    anchor_chunks,
    block_inputs,
    every_block,
    sample_anchors,
    slot_weights,
)
from draftsmith.train.dflash import DFlashRecipe, dflash_losses, main, train
from draftsmith.train.recipe import RecipeError, load_recipe

FAMILIES = ("llama", "qwen2", "mistral")
BLOCK = 4


# ------------------------------------------------------------------------- the head


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_parameter_counts(family, pairs):
    target, _ = pairs(family)
    c = target.config
    H, V, Vd, layers = c.hidden_size, c.vocab_size, 64, 2
    head = DFlashHead.for_target(
        target,
        num_layers=layers,
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
        aux_layer_ids=[0, 2],
        vocab_map=fixtures.fake_vocab_map(Vd),
    )
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    per_layer = 2 * H * H + 2 * H * kv + 3 * H * c.intermediate_size + 2 * H + 2 * (H // c.num_attention_heads)
    trained = 2 * H * H + H + layers * per_layer + H + Vd * H  # fc, hidden_norm, layers, norm, reduced lm_head
    assert sum(p.numel() for p in head.parameters() if p.requires_grad) == trained
    assert not head.embed_tokens.weight.requires_grad and head.frozen_keys() == ("embed_tokens.weight",)
    N, C, Q = 2, 5, 2 * BLOCK
    states = target(torch.randint(3, VOCAB, (N, C)), output_hidden_states=True).hidden_states
    context = head.project(torch.cat([states[0], states[2]], -1))
    positions = torch.arange(C + Q)[None].expand(N, -1)
    logits = head(
        torch.randint(3, VOCAB, (N, Q)), context, positions=positions, attention_mask=torch.zeros(N, 1, Q, C + Q)
    )
    assert logits.shape == (N, Q, Vd) and head.target_logits(logits).shape == (N, Q, V)
    full = DFlashHead.for_target(target, num_layers=1, block_size=BLOCK, mask_token_id=0, aux_layer_ids=[1])
    assert full.frozen_keys() == ("embed_tokens.weight", "lm_head.weight") and not full.lm_head.weight.requires_grad
    assert torch.equal(full.lm_head.weight, target.get_output_embeddings().weight)


def test_bad_inputs_each_get_one_clear_error(pairs, tmp_path):
    target, _ = pairs("llama")
    with pytest.raises(DFlashError, match="block_size=1; expected an integer >= 2"):
        DFlashHead.for_target(target, block_size=1, mask_token_id=5)
    with pytest.raises(DFlashError, match=f"mask_token_id={VOCAB} is outside the vocabulary 0..{VOCAB - 1}"):
        DFlashHead.for_target(target, block_size=BLOCK, mask_token_id=VOCAB)
    with pytest.raises(DFlashError, match=r"aux_layer_ids \[1, 3\].*0\.\.2"):
        DFlashHead.for_target(target, block_size=BLOCK, mask_token_id=5, aux_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="block_size = 1 must be >= 2"):
        DFlashRecipe(target="t", data="d", out="o", block_size=1)
    path = tmp_path / "r.yaml"
    path.write_text("target: t\ndata: d\nout: o\nblock_sise: 4\n")
    with pytest.raises(RecipeError, match="unknown key.*block_sise.*did you mean block_size"):
        load_recipe(DFlashRecipe, path)
    assert main(["--recipe", str(path), "--no-progress"]) == 2


def test_mask_token_choice():
    class Tok:
        def __init__(self, n, mask=None):
            self.n, self.mask_token_id, self.all_special_ids = n, mask, [0, 1, 2]

        def __len__(self):
            return self.n

    assert choose_mask_token(100, explicit=7, tokenizer=Tok(100, mask=3)) == (7, "recipe")
    assert choose_mask_token(100, tokenizer=Tok(100, mask=3)) == (3, "tokenizer")
    assert choose_mask_token(100, tokenizer=Tok(90)) == (99, "reserved")  # a row past the tokenizer
    assert choose_mask_token(100, tokenizer=Tok(100), used=[99, 98]) == (97, "reserved")


# ------------------------------------------------------------------------- anchored blocks


def _reference_mask(anchors, attention, block):
    B, A = anchors.shape
    T = attention.shape[1]
    out = torch.zeros(B, A * block, T + A * block, dtype=torch.bool)
    for b in range(B):
        for a in range(A):
            for k in range(block):
                q = a * block + k
                for s in range(T):
                    out[b, q, s] = bool(attention[b, s]) and s < int(anchors[b, a])
                for a2 in range(A):
                    for k2 in range(block):
                        out[b, q, T + a2 * block + k2] = a2 == a
    return out


def test_anchors_and_the_anchor_block_mask_match_a_reference():
    gen = torch.Generator().manual_seed(3)
    T = 13
    attention = torch.ones(3, T, dtype=torch.long)
    attention[1, 9:] = 0
    loss_mask = torch.rand(3, T, generator=gen) < 0.7
    anchors, valid = sample_anchors(loss_mask, attention, BLOCK, 5, gen)
    for b in range(3):
        picked = anchors[b][valid[b]].tolist()
        allowed = [p for p in range(T) if loss_mask[b, p] and attention[b, p] and p + BLOCK <= int(attention[b].sum())]
        assert picked == sorted(set(picked)) and set(picked) <= set(allowed) and len(picked) == min(5, len(allowed))
    assert torch.equal(anchor_block_mask(anchors, attention, BLOCK), _reference_mask(anchors, attention, BLOCK))
    ids = torch.arange(T)[None].expand(3, T) + 100
    block_ids, positions = block_inputs(ids, anchors, BLOCK, 7)
    assert block_ids[0, ::BLOCK].tolist() == (anchors[0] + 100).tolist()
    assert (block_ids.view(3, -1, BLOCK)[..., 1:] == 7).all()
    assert positions[0].tolist() == [p + k for p in anchors[0].tolist() for k in range(BLOCK)]
    weights = slot_weights(BLOCK, 4.0)
    assert weights[0] == 0 and torch.allclose(weights[1:], torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


@pytest.fixture(scope="module")
def short_answers(pairs):
    """(target, batch, states): three short greedy answers of the tiny llama target."""
    target, _ = pairs("llama")
    _, batch, states = fixtures.greedy_answers_batch(target, lengths=(4, 6, 3), new_tokens=12)
    return target, batch, states


def _short_head(short_answers):
    """(head, feats, anchors, valid): a fresh head over the short answers' states and 8 anchors per row."""
    target, batch, states = short_answers
    torch.manual_seed(0)
    head = DFlashHead.for_target(target, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1, aux_layer_ids=[0, 2])
    feats = fixtures.aux_features(states, head)
    gen = torch.Generator().manual_seed(0)
    return head, feats, *sample_anchors(batch["loss_mask"], batch["attention_mask"], BLOCK, 8, gen)


@pytest.mark.parametrize("loss", DIVERGENCES)
def test_each_loss_trains_and_keeps_the_slot_weights(short_answers, loss):
    _, batch, states = short_answers
    head, feats, anchors, valid = _short_head(short_answers)

    def loss_of(recipe):
        return dflash_losses(head, batch, feats, states.logits, anchors, valid, recipe, None)[0]

    recipe = DFlashRecipe(target="t", data="d", out="o", block_size=BLOCK, loss=loss)
    with torch.no_grad():  # slot 1 alone (gamma -> 0) differs from the slots near-evenly weighted
        assert loss_of(replace(recipe, decay_gamma=1e-3)) != loss_of(replace(recipe, decay_gamma=1e3))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        value = loss_of(recipe)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_dpace_weights_are_the_drafts_survival_and_train(short_answers):
    """loss_weighting: dpace: each draft weighs the survival it carries (draft_weights, from the
    hard CE on the target's argmax), the loss is their weighted mean, and it trains."""
    from draftsmith.distill.losses import dpace_weights
    from draftsmith.train.blocks import draft_weights

    _, batch, states = short_answers
    head, feats, anchors, valid = _short_head(short_answers)
    recipe = DFlashRecipe(target="t", data="d", out="o", block_size=BLOCK, loss_weighting="dpace", dpace_alpha=0.5)
    logits, targets = torch.randn(2, 3, BLOCK - 1, VOCAB), torch.randn(2, 3, BLOCK - 1, VOCAB)
    label = torch.rand(2, 3, BLOCK - 1) > 0.3
    hard = -torch.log_softmax(logits, -1).gather(-1, targets.argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(draft_weights(recipe, logits, targets, label), dpace_weights(hard, label, 0.5))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        value = dflash_losses(head, batch, feats, states.logits, anchors, valid, recipe, None)[0]
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    with pytest.raises(ValueError, match="loss_weighting = 'pace': expected one of decay, dpace"):
        DFlashRecipe(target="t", data="d", out="o", loss_weighting="pace")
    with pytest.raises(ValueError, match="dpace_alpha = 1.5 must be in"):
        DFlashRecipe(target="t", data="d", out="o", dpace_alpha=1.5)


def test_an_unknown_loss_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="loss = 'kl': expected one of forward_kl, .*lk_hybrid"):
        DFlashRecipe(target="t", data="d", out="o", loss="kl")
    path = tmp_path / "r.yaml"
    path.write_text("target: t\ndata: d\nout: o\nloss: kl\n")
    assert main(["--recipe", str(path), "--no-progress"]) == 2


# ------------------------------------------------------------------------- the decoder


@pytest.fixture(scope="module")
def fitted(pairs):
    """(target, a one-layer DFlash head fitted to the target's greedy continuations of `prompts`,
    prompts): 20 AdamW steps of `dflash_losses`."""
    target, _ = pairs("llama")
    prompts, batch, states = fixtures.greedy_answers_batch(target)
    torch.manual_seed(0)
    head = DFlashHead.for_target(
        target, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1, aux_layer_ids=[0, 1, 2]
    )
    recipe = DFlashRecipe(target="t", data="d", out="o", block_size=BLOCK, max_anchors=32)
    fixtures.fit_block_head(head, batch, states, recipe, dflash_losses, 20, BLOCK)
    return target, head.eval(), prompts


def test_greedy_equals_target_only_at_b1_and_b4(fitted):
    target, head, prompts = fitted
    fixtures.assert_greedy_is_target_only(target, DFlashDrafter, head, prompts, BLOCK - 1)


def test_the_walk_over_every_anchor_is_what_the_decoder_gets(fitted):
    """Held-out evaluation's blocks, one anchored at every position (in chunks), walked as the
    decoder walks: greedy decoding of the same prompts makes the same calls, so the same tau."""
    target, head, prompts = fitted
    _, batch, states = fixtures.greedy_answers_batch(target)  # the prompts' 40-token answers
    feats = fixtures.aux_features(states, head)
    recipe = DFlashRecipe(target="t", data="d", out="o", block_size=BLOCK, max_anchors=5)
    chains, starts, hits, trained = every_block(head, batch, feats, states.logits, recipe, None, dflash_losses)
    assert starts.sum(1).tolist() == [40] * len(prompts)  # the last prompt token (drafting the answer's first) on
    assert all(starts[b, len(p) - 1] and not starts[b, len(p) - 2] for b, p in enumerate(prompts))
    ((anchors, valid),) = anchor_chunks(batch["loss_mask"], batch["attention_mask"], starts.shape[1])[1]
    with torch.no_grad():
        _, whole, label, _ = dflash_losses(head, batch, feats, states.logits, anchors, valid, recipe, None)
    assert torch.equal(whole, chains) and torch.equal(trained, label.sum((0, 1)).double())  # chunks change nothing
    drafted = anchors[..., None] + torch.arange(1, BLOCK)  # slot k drafts the token at p + k: none past the batch
    padded = torch.nn.functional.pad(batch["loss_mask"], (0, BLOCK))
    assert torch.equal(label, padded.gather(1, drafted.flatten(1)).view_as(label) & valid[..., None])
    fixtures.assert_walk_is_decoded(target, DFlashDrafter(head), prompts, chains, starts, BLOCK - 1)


def _check_row(drafter, b, context, proposal, sampling):
    """Compares a proposal's logits (row b) with the head run from scratch on the row's whole context
    (the target's features of every token but the last, from one full target forward)."""
    head, n = drafter.head, len(context) - 1
    feats = fixtures.context_features(drafter.target, head, context)
    block = torch.tensor([[context[-1]] + [head.config.mask_token_id] * (BLOCK - 1)])
    positions = torch.arange(n + BLOCK)[None]
    logits = head(block, feats, positions=positions, attention_mask=torch.zeros(1, 1, BLOCK, n + BLOCK))
    torch.testing.assert_close(logits[0, 1:].float(), proposal.logits[b], atol=1e-4, rtol=0)
    return True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_holds_each_rows_verified_context(fitted, temperature):
    """Ragged rows (prompts of 4, 6 and 1 tokens), rows leaving the batch, accepted and rejected
    blocks: every proposal equals the head's from-scratch forward on that row's context."""
    fixtures.assert_rows_leaving_are_checked(fitted, DFlashDrafter, _check_row, BLOCK - 1, temperature)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
def test_sampled_decode_is_lossless(fitted, batch_size):
    """check_lossless: chi-square of t1 and (t1, t2) against the target's exact law."""
    target, head, prompts = fitted
    samples = 150 if batch_size == 1 else 300  # ~12 s and ~7 s on a busy 2-core machine
    fixtures.assert_lossless(target, DFlashDrafter(head), prompts[0], samples, batch_size)


# ------------------------------------------------------------------------- the trainer, end to end


def test_training_lowers_the_loss_reloads_bit_identically_and_evaluates(toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "dflash"
    recipe = DFlashRecipe(
        **head_recipe(toy_dir, toy_data, out, block_size=BLOCK, max_anchors=16, draft_vocab_size=64, log_every=1)
    )
    summary = train(recipe, progress=False)
    assert_loss_falls(out, 12)
    assert len(summary["eval"]["top1_per_slot"]) == BLOCK - 1 and 1.0 <= summary["eval"]["tau_simulated"] <= BLOCK
    assert summary["mask_token_source"] in ("tokenizer", "reserved")
    saved = load_file(str(out / "head" / "model.safetensors"))
    assert "embed_tokens.weight" not in saved and {"lm_head.weight", "d2t", "t2d"} <= set(saved)
    config = DFlashConfig.from_pretrained(out / "head")
    assert config.mask_token_id == summary["mask_token_id"] and config.block_size == BLOCK
    with pytest.raises(DFlashError, match="has hidden size 48 .* but target .* has 32"):
        load_dflash(out / "head", target=fixtures.tiny_model("llama", hidden=32))
    from draftsmith.heads.models import load_causal_lm

    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    head = load_dflash(out / "head", target=target)
    state = head.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight)
    save_dflash(head, tmp_path / "again")
    again = load_dflash(tmp_path / "again", target=target).state_dict()
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)
    assert_two_heads_evaluate(run_cli, toy_dir, "--dflash", out / "head", tmp_path / "again", tmp_path / "ev")
    # The speculators layout: the key set vLLM loads, and it loads back with identical outputs.
    code, _, err = run_cli(
        ["export", out / "head", "--format", "vllm", "--target", toy_dir / "target", "--out", tmp_path / "v"]
    )
    assert code == 0, err
    exported = json.loads((tmp_path / "v" / "config.json").read_text())
    assert exported["speculators_model_type"] == "dflash" and exported["mask_token_id"] == config.mask_token_id
    assert exported["aux_hidden_state_layer_ids"] == config.aux_layer_ids and exported["block_size"] == BLOCK
    assert exported["transformer_layer_config"]["num_hidden_layers"] == 1
    assert set(load_file(str(tmp_path / "v" / "model.safetensors"))) == set(saved)
    served = load_dflash(tmp_path / "v", target=target)
    ids, context = torch.randint(3, VOCAB, (2, BLOCK)), torch.randn(2, 5, config.hidden_size)
    args = dict(
        positions=torch.arange(5 + BLOCK)[None].expand(2, -1), attention_mask=torch.zeros(2, 1, BLOCK, 5 + BLOCK)
    )
    assert torch.equal(served(ids, context, **args), head(ids, context, **args))
    code, _, err = run_cli(["export", out / "head", "--format", "vllm", "--out", tmp_path / "v2"])
    assert code == 0, err  # both layouts hold the same tensors (never the target's): --target only checks
    assert json.loads((tmp_path / "v2" / "config.json").read_text()) == exported
    code, _, err = run_cli(eval_error_args(toy_dir, "--dflash", toy_dir / "target", out=tmp_path / "x"))
    assert code == 2 and "expected a DFlash head folder" in err


def test_offline_hidden_cache(toy_dir, toy_data, tmp_path, run_cli):
    from draftsmith.distill.hidden_cache import CacheError

    cache = tmp_path / "cache"
    code, _, err = run_cli(cache_hidden_args(toy_dir, toy_data, cache, "1,last"))
    assert code == 0, err

    def recipe(out, **values):
        offline = dict(max_steps=2, warmup_steps=1, block_size=BLOCK, max_anchors=8, hidden_cache=str(cache))
        return DFlashRecipe(**toy_recipe(toy_dir, toy_data, tmp_path / out, **offline, **values))

    summary = train(recipe("offline"), progress=False)
    assert summary["aux_layers"] == [1] and summary["steps"] == 2  # a 2-layer target: aux (1), teacher from `last`
    with pytest.raises(CacheError, match="the trainer needs"):
        train(recipe("o2", aux_layers=[0]), progress=False)
    with pytest.raises(RecipeError, match=f"mask_token_id = {VOCAB} is outside the target's vocabulary 0..{VOCAB - 1}"):
        train(recipe("o3", mask_token_id=VOCAB), progress=False)
