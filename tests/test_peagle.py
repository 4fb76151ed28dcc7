"""P-EAGLE heads: the head, the packed chains of its training, the drafter in the one decoder.

Decoding is tested with a head fitted (`fixtures.fit_steps` of `peagle_losses`) to the toy target's
greedy answers to the prompts it then decodes: several depths get accepted, so identity and
losslessness are checked where every branch of the verifier (accept, reject, bonus) runs.
"""

from __future__ import annotations

import json

import fixtures
import pytest
import torch
from fixtures import VOCAB
from lifecycle_helpers import assert_loss_falls, assert_two_heads_evaluate, eval_error_args, head_recipe
from safetensors.torch import load_file

from draftsmith.decoding.peagle import PEagleDrafter
from draftsmith.heads.eagle import EagleError, PEagleConfig, PEagleHead, export_eagle, load_eagle, save_eagle
from draftsmith.train.peagle import (
    PEagleRecipe,
    chain_mask,
    cod_sample,
    every_chain,
    main,
    pack_chains,
    peagle_losses,
    train,
)
from draftsmith.train.recipe import RecipeError, load_recipe

FAMILIES = ("llama", "qwen2", "mistral")
DEPTHS = 4
MASK = VOCAB - 1


# ------------------------------------------------------------------------- the head


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_parameter_counts(family, pairs):
    target, _ = pairs(family)
    c = target.config
    H, V, Vd, I = c.hidden_size, c.vocab_size, 64, c.intermediate_size
    head = PEagleHead.for_target(
        target, mask_token_id=MASK, num_depths=DEPTHS, aux_layer_ids=[0, 1, 2], vocab_map=fixtures.fake_vocab_map(Vd)
    )
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    layer = 2 * H * H + 2 * 2 * H * kv + H * H + 3 * H * I + 3 * H  # q/k/v read 2H; o; mlp; three norms
    # trained: embeddings, fc, the layer, norm, reduced lm_head, mask_hidden (in the 3H aux space)
    trained = V * H + 3 * H * H + layer + H + Vd * H + 3 * H
    assert sum(p.numel() for p in head.parameters() if p.requires_grad) == trained
    assert head.embed_tokens.weight.requires_grad and head.mask_hidden.shape == (1, 1, 3 * H)
    assert head.config.mask_token_id == MASK and head.config.embed_requires_grad
    B, T = 2, 5
    states = target(torch.randint(3, VOCAB, (B, T)), output_hidden_states=True).hidden_states
    pairs_h = head.project(torch.cat([states[i] for i in (0, 1, 2)], -1))
    hidden = torch.cat([pairs_h, head.mask_features(B, DEPTHS - 1)], dim=1)
    ids = torch.cat([torch.randint(3, VOCAB, (B, T)), torch.full((B, DEPTHS - 1), MASK)], dim=1)
    out, logits = head(ids, hidden, position_ids=torch.arange(T + DEPTHS - 1))
    assert out.shape == (B, T + DEPTHS - 1, H) and logits.shape == (B, T + DEPTHS - 1, Vd)
    assert head.target_logits(logits).shape == (B, T + DEPTHS - 1, V)


