"""DSpark: the DFlash backbone drafting from its anchor, the sequential (Markov) correction and the
confidence head; the trainer's teacher-forced blocks against the drafter's left-to-right pass; the
drafter in the one decoder (greedy identity, losslessness); D-PACE's weights.

As in tests/test_dflash.py, the decoder tests use a head fitted in-process to the toy target's own
greedy continuations, so whole blocks are accepted and every branch of the verifier runs.
"""

from __future__ import annotations

import fixtures
import pytest
import torch
from fixtures import VOCAB

from draftsmith.decoding import generate, generate_batch
from draftsmith.decoding.admission import ConfidenceAdmission, admitted_counts
from draftsmith.decoding.dspark import DSparkDrafter, dspark_rows
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.distill.losses import dpace_weights
from draftsmith.eval.lossless import check_lossless
from draftsmith.heads.dspark import MARKOV_HEADS, DSparkConfig, DSparkError, DSparkHead
from draftsmith.heads.dspark_formats import export_dspark, export_folder, load_dspark, save_dspark
from draftsmith.train.blocks import anchor_chunks
from draftsmith.train.dspark import DSparkRecipe, dspark_losses, head_parameters

BLOCK = 4


def _head(target, kind="vanilla", rank=16, seed=0, aux=(0, 1, 2), **variant):
    head = fixtures.block_head(DSparkHead, target, BLOCK, seed, aux, markov_rank=rank, markov_head_type=kind, **variant)
    with torch.no_grad():  # a bias that is not zero, so the correction is exercised from the start
        if head.markov_head is not None:
            head.markov_head.markov_w2.weight.normal_(0, 0.5)
    return head


@pytest.mark.parametrize("kind", MARKOV_HEADS)
def test_the_block_form_is_the_slot_by_slot_form(pairs, kind):
    """The trainer's teacher-forced block (`block_logits`) equals the drafter's left-to-right
    `corrected` steps (the rnn carrying its state) when the drafts are the block's tokens."""
    target, _ = pairs("llama")
    head = _head(target, kind)
    h = torch.randn(3, BLOCK, head.config.hidden_size)
    prev = torch.randint(0, VOCAB, (3, BLOCK))
    whole = head.block_logits(h, prev)
    state, steps = None, []
    for k in range(BLOCK):
        logits, state = head.corrected(head.lm_head(h[:, k]), prev[:, k], h[:, k], state)
        steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), whole)
    assert not torch.allclose(whole, head.lm_head(h))  # the bias is there


def test_a_zero_rank_head_is_its_backbone_and_bad_configs_are_refused(pairs):
    target, _ = pairs("llama")
    head = _head(target, rank=0, confidence_head_with_markov=False)
    h, prev = torch.randn(2, BLOCK, head.config.hidden_size), torch.randint(0, VOCAB, (2, BLOCK))
    assert torch.equal(head.block_logits(h, prev), head.lm_head(h)) and head.confidence_head is not None
    for bad, message in (
        ({"markov_rank": -1}, "markov_rank"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"markov_rank": 0, "confidence_head_with_markov": True}, "confidence_head_with_markov"),
    ):
        with pytest.raises(DSparkError, match=message):
            DSparkConfig(mask_token_id=1, aux_layer_ids=[0], vocab_size=VOCAB, **bad)
    with pytest.raises(DSparkError, match="markov_embedding"):
        DSparkConfig(mask_token_id=1, aux_layer_ids=[0], vocab_size=VOCAB, markov_embedding="hash")
    with pytest.raises(ValueError, match="markov_head_type = 'lstm'"):
        DSparkRecipe(target="t", data="d", out="o", markov_head_type="lstm")
    with pytest.raises(ValueError, match="markov_embedding = 'hash'"):
        DSparkRecipe(target="t", data="d", out="o", markov_embedding="hash")
    assert DSparkConfig(mask_token_id=1, aux_layer_ids=[0], vocab_size=VOCAB, block_size=7).drafts_per_block == 7


