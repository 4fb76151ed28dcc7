"""Domino: the DFlash backbone with a GRU over the target's embeddings of the drafts before each slot;
the GRU stepped while drafting against the GRU run over a whole teacher-forced block (and PyTorch's
gate equations); the base-loss weight's schedule; the drafter in the one decoder (greedy identity
at batch 1 and 3, every sampled q against the head recomputed from scratch, losslessness); both
layouts on disk (draftsmith's and SpecForge's).

As in tests/test_dspark.py, the decoder tests use a head fitted in-process to the toy target's own
greedy continuations, so whole blocks are accepted and every branch of the verifier runs.
"""

from __future__ import annotations

import json

import fixtures
import pytest
import torch
from fixtures import VOCAB
from lifecycle_helpers import toy_recipe

from draftsmith.decoding import generate
from draftsmith.decoding.domino import DominoDrafter
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.distill.losses import divergence
from draftsmith.distill.vocab import build_vocab_map
from draftsmith.heads.domino import DominoConfig, DominoError, DominoHead
from draftsmith.heads.domino_formats import export_folder, export_specforge, load_domino, save_domino
from draftsmith.train.blocks import sample_anchors
from draftsmith.train.domino import DominoRecipe, base_loss_weight, domino_losses, head_parameters

BLOCK = 4  # slot 0 the anchor, 3 drafts per block
GRU, PROJ = 16, 8


def _head(target, seed=0, aux=(0, 1, 2), **config):
    head = fixtures.block_head(DominoHead, target, BLOCK, seed, aux, gru_hidden=GRU, proj_dim=PROJ, **config)
    with torch.no_grad():  # a correction that is not zero, so it is exercised from the start
        head.embed_proj[2].weight.normal_(0, 0.5)
    return head


def _gru_reference(gru: torch.nn.GRU, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's GRU equations (gates r, z, n; no biases), written out: states [N, T, G] of x [N, T, H]."""
    w_r, w_z, w_n = gru.weight_ih_l0.chunk(3)
    u_r, u_z, u_n = gru.weight_hh_l0.chunk(3)
    h, out = torch.zeros(x.shape[0], gru.hidden_size), []
    for t in range(x.shape[1]):
        r = torch.sigmoid(x[:, t] @ w_r.T + h @ u_r.T)
        z = torch.sigmoid(x[:, t] @ w_z.T + h @ u_z.T)
        n = torch.tanh(x[:, t] @ w_n.T + r * (h @ u_n.T))
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out, 1)


def test_the_gru_stepped_is_the_gru_over_the_block(pairs):
    """Drafting's one GRU step per slot (`corrected`, carrying the state) equals the trainer's one GRU
    pass over the block (`block_logits`), and both follow the GRU equations written out."""
    target, _ = pairs("llama")
    head = _head(target)
    h = torch.randn(3, BLOCK, head.config.hidden_size)  # [N, B, H]
    tokens = torch.randint(0, VOCAB, (3, BLOCK))  # [N, B]: the anchor, then the block's tokens
    with torch.no_grad():
        base, final = head.block_logits(h, tokens)
        state, steps, states = None, [], []
        for k in range(1, BLOCK):
            logits, state = head.corrected(head.lm_head(h[:, k]), tokens[:, k - 1], h[:, k], state)
            steps.append(logits)
            states.append(state)
        reference = _gru_reference(head.prefix_gru, head.embed_tokens(tokens[:, :-1]))  # [N, B-1, G]
    torch.testing.assert_close(torch.stack(states, 1), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(steps, 1), final, atol=1e-5, rtol=1e-5)
    assert final.shape == (3, BLOCK - 1, VOCAB)  # the drafting slots only: the anchor's drafts nothing
    torch.testing.assert_close(base, head.lm_head(h[:, 1:]))
    assert not torch.allclose(final, base)  # the correction is there
    # the state after k tokens depends on all of them: change the anchor, every later slot moves
    other = tokens.clone()
    other[:, 0] = (other[:, 0] + 1) % VOCAB
    with torch.no_grad():
        assert not torch.allclose(head.block_logits(h, other)[1][:, -1], final[:, -1])