def test_bad_inputs_each_get_one_clear_error(pairs, tmp_path):
    target, _ = pairs("llama")
    with pytest.raises(EagleError, match=f"mask_token_id={VOCAB} is outside the vocabulary 0..{VOCAB - 1}"):
        PEagleHead.for_target(target, mask_token_id=VOCAB)
    with pytest.raises(EagleError, match="num_depths=0; expected an integer >= 1"):
        PEagleHead.for_target(target, mask_token_id=MASK, num_depths=0)
    base = dict(target="t", data="d", out="o")
    for key, value, message in (
        ("num_depths", 0, "num_depths = 0 must be an integer >= 1"),
        ("down_sample_ratio", 1.5, r"down_sample_ratio = 1.5 must be in \[0, 1\]"),
        ("down_sample_ratio_min", -0.1, r"down_sample_ratio_min = -0.1 must be in \[0, 1\]"),
        ("down_sample_ratio_min", 0.9, "down_sample_ratio_min = 0.9 is above down_sample_ratio = 0.7"),
        ("mask_token_id", -1, "mask_token_id = -1 must be a token id >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            PEagleRecipe(**base, **{key: value})
    path = tmp_path / "r.yaml"
    path.write_text("target: t\ndata: d\nout: o\nnum_depth: 4\n")
    with pytest.raises(RecipeError, match="unknown key.*num_depth.*did you mean num_depths"):
        load_recipe(PEagleRecipe, path)
    assert main(["--recipe", str(path), "--no-progress"]) == 2
    path.write_text("target: t\ndata: d\nout: o\ndown_sample_ratio: 2\n")
    assert main(["--recipe", str(path), "--no-progress"]) == 2


# ------------------------------------------------------------------------- the packed chains


def test_cod_sample_follows_speculators_sizes_and_chains():
    gen = torch.Generator().manual_seed(0)
    trained = torch.zeros(40, dtype=torch.bool)
    trained[5:38] = True  # 33 trained pairs
    anchor, depth = cod_sample(trained, 5, 0.7, 0.2, None, gen)
    assert torch.equal(anchor[depth == 0], torch.arange(40))
    sizes = [int((depth == d).sum()) for d in range(5)]
    assert sizes == [40] + [int((33 - d) * max(0.7**d, 0.2)) for d in range(1, 5)]
    present = set(zip(anchor.tolist(), depth.tolist()))
    for a, d in present:  # a chain is contiguous: depth d of anchor a needs its depth d - 1
        assert (a, d - 1) in present if d else True
        assert d == 0 or trained[a + d]
    anchor, depth = cod_sample(trained, 5, 0.7, 0.2, 8, gen)  # 8 seeds: sizes from 8
    assert [int((depth == d).sum()) for d in range(1, 5)] == [int((8 - d) * max(0.7**d, 0.2)) for d in range(1, 5)]
    anchor, depth = cod_sample(trained, 5, 0.7, 0.2, None, drop=False)  # every chain
    assert int((depth == 1).sum()) == 33 and int((depth == 4).sum()) == 30


def _reference_mask(anchor, depth, real, context):
    B, N = anchor.shape
    out = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for q in range(N):
            for k in range(N):
                qa, qd, ka, kd = (int(x) for x in (anchor[b, q], depth[b, q], anchor[b, k], depth[b, k]))
                ok = (
                    real[b, q]
                    and real[b, k]
                    and ((kd == 0 and ka <= qa and bool(context[b, ka])) or (ka == qa and kd <= qd))
                )
                out[b, q, k] = bool(ok) or q == k
    return out


def test_the_chain_mask_matches_a_reference():
    gen = torch.Generator().manual_seed(1)
    trained = torch.rand(2, 9, generator=gen) < 0.8
    trained[1, 6:] = False
    context = torch.ones(2, 9, dtype=torch.bool)
    context[1, 7:] = False
    recipe = PEagleRecipe(target="t", data="d", out="o", num_depths=3, max_anchors=None)
    anchor, depth, real = pack_chains(trained, recipe, gen)
    assert not real[1].all()  # the shorter row is padded
    assert torch.equal(chain_mask(anchor, depth, real, context), _reference_mask(anchor, depth, real, context))


# ------------------------------------------------------------------------- the decoder


@pytest.fixture(scope="module")
def fitted(pairs):
    """(target, a P-EAGLE head with q/k norms fitted to the target's greedy continuations of
    `prompts`, prompts): 25 AdamW steps of `peagle_losses`, no chain dropped by down-sampling."""
    target, _ = pairs("llama")
    prompts, batch, states = fixtures.greedy_answers_batch(target)
    torch.manual_seed(0)
    # q/k norms as the trainer's default: every decode test here and in test_onepass_static runs them
    head = PEagleHead.for_target(target, mask_token_id=MASK, num_depths=DEPTHS, aux_layer_ids=[0, 1, 2], qk_norm=True)
    feats = fixtures.aux_features(states, head)
    recipe = PEagleRecipe(
        target="t",
        data="d",
        out="o",
        num_depths=DEPTHS,
        down_sample_ratio=1.0,
        down_sample_ratio_min=1.0,
        max_anchors=None,
    )

    def loss_of(step):
        generator = torch.Generator().manual_seed(step)
        return peagle_losses(head, batch, feats, states.logits, recipe, None, generator)[0]

    losses = fixtures.fit_steps(head, loss_of, 25)
    assert losses[-1] < losses[0] / 2, losses  # the fixture's loss falls
    return target, head.eval(), prompts


def test_the_walk_over_every_chain_is_what_the_decoder_gets(fitted):
    """Held-out evaluation's chains, one anchored at every pair (a few anchors per forward),
    walked as the decoder walks: greedy decoding of the same prompts makes the same calls."""
    target, head, prompts = fitted
    _, batch, states = fixtures.greedy_answers_batch(target)  # the prompts' 40-token answers
    feats = fixtures.aux_features(states, head)
    recipe = PEagleRecipe(target="t", data="d", out="o", num_depths=DEPTHS, max_anchors=7)
    chains, starts, hits, trained = every_chain(head, batch, feats, states.logits, recipe, None)
    assert starts.sum(1).tolist() == [40] * len(prompts)  # pair P - 2 drafts the answer's first token
    whole = every_chain(head, batch, feats, states.logits, PEagleRecipe(**{**vars(recipe), "max_anchors": None}), None)
    assert torch.equal(whole[0], chains) and torch.equal(whole[3], trained)  # chunks change nothing
    # every chain whole: depth d >= 1 at each trained position p (anchor p - d), so 40 - (d - 1) per row
    assert trained.tolist() == [len(prompts) * (40.0 - max(0, d - 1)) for d in range(DEPTHS)]
    fixtures.assert_walk_is_decoded(target, PEagleDrafter(head), prompts, chains, starts, DEPTHS)


def test_a_window_keeps_the_chains_anchored_in_it():
    trained = torch.zeros(30, dtype=torch.bool)
    trained[4:27] = True
    every = set(zip(*(x.tolist() for x in cod_sample(trained, 4, 0.7, 0.2, None, drop=False))))
    parts = set()
    for lo in range(0, 30, 6):
        anchor, depth = cod_sample(trained, 4, 0.7, 0.2, 6, drop=False, window=(lo, lo + 6))
        assert torch.equal(anchor[depth == 0], torch.arange(30))  # every pair, the chains' context
        assert ((anchor[depth > 0] >= lo) & (anchor[depth > 0] < lo + 6)).all()
        parts |= set(zip(anchor.tolist(), depth.tolist()))
    assert parts == every and sum(d == 3 for _, d in every) == 23 - 2  # no depth cut short by few seeds


def test_greedy_equals_target_only_at_b1_and_b4(fitted):
    target, head, prompts = fitted
    fixtures.assert_greedy_is_target_only(target, PEagleDrafter, head, prompts, DEPTHS)


def _check_row(drafter, b, context, proposal, sampling):
    """Compares a proposal's logits (row b) with the head run from scratch on the row's whole context
    (every pair from one full target forward, then the placeholders). A row that drafts nothing is
    not checked."""
    head, n, k = drafter.head, len(context) - 1, proposal.counts[b]
    if k == 0:
        return False
    feats = fixtures.context_features(drafter.target, head, context)
    hidden = torch.cat([feats, head.mask_features(1, k - 1)], dim=1)
    ids = torch.tensor([context[1:] + [MASK] * (k - 1)])
    _, logits = head(ids, hidden, position_ids=torch.arange(n + k - 1))
    torch.testing.assert_close(logits[0, n - 1 :].float(), proposal.logits[b, :k], atol=1e-4, rtol=0)
    return True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_holds_each_rows_verified_pairs(fitted, temperature):
    """Ragged rows (prompts of 4, 6 and 1 tokens), rows leaving the batch, accepted and rejected
    drafts: every proposal equals the head's from-scratch forward on that row's context."""
    fixtures.assert_rows_leaving_are_checked(fitted, PEagleDrafter, _check_row, DEPTHS, temperature)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
def test_sampled_decode_is_lossless(fitted, batch_size):
    """check_lossless at T=1: chi-square of t1 and (t1, t2) against the target's exact law."""
    target, head, prompts = fitted
    samples = 150 if batch_size == 1 else 300
    fixtures.assert_lossless(target, PEagleDrafter(head), prompts[0], samples, batch_size)


# ------------------------------------------------------------------------- formats


def test_export_and_import_round_trip(tmp_path):
    target = fixtures.tiny_model("llama", layers=4).eval()  # servers capture layer inputs: aux ids below L
    head = PEagleHead.for_target(
        target,
        mask_token_id=MASK,
        mask_token_source="recipe",
        num_depths=DEPTHS,
        aux_layer_ids=[1, 2, 3],
        vocab_map=fixtures.fake_vocab_map(64),
    ).eval()
    with torch.no_grad():  # off the init (norms at 1), so that a dropped or misread tensor shows
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_eagle(head, tmp_path / "hf")
    again = load_eagle(tmp_path / "hf", target=target)
    assert isinstance(again, PEagleHead) and again.config.mask_token_id == MASK and again.config.num_depths == DEPTHS
    state = head.state_dict()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())
    from transformers import AutoModel

    auto = AutoModel.from_pretrained(tmp_path / "hf")  # registered by `import draftsmith.heads`
    assert type(auto) is PEagleHead and all(torch.equal(auto.state_dict()[k], v) for k, v in state.items())
    export_eagle(head, tmp_path / "vllm", "vllm", num_speculative_tokens=DEPTHS)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleDraftModel"]
    assert config["mask_token_id"] == MASK and config["embed_requires_grad"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    saved = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert "mask_hidden" in saved and "embed_tokens.weight" in saved
    served = load_eagle(tmp_path / "vllm", target=target)
    assert isinstance(served, PEagleHead) and served.config.mask_token_source == head.config.mask_token_source
    assert all(torch.equal(served.state_dict()[k], v) for k, v in state.items())
    from draftsmith.publish.serve import serving_commands

    serving = serving_commands(tmp_path / "vllm")
    assert serving.k == DEPTHS and not serving.sglang and '"parallel_drafting": true' in serving.vllm[0]
    assert serving_commands(tmp_path / "hf").vllm[0].startswith(f"draftsmith export {tmp_path / 'hf'} --format vllm")
    with pytest.raises(EagleError, match="SGLang has no P-EAGLE layout"):
        export_eagle(head, tmp_path / "sglang", "sglang")
    del saved["mask_hidden"]
    from safetensors.torch import save_file

    save_file(saved, str(tmp_path / "vllm" / "model.safetensors"))
    with pytest.raises(EagleError, match="has no mask_hidden"):
        load_eagle(tmp_path / "vllm")


# ------------------------------------------------------------------------- the trainer, end to end


def test_training_lowers_the_loss_reloads_bit_identically_and_evaluates(toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "peagle"
    recipe = PEagleRecipe(
        **head_recipe(toy_dir, toy_data, out, num_depths=3, max_anchors=16, draft_vocab_size=64, log_every=1)
    )
    summary = train(recipe, progress=False)
    assert_loss_falls(out, 12)
    assert len(summary["eval"]["top1_per_depth"]) == 3 and 1.0 <= summary["eval"]["tau_simulated"] <= 4
    assert summary["mask_token_source"] in ("tokenizer", "reserved")
    config = PEagleConfig.from_pretrained(out / "head")
    assert config.mask_token_id == summary["mask_token_id"] and config.num_depths == 3
    saved = load_file(str(out / "head" / "model.safetensors"))
    head = load_eagle(out / "head")
    assert isinstance(head, PEagleHead) and {"mask_hidden", "embed_tokens.weight", "d2t", "t2d"} <= set(saved)
    # q/k norms on by default (speculators' peagle trainer builds a qwen3 layer), trained: gradients reach them
    q_norm = saved["layers.0.self_attn.q_norm.weight"]
    assert head.config.qk_norm and "layers.0.self_attn.k_norm.weight" in saved
    assert not torch.equal(q_norm, torch.ones_like(q_norm))
    state = head.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    with pytest.raises(EagleError, match="hidden size 48 .* but target .* has 32"):
        load_eagle(out / "head", target=fixtures.tiny_model("llama", hidden=32))
    assert_two_heads_evaluate(
        run_cli, toy_dir, "--peagle", out / "head", out / "head", tmp_path / "ev", extra=["--batch-sizes", "1,2"]
    )
    serving = json.loads((tmp_path / "ev" / "serving.json").read_text())["methods"]
    assert serving["head"]["batched"] and serving["second"]["batched"]  # rows of the serving sweep
    # `draftsmith export` takes P-EAGLE heads (the round trip above); the 2-layer toy target has no
    # three distinct capturable aux layers, which the export refuses in one line, writing nothing.
    code, _, err = run_cli(["export", out / "head", "--format", "vllm", "--out", tmp_path / "v"])
    assert code == 2 and "exactly 3 aux hidden states" in err and not (tmp_path / "v").exists()
    code, _, err = run_cli(eval_error_args(toy_dir, "--peagle", toy_dir / "target", out=tmp_path / "x"))
    assert code == 2 and "expected a P-EAGLE head folder" in err
    with pytest.raises(RecipeError, match=f"mask_token_id = {VOCAB} is outside the target's vocabulary 0..{VOCAB - 1}"):
        train(PEagleRecipe(**{**recipe.__dict__, "out": str(tmp_path / "o3"), "mask_token_id": VOCAB}), progress=False)