def test_dpace_weights_follow_survival():
    """w_j = sum_{m >= j} prod_{i <= m} ((1 - a) q_i + a): certain drafts carry every later slot
    (w = S - j); with a = 0, a surely wrong draft ends the chain: it and every later slot weigh 0."""
    S = 5
    sure = dpace_weights(torch.zeros(2, S), torch.ones(2, S), alpha=0.5)
    assert sure[0].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]
    ce = torch.tensor([[0.0, 50.0, 0.0, 0.0, 0.0]])  # slot 1 is surely wrong
    w = dpace_weights(ce, torch.ones(1, S), alpha=0.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    masked = dpace_weights(torch.zeros(1, S), torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]]), alpha=0.5)
    assert masked.tolist() == [[3.0, 2.0, 0.0, 1.0, 0.0]]  # a masked slot weighs 0 and breaks no chain
    q = torch.rand(3, S)
    w = dpace_weights(-q.log(), torch.ones(3, S), alpha=0.3)
    smooth = 0.7 * q + 0.3
    expected = torch.stack([smooth[:, : m + 1].prod(-1) for m in range(S)], -1).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(w, expected)


@pytest.fixture(scope="module", params=["vanilla", "rnn"])
def fitted(pairs, request):
    """(target, a DSpark head fitted to the target's greedy continuations of `prompts`, prompts)."""
    target, _ = pairs("llama")
    prompts, batch, states = fixtures.greedy_answers_batch(target)
    head = _head(target, request.param)
    recipe = DSparkRecipe(target="t", data="d", out="o", block_size=BLOCK, max_anchors=32, markov_rank=16)
    trained = torch.cat([batch["loss_mask"][:, 1:], torch.zeros_like(batch["loss_mask"][:, :1])], 1)
    losses = fixtures.fit_block_head(head, batch, states, recipe, dspark_losses, 25, BLOCK, loss_mask=trained)
    assert sum(losses[-3:]) < sum(losses[:3])
    return target, head.eval(), prompts, recipe


def test_greedy_equals_target_only_at_b1_and_b4(fitted):
    target, head, prompts, _ = fitted
    # every slot drafts, the anchor's too: some call proposes BLOCK
    fixtures.assert_greedy_is_target_only(target, DSparkDrafter, head, prompts, BLOCK, drafts_every_slot=True)


def test_the_walk_over_every_anchor_is_what_the_decoder_gets(fitted):
    """Held-out blocks anchored at every position, walked as the decoder walks them: the same
    calls and the same tau as greedy decoding (the teacher-forced correction is the drafter's)."""
    target, head, prompts, recipe = fitted
    chains, starts = fixtures.anchored_blocks(target, head, recipe, dspark_losses)
    assert chains.shape[-1] == BLOCK and starts.sum(1).tolist() == [40] * len(prompts)
    fixtures.assert_walk_is_decoded(target, DSparkDrafter(head), prompts, chains, starts, BLOCK)


def test_each_draft_comes_from_the_corrected_law_it_reports(fitted):
    """Sampled proposals: probs[k] is softmax(U_k + bias(x_{k-1})) at the draft actually made before."""
    target, head, prompts, _ = fitted
    drafter = DSparkDrafter(head)
    seen = []
    propose = drafter.propose

    def watch(contexts, num_tokens, sampling, generators):
        proposal = propose(contexts, num_tokens, sampling, generators)
        seen.append((list(contexts[0]), proposal))
        return proposal

    drafter.propose = watch
    generate(target, drafter, prompts[0], max_new_tokens=12, num_draft_tokens=BLOCK, temperature=1.0, seed=3)
    context, proposal = seen[1]
    with torch.no_grad():
        h = fixtures.block_hidden(target, head, context, BLOCK)[0]
        prev = torch.tensor([context[-1], *proposal.tokens[0, : BLOCK - 1].tolist()])
        law = head.block_logits(h[None], prev[None])[0].float().softmax(-1)
    torch.testing.assert_close(proposal.probs[0], law, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 4])
def test_sampled_decode_is_lossless(fitted, batch_size):
    """check_lossless: chi-square of t1 and (t1, t2) against the target's exact law."""
    target, head, prompts, _ = fitted
    fixtures.assert_lossless(target, DSparkDrafter(head), prompts[0], 150 * batch_size, batch_size)