def test_a_new_head_drafts_as_its_backbone_and_bad_settings_are_refused(pairs):
    target, _ = pairs("llama")
    torch.manual_seed(0)
    head = DominoHead.for_target(
        target, block_size=BLOCK, mask_token_id=VOCAB - 1, aux_layer_ids=[1], gru_hidden=GRU, proj_dim=PROJ
    )
    h, tokens = torch.randn(2, BLOCK, head.config.hidden_size), torch.randint(0, VOCAB, (2, BLOCK))
    base, final = head.block_logits(h, tokens)
    assert torch.equal(base, final)  # W2 starts at zero
    trained = {n for n, p in head.named_parameters() if p.requires_grad}
    assert {
        "prefix_gru.weight_ih_l0",
        "prefix_gru.weight_hh_l0",
        "embed_proj.0.weight",
        "embed_proj.2.weight",
    } <= trained
    assert "embed_tokens.weight" not in trained and head.config.drafts_per_block == BLOCK - 1
    for bad in ({"gru_hidden": 0}, {"proj_dim": -1}, {"gru_hidden": 1.5}):
        with pytest.raises(DominoError, match=f"{next(iter(bad))}="):
            DominoConfig(mask_token_id=1, aux_layer_ids=[0], vocab_size=VOCAB, **bad)
    for bad, message in (
        ({"gru_hidden": 0}, "gru_hidden = 0 must be >= 1"),
        ({"lambda_decay_fraction": 1.5}, r"lambda_decay_fraction = 1.5 must be in \[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            DominoRecipe(target="t", data="d", out="o", **bad)


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_the_parameter_count_is_the_built_heads(pairs, draft_vocab):
    """`head_parameters` (the memory estimate's count, before the target loads) against the head
    `train` builds: the backbone, the GRU and the MLP trained; the target's embeddings (and a
    full-vocabulary lm_head) frozen."""
    target, _ = pairs("llama")
    vocab_map = None if draft_vocab is None else build_vocab_map(torch.arange(VOCAB), draft_vocab, "hash")
    recipe = DominoRecipe(
        target="t", data="d", out="o", num_layers=2, aux_layers=[0, 2], draft_vocab_size=draft_vocab, gru_hidden=12
    )
    head = DominoHead.for_target(
        target,
        num_layers=2,
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
        aux_layer_ids=[0, 2],
        vocab_map=vocab_map,
        gru_hidden=12,
        proj_dim=recipe.proj_dim,
    )
    assert head_parameters(recipe, target) == fixtures.parameter_counts(head)


def test_the_base_loss_weight_falls_from_1_to_0_over_its_fraction():
    recipe = DominoRecipe(target="t", data="d", out="o", max_steps=100, lambda_decay_fraction=0.5)
    assert [base_loss_weight(recipe, s) for s in (0, 10, 25, 50, 51, 99)] == [1.0, 0.8, 0.5, 0.0, 0.0, 0.0]
    assert base_loss_weight(recipe, None) == 0.0  # held-out batches: the final logits only
    whole = DominoRecipe(target="t", data="d", out="o", max_steps=100, lambda_decay_fraction=1.0)
    assert base_loss_weight(whole, 50) == 0.5 and base_loss_weight(whole, 100) == 0.0
    never = DominoRecipe(target="t", data="d", out="o", max_steps=100, lambda_decay_fraction=0.0)
    assert base_loss_weight(never, 0) == 0.0


def test_the_loss_mixes_the_final_and_base_terms_by_the_schedule(pairs):
    """At lambda = 1 the loss is the backbone's alone (the correction gets no gradient), at 0 the
    corrected logits' alone, and in between the mix (1 - lambda) final + lambda base."""
    target, _ = pairs("llama")
    _, batch, states = fixtures.greedy_answers_batch(target)
    head = _head(target)
    feats = fixtures.aux_features(states, head)
    recipe = DominoRecipe(target="t", data="d", out="o", block_size=BLOCK, max_steps=10, lambda_decay_fraction=0.5)
    anchors, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], BLOCK, 6, torch.Generator().manual_seed(0)
    )

    def loss_at(step):
        head.zero_grad()
        loss, _, label, _ = domino_losses(
            head, {**batch, "step": step}, feats, states.logits, anchors, valid, recipe, None
        )
        loss.backward()
        return loss.detach(), label, {n: p.grad for n, p in head.named_parameters() if p.requires_grad}

    base_only, label, grads = loss_at(0)
    assert label.any() and all(
        grads[n] is None or not grads[n].any() for n in grads if n.startswith(("prefix_gru", "embed_proj"))
    )
    assert grads["fc.weight"].abs().sum() > 0
    final_only, _, grads = loss_at(5)  # lambda reaches 0 at 0.5 x 10 steps
    assert grads["embed_proj.2.weight"].abs().sum() > 0 and grads["prefix_gru.weight_hh_l0"].abs().sum() > 0
    assert not torch.allclose(base_only, final_only)
    torch.testing.assert_close(loss_at(2)[0], 0.4 * final_only + 0.6 * base_only)  # lambda(2) = 1 - 2/5
    # final-only is the soft CE of the corrected logits against the target, weighted exp(-(k-1)/gamma)
    with torch.no_grad():
        base, final = head.block_logits(*fixtures.teacher_forced_blocks(head, batch, feats, anchors, BLOCK))
    B, A = anchors.shape
    final = final.view(B, A, BLOCK - 1, -1)
    at = (anchors[..., None] + torch.arange(BLOCK - 1)).clamp(max=batch["input_ids"].shape[1] - 1)
    targets = states.logits.gather(1, at.flatten(1)[..., None].expand(-1, -1, VOCAB)).view(B, A, BLOCK - 1, -1)
    per_slot = divergence("soft_ce", final.float(), targets, label, reduction="none")
    weights = torch.exp(-torch.arange(BLOCK - 1) / recipe.decay_gamma) * label
    torch.testing.assert_close(final_only, (per_slot * weights).sum() / weights.sum())