@pytest.mark.parametrize("kind", MARKOV_HEADS)
def test_both_layouts_round_trip_with_the_same_tokens(pairs, kind, tmp_path):
    target, _ = pairs("llama")
    head = _head(target, kind, aux=(0, 1))  # a server captures the states entering layers, not the last norm's
    prompts, _, _ = fixtures.greedy_answers_batch(target)
    reference = generate(target, DSparkDrafter(head), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK).tokens
    save_dspark(head, tmp_path / "hf")
    export_dspark(head, tmp_path / "vllm")
    for folder in ("hf", "vllm"):
        again = load_dspark(tmp_path / folder, target=target)
        assert again.config.markov_head_type == head.config.markov_head_type
        out = generate(target, DSparkDrafter(again), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK).tokens
        assert out == reference, folder
    import json

    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK
    assert {"markov_rank", "markov_head_type", "enable_confidence_head"} <= set(config)


@pytest.mark.parametrize("embedding", ["table", "target"])
def test_the_parameter_count_is_the_built_heads(pairs, embedding):
    """`head_parameters` (the memory estimate's count) against the head `train` builds: W1 a [V, r]
    table, or over the target's frozen embeddings its [H, r] projection."""
    target, _ = pairs("llama")
    variant = dict(markov_rank=16, markov_head_type="rnn", markov_embedding=embedding)
    recipe = DSparkRecipe(target="t", data="d", out="o", aux_layers=[0, 1, 2], **variant)
    head = _head(target, "rnn", markov_embedding=embedding)
    assert head_parameters(recipe, target) == fixtures.parameter_counts(head)


def test_a_markov_embedding_over_the_target_exports_its_table(pairs, tmp_path):
    """`markov_embedding: target`: W1[x] = E[x] P with E the target's frozen embeddings and P
    trained; the vllm layout stores the table E P, a `table` head drafting the same tokens, so a
    folder exports to it only with the target."""
    import json

    target, _ = pairs("llama")
    head = _head(target, "gated", aux=(0, 1), markov_embedding="target")
    trained = {name for name, p in head.named_parameters() if p.requires_grad}
    assert "markov_head.markov_w1_proj.weight" in trained and "embed_tokens.weight" not in trained
    ids = torch.randint(0, VOCAB, (3, BLOCK))
    torch.testing.assert_close(head.previous(ids), head.markov_table()[ids])
    prompts, _, _ = fixtures.greedy_answers_batch(target)
    reference = generate(target, DSparkDrafter(head), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK).tokens
    save_dspark(head, tmp_path / "hf")
    with pytest.raises(DSparkError, match="reads the target's embeddings.*give the target"):
        export_folder(tmp_path / "hf", tmp_path / "vllm", "vllm", num_speculative_tokens=BLOCK)
    assert not (tmp_path / "vllm").exists()
    export_folder(tmp_path / "hf", tmp_path / "vllm", "vllm", num_speculative_tokens=BLOCK, target=lambda: target)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["markov_rank"] == 16 and "markov_embedding" not in config
    for folder, embedding in (("hf", "target"), ("vllm", "table")):
        again = load_dspark(tmp_path / folder, target=target)
        assert again.config.markov_embedding == embedding
        out = generate(target, DSparkDrafter(again), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK).tokens
        assert out == reference, folder


def test_anchor_chunks_start_where_the_decoder_calls(fitted):
    target, _, prompts, _ = fitted
    _, batch, _ = fixtures.greedy_answers_batch(target)
    starts, _ = anchor_chunks(batch["loss_mask"], batch["attention_mask"], 8)
    assert all(starts[b, len(p) - 1] for b, p in enumerate(prompts))  # the prompt's last token drafts the answer


def test_sampling_config_is_unchanged_by_the_correction(fitted):
    """Greedy with a temperature config of 0 draws nothing: the same tokens as SamplingConfig()."""
    target, head, prompts, _ = fitted
    a = generate(target, DSparkDrafter(head), prompts[1], max_new_tokens=12, num_draft_tokens=BLOCK).tokens
    b = generate_batch(
        target, [prompts[1]], DSparkDrafter(head), num_draft_tokens=BLOCK, max_new_tokens=12, sampling=SamplingConfig()
    ).tokens[0]
    assert a == b


# ------------------------------------------------------------------ confidence admission