@pytest.fixture(scope="module")
def fitted(pairs):
    """(target, a Domino head fitted to the target's greedy continuations of `prompts`, prompts, recipe),
    trained with the schedule: lambda falls to 0 at step 10 of 25."""
    target, _ = pairs("llama")
    prompts, batch, states = fixtures.greedy_answers_batch(target)
    head = _head(target)
    recipe = DominoRecipe(
        target="t", data="d", out="o", block_size=BLOCK, max_anchors=32, max_steps=25, lambda_decay_fraction=0.4
    )
    losses = fixtures.fit_block_head(
        head, batch, states, recipe, domino_losses, recipe.max_steps, BLOCK, with_step=True
    )
    assert sum(losses[-3:]) < sum(losses[:3])
    head.eval()
    h, tokens = torch.randn(2, BLOCK, head.config.hidden_size), torch.randint(0, VOCAB, (2, BLOCK))
    with torch.no_grad():
        base, final = head.block_logits(h, tokens)
    assert not torch.allclose(base, final)  # the correction trained is in play while decoding
    return target, head, prompts, recipe


def test_greedy_equals_target_only_at_b1_and_b3(fitted):
    target, head, prompts, _ = fitted
    # the anchor drafts nothing: every call proposes at most BLOCK - 1
    checks = dict(rows=3, singles=1, min_accepted=5, min_batch_accepted=10, drafts_every_slot=True)
    fixtures.assert_greedy_is_target_only(target, DominoDrafter, head, prompts, BLOCK - 1, **checks)


def test_the_walk_over_every_anchor_is_what_the_decoder_gets(fitted):
    """Held-out blocks anchored at every position, walked as the decoder walks them: the same calls
    and the same tau as greedy decoding (the teacher-forced GRU reads what a correct chain drafted)."""
    target, head, prompts, recipe = fitted
    chains, starts = fixtures.anchored_blocks(target, head, recipe, domino_losses)
    assert chains.shape[-1] == BLOCK - 1 and starts.sum(1).tolist() == [40] * len(prompts)
    fixtures.assert_walk_is_decoded(target, DominoDrafter(head), prompts, chains, starts, BLOCK - 1)


def _check_row(drafter, b, context, proposal, sampling):
    """Compares a sampled proposal's q (row b) with the head recomputed from scratch on the row's whole
    context: the backbone over the target's features of every token but the last, then one GRU
    pass over [anchor, the drafts made], softmax of the corrected logits. A row that drafts nothing
    is not checked."""
    head, count = drafter.head, proposal.counts[b]
    if not count:
        return False
    h = fixtures.block_hidden(drafter.target, head, context, BLOCK)  # [1, B, H]
    tokens = torch.tensor([[context[-1], *proposal.tokens[b, :count].tolist()]])  # [1, 1 + count]
    law = head.block_logits(h[:, : 1 + count], tokens)[1][0].float().softmax(-1)  # [count, V]
    torch.testing.assert_close(proposal.probs[b, :count], law, atol=1e-5, rtol=1e-4)
    return True


Checked = fixtures.checking_drafter_class(DominoDrafter, _check_row)


def test_each_draft_comes_from_the_corrected_law_it_reports(fitted):
    """Sampled proposals at batch 3 (ragged rows, rejections): q_k is softmax(U_k + correction(s_k)),
    s_k the GRU state after the anchor and the drafts actually made before slot k."""
    target, head, prompts, _ = fitted
    drafter = Checked(head, target)
    fixtures.decode_ragged_sampled(target, prompts, drafter, BLOCK - 1, SamplingConfig(temperature=1.0))
    assert drafter.checked >= 6, drafter.checked


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3])
def test_sampled_decode_is_lossless(fitted, batch_size):
    """check_lossless at T = 1: chi-square of t1 and (t1, t2) against the target's exact law."""
    target, head, prompts, _ = fitted
    fixtures.assert_lossless(target, DominoDrafter(head), prompts[0], 150 * batch_size, batch_size)