class FixedCosts(ConfidenceAdmission):
    """An admission whose verify cost is a fixed curve, v(n) = 1 + slope (n - 1) at any batch, and
    whose drafting costs nothing: its counts follow the confidences alone, the same on any machine."""

    def __init__(self, slope: float):
        super().__init__(target=None)
        self.slope = slope

    def _measure(self, batch, widths):
        return {n: 1.0 + self.slope * (n - 1) for n in widths}

    def record_draft(self, seconds):
        pass


def test_admission_stops_at_the_first_level_that_does_not_pay():
    survival = torch.tensor([[0.9, 0.5, 0.45], [0.8, 0.1, 0.09]])
    linear = lambda w: 1.0 + 0.5 * (w - 1)  # noqa: E731
    # E = 2 / 1 = 2; one draft each: 3.7 / 1.5 = 2.47; two: 4.3 / 2 = 2.15, no rise: stop
    assert admitted_counts(survival, [3, 3], linear, 0.0) == [1, 1]
    # a row that drafts nothing still pays the padded width: 2.9 / 1.5 < 2; at a slope of 0.2,
    # 2.9 / 1.2 = 2.417, 3.4 / 1.4 = 2.429, 3.85 / 1.6 = 2.406
    assert admitted_counts(survival, [3, 0], linear, 0.0) == [0, 0]
    assert admitted_counts(survival, [3, 0], lambda w: 1.0 + 0.2 * (w - 1), 0.0) == [2, 0]
    assert admitted_counts(survival, [3, 3], lambda w: 1.0, 0.0) == [3, 3]  # free verification: all
    assert admitted_counts(survival, [3, 3], lambda w: float(w), 0.0) == [0, 0]  # each level a full step
    # a drafting call already paid makes a longer verification worth more
    assert admitted_counts(survival, [3, 3], linear, 5.0) == [3, 3]
    # a level that does not pay ends the scan even if a wider one would (a stopping rule: draft k
    # is never kept or dropped for what the drafts after it look like)
    dip = {1: 1.0, 2: 1.5, 3: 2.5, 4: 2.0}
    assert admitted_counts(survival, [3, 3], dip.__getitem__, 0.0) == [1, 1]


def test_only_a_head_with_a_confidence_head_has_an_admitted_row(pairs):
    target, _ = pairs("llama")
    assert set(dspark_rows(_head(target), target, "ds")) == {"ds", "ds-admit"}
    bare = _head(target, enable_confidence_head=False)
    assert set(dspark_rows(bare, target, "ds")) == {"ds"}
    with pytest.raises(ValueError, match="confidence head"):
        DSparkDrafter(bare, admission=FixedCosts(0.1))


def test_admitted_drafts_decode_greedy_identical_with_measured_costs(fitted):
    target, head, prompts, _ = fitted
    references = [generate(target, None, p, max_new_tokens=24).tokens for p in prompts[:4]]
    admitted = DSparkDrafter(head, name="admit", admission=ConfidenceAdmission(target, repeats=1))
    out = generate_batch(target, prompts[:4], admitted, num_draft_tokens=BLOCK, max_new_tokens=24)
    assert out.tokens == references
    assert set(admitted.admission._verify) == {4} and sorted(admitted.admission._verify[4]) == [1, 2, 3, 4, 5]
    out = generate(target, admitted, prompts[0], max_new_tokens=24, num_draft_tokens=BLOCK)
    assert out.tokens == references[0] and set(admitted.admission._verify) == {1, 4}


@pytest.mark.parametrize("batch_size", [1, 3])
def test_admitted_sampled_decode_is_lossless(fitted, batch_size):
    """check_lossless with counts that vary from call to call with the confidences."""
    target, head, prompts, _ = fitted
    drafter = DSparkDrafter(head, admission=FixedCosts(0.35))
    counts = []
    propose = drafter.propose

    def watch(contexts, num_tokens, sampling, generators):
        proposal = propose(contexts, num_tokens, sampling, generators)
        counts.extend(proposal.counts)
        return proposal

    drafter.propose = watch
    result = check_lossless(
        target,
        drafter,
        prompts[0],
        num_draft_tokens=BLOCK,
        samples=150 * batch_size,
        progress=False,
        batch_size=batch_size,
    )
    assert len(set(counts)) >= 2, set(counts)  # the admission decided, call by call
    assert result.passed, result.describe()