def test_both_layouts_round_trip_with_the_same_tokens(fitted, tmp_path):
    target, head, prompts, _ = fitted
    # SpecForge (as a server) reads decoder layers' outputs: HF ids 1..L-1, here 1 of the 2-layer toy
    head = _head(target, aux=(1,))
    reference = generate(target, DominoDrafter(head), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK - 1).tokens
    save_domino(head, tmp_path / "hf")
    export_specforge(head, tmp_path / "specforge")
    frozen = set(head.frozen_keys())
    state = {k: v for k, v in head.state_dict().items() if k not in frozen}
    for folder in ("hf", "specforge"):
        again = load_domino(tmp_path / folder, target=target)
        assert (again.config.gru_hidden, again.config.proj_dim, again.config.aux_layer_ids) == (GRU, PROJ, [1])
        assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items()), folder
        out = generate(target, DominoDrafter(again), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK - 1)
        assert out.tokens == reference, folder
    config = json.loads((tmp_path / "specforge" / "config.json").read_text())
    assert config["architectures"] == ["DominoDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": VOCAB - 1,
        "target_layer_ids": [0],  # SpecForge reads hidden_states[id + 1]: decoder layer 0's output
        "projector_type": "domino",
        "pure_draft_prefix_len": 0,
        "emb_dim": PROJ,
        "gru_hidden_dim": GRU,
        "shift_label": False,
    }
    assert (
        config["block_size"] == BLOCK and config["draftsmith"]["target_fingerprint"] == head.config.target_fingerprint
    )
    # SpecForge's layout back to draftsmith's through the registry's exporter, checked against the target
    back = export_folder(
        tmp_path / "specforge", tmp_path / "back", "hf", num_speculative_tokens=3, target=lambda: target
    )
    assert json.loads((back / "config.json").read_text())["model_type"] == "draftsmith_domino"
    assert all(torch.equal(load_domino(back, target=target).state_dict()[k], v) for k, v in state.items())


def test_what_specforge_cannot_hold_is_refused_before_writing(fitted, tmp_path):
    target, _, _, _ = fitted
    with pytest.raises(DominoError, match=r"aux layer ids \[0, 1, 2\] must lie in 1\.\."):
        export_specforge(_head(target), tmp_path / "embeddings")
    reduced = DominoHead(
        DominoConfig(
            mask_token_id=1,
            aux_layer_ids=[1],
            vocab_size=VOCAB,
            draft_vocab_size=64,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            gru_hidden=GRU,
            proj_dim=PROJ,
        )
    )
    with pytest.raises(DominoError, match="reduced vocabulary .64 of 320.*draft_vocab_size unset"):
        export_specforge(reduced, tmp_path / "reduced")
    assert not (tmp_path / "embeddings").exists() and not (tmp_path / "reduced").exists()
    # SpecForge's shipped Qwen3 setting (slot 0 drafts the token after the anchor) is not built here
    head = _head(target, aux=(1,))
    folder = export_specforge(head, tmp_path / "shifted")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["shift_label"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        DominoError, match=r"dflash_config\.shift_label=True; draftsmith builds Domino with shift_label=False"
    ):
        load_domino(folder, target=target)
    with pytest.raises(DominoError, match="export format 'vllm': a Domino head exports as hf or specforge"):
        export_folder(folder, tmp_path / "vllm", "vllm", num_speculative_tokens=3)


def test_the_trainer_hands_each_micro_batch_its_step(toy_dir, toy_data, tmp_path):
    """`train.blocks.train_blocks` passes the optimizer step to the loss (what lambda reads): every
    micro-batch of step s sees s; held-out blocks see None (the final logits only)."""
    from draftsmith.heads.domino_formats import DOMINO
    from draftsmith.train.blocks import train_blocks
    from draftsmith.train.domino import VARIANT

    seen = []

    def watch(head, batch, *args):
        seen.append(batch.get("step"))
        return domino_losses(head, batch, *args)

    run = dict(
        grad_accum=2, max_length=64, max_steps=3, warmup_steps=1, eval_every=3, save_every=1000, serve_check_prompts=1
    )
    head = dict(block_size=BLOCK, max_anchors=8, gru_hidden=8, proj_dim=4)
    recipe = DominoRecipe(**toy_recipe(toy_dir, toy_data, tmp_path / "run", **run, **head))
    train_blocks(recipe, False, DOMINO, watch, VARIANT)
    assert seen[:6] == [0, 0, 1, 1, 2, 2] and seen[6:] and set(seen[6:]) == {None}, seen
    assert (tmp_path / "run" / "head" / "config.json").is_file()
