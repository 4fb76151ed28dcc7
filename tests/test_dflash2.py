"""DFlash2: the DFlash backbone with grouped dynamic causal convolutions and a candidate selector.

Pure-tensor checks of the convolution (its formula written out, causality inside a block, the
identity init computing exactly the DFlash backbone) and of the selector (edge scores and the walk
against a hand computation, the training candidates, the loss against its terms); the parameter
count; the drafter in the one decoder (greedy identity at batch 1 and 3, every sampled q against the
head recomputed from scratch, the chi-square); both layouts on disk; speculators 0.9.0's own
DFlash2DraftModel judging the export and building a checkpoint draftsmith loads.

As in tests/test_domino.py, the decoder tests use a head fitted in-process to the toy target's own
greedy continuations, so whole blocks are accepted and every branch of the verifier runs.
"""

from __future__ import annotations

import json

import fixtures
import pytest
import torch
from fixtures import VOCAB
from safetensors.torch import load_file, save_file

from draftsmith.decoding import generate
from draftsmith.decoding.dflash2 import DFlash2Drafter
from draftsmith.decoding.masks import additive
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dflash2 import DFlash2Config, DFlash2Error, DFlash2Head, grouped_dynamic_conv
from draftsmith.heads.dflash2_formats import export_dflash2, export_folder, load_dflash2, save_dflash2
from draftsmith.train.blocks import anchor_block_mask, sample_anchors
from draftsmith.train.dflash import dflash_losses
from draftsmith.train.dflash2 import DFlash2Recipe, dflash2_losses, head_parameters, training_candidates

BLOCK = 4  # slot 0 the anchor, 3 drafts per block
TOP_K, RANK = 4, 8  # few candidates of 320 tokens: the walk's restriction matters


def _head(target, seed=0, aux=(0, 1, 2), **config):
    return fixtures.block_head(
        DFlash2Head, target, BLOCK, seed, aux, selector_rank=RANK, selector_top_k=TOP_K, **config
    )


def _off_identity(head, scale=0.3, seed=1):
    """The convolutions moved off their identity init, so that every tap and dynamic kernel is in play."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head


# ---------------------------------------------------------------------- the convolution
def _conv_by_hand(x, delta, base, block, group):
    """out[n, q, c] = sum_t x[n, q - t, c] (base[t, c] + delta[n, q, t, c // group]) over the taps t
    that stay in q's block, element by element."""
    out = torch.zeros_like(x)
    N, Q, H = x.shape
    for n in range(N):
        for q in range(Q):
            for t in range(base.shape[0]):
                if q % block >= t:
                    for c in range(H):
                        out[n, q, c] += x[n, q - t, c] * (base[t, c] + delta[n, q, t, c // group])
    return out


def test_the_convolution_is_its_formula_and_reads_nothing_after_a_slot():
    gen = torch.Generator().manual_seed(0)
    N, Bs, H, group, K = 2, 4, 8, 4, 3
    x = torch.randn(N, 2 * Bs, H, generator=gen, dtype=torch.float64)  # two blocks packed per row
    delta = torch.randn(N, 2 * Bs, K, H // group, generator=gen, dtype=torch.float64)
    base = torch.randn(K, H, generator=gen, dtype=torch.float64)
    out = grouped_dynamic_conv(x, delta, base, block_size=Bs, group_size=group)
    torch.testing.assert_close(out, _conv_by_hand(x, delta, base, Bs, group))
    # slot k (of either block) reads slots k, k-1, k-2 of its own block: nothing later, no other block
    x.requires_grad_(True)
    for q in range(2 * Bs):
        (grad,) = torch.autograd.grad(
            grouped_dynamic_conv(x, delta, base, block_size=Bs, group_size=group)[:, q].sum(), x
        )
        read = grad.abs().sum((0, 2)) > 0  # [2 Bs]: the slots it depends on
        lo = q - q % Bs  # its block's first slot
        assert read.nonzero().flatten().tolist() == list(range(max(lo, q - K + 1), q + 1)), q
    with pytest.raises(DFlash2Error, match=r"must hold whole blocks of 3 slots"):
        grouped_dynamic_conv(x.detach(), delta, base, block_size=3, group_size=group)


def test_a_new_head_computes_exactly_its_dflash_backbone_and_its_layers_stay_causal(pairs):
    """Identity init: a DFlash2 head's states equal (bit for bit) those of the DFlash head holding the
    same backbone weights, over packed blocks with context; moved off the identity they differ, and a
    slot's state still depends on a later slot only through attention (the convolutions add nothing
    after it: with attention confined to the slot itself, slot k reads no later slot)."""
    target, _ = pairs("llama")
    head = _head(target)
    backbone = DFlashHead.for_target(target, block_size=BLOCK, mask_token_id=VOCAB - 1, aux_layer_ids=[0, 1, 2])
    backbone.load_state_dict({k: v for k, v in head.state_dict().items() if k in backbone.state_dict()})
    gen = torch.Generator().manual_seed(2)
    N, C, A, H = 2, 5, 3, head.config.hidden_size
    block_ids = torch.randint(0, VOCAB, (N, A * BLOCK), generator=gen)  # [N, Q]: three blocks packed
    context = head.project(torch.randn(N, C, 3 * H, generator=gen))  # [N, C, H]
    positions = torch.arange(C + A * BLOCK)[None].expand(N, -1)
    anchors = torch.tensor([[1, 2, 4]] * N)
    allowed = anchor_block_mask(anchors, torch.ones(N, C, dtype=torch.long), BLOCK)  # [N, Q, C + Q]
    mask = additive(allowed, torch.float32)[:, None]
    with torch.no_grad():
        ours = head.hidden(block_ids, context, positions=positions, attention_mask=mask)
        theirs = backbone.hidden(block_ids, context, positions=positions, attention_mask=mask)
        assert torch.equal(ours, theirs)
        _off_identity(head)
        assert not torch.allclose(head.hidden(block_ids, context, positions=positions, attention_mask=mask), theirs)
    # each slot attending to itself alone: only the convolutions mix slots, and a changed token moves
    # its own slot and the later ones of its block, never an earlier slot or another block
    Q = A * BLOCK
    alone = torch.cat([torch.zeros(N, Q, C, dtype=torch.bool), torch.eye(Q, dtype=torch.bool).expand(N, Q, Q)], -1)
    alone = additive(alone, torch.float32)[:, None]
    with torch.no_grad():
        before = head.hidden(block_ids, context, positions=positions, attention_mask=alone)
        for j in range(Q):
            changed = block_ids.clone()
            changed[:, j] = (changed[:, j] + 1) % VOCAB
            after = head.hidden(changed, context, positions=positions, attention_mask=alone)
            moved = (after != before).any(-1).any(0)  # [Q]
            lo = j - j % BLOCK
            assert moved.nonzero().flatten().tolist() == list(range(j, lo + BLOCK)), j


# ---------------------------------------------------------------------- the selector and its walk
def _scores_by_hand(head, unary, h, prev, candidates):
    """U(c) + sum_r A[p, r] (W h)_r B[c, r], in float64, one candidate at a time."""
    sel = head.candidate_selector
    A, B, W = (
        t.detach().double() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight)
    )
    wh = W @ h.double()  # [r]
    return torch.stack([unary[c].double() + (A[prev] * wh * B[c]).sum() for c in candidates.tolist()])


def _walk_setting(head, rows=2, seed=1):
    """A drafter whose backbone forward is replaced by fixed logits [rows, Bs, V] and states [rows, Bs, H]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, BLOCK, VOCAB, generator=gen)
    hidden = torch.randn(rows, BLOCK, head.config.hidden_size, generator=gen)
    drafter = DFlash2Drafter(head)
    drafter._block = lambda contexts: (logits, hidden)
    return drafter, logits, hidden


def test_the_selector_gradients_repeat_bit_for_bit_on_two_threads():
    """The codebooks' gradients, with the same ids many times over (as the candidates of a batch), are
    the same in every backward on a 2-thread CPU: indexing a codebook (`A[ids]`) accumulates its
    gradient with atomic adds in an order that changed from run to run; F.embedding does not."""
    from draftsmith.heads.dflash2 import CandidateSelector

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        config = DFlash2Config(mask_token_id=1, aux_layer_ids=[0], vocab_size=8192, hidden_size=64, selector_rank=64)
        selector = CandidateSelector(config)
        gen = torch.Generator().manual_seed(0)
        prev = torch.randint(0, 300, (8, 16, 7), generator=gen)
        candidates = torch.randint(0, 300, (8, 16, 7, 16), generator=gen)
        h, unary = torch.randn(8, 16, 7, 64, generator=gen), torch.randn(8, 16, 7, 8192, generator=gen)
        up = torch.randn(8, 16, 7, 16, generator=gen)

        def grads():
            selector.zero_grad(set_to_none=True)
            (selector.scores(unary, h, prev, candidates) * up).sum().backward()
            return [p.grad.clone() for p in (selector.predecessor_codebook, selector.successor_codebook)]

        first = grads()
        for _ in range(10):
            assert all(torch.equal(a, b) for a, b in zip(grads(), first))
    finally:
        torch.set_num_threads(threads)


def test_the_walk_is_the_hand_computed_chain(pairs):
    """Greedy: from the anchor, each draft is the best-scoring of its slot's top-K backbone logits after
    the draft before it (z-lab's and speculators' selector); sampled: each q_k is the softmax of those
    scores on the top-K, zero elsewhere, after the draft actually made."""
    target, _ = pairs("llama")
    head = _head(target)
    with torch.no_grad():  # edges as large as the logits' gaps, so that they reorder the top-K
        for weight in (head.candidate_selector.predecessor_codebook, head.candidate_selector.successor_codebook):
            weight.normal_(0, 0.5)
    drafter, logits, hidden = _walk_setting(head)
    contexts, counts = [[5, 6, 7], [9, 10]], [3, 2]
    greedy = drafter.propose(contexts, counts, SamplingConfig(), [None, None])
    assert greedy.probs is None and greedy.counts == counts
    reordered = 0
    for b, context in enumerate(contexts):
        prev, chain = context[-1], []
        for k in range(1, 1 + counts[b]):
            top = sorted(range(VOCAB), key=lambda v: -logits[b, k, v].item())[:TOP_K]
            scores = _scores_by_hand(head, logits[b, k], hidden[b, k], prev, torch.tensor(top))
            prev = top[int(scores.argmax())]
            reordered += prev != top[0]
            chain.append(prev)
        assert greedy.tokens[b, : counts[b]].tolist() == chain, b
    assert reordered, "the edges never changed the backbone's choice: the walk is not tested"
    # sampling at T = 1: each row's q_k is the law of the scores on the candidates after the previous draft
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    sampled = drafter.propose(contexts, counts, SamplingConfig(temperature=1.0), gens)
    for b, context in enumerate(contexts):
        prev = context[-1]
        for k in range(counts[b]):
            top = torch.tensor(sorted(range(VOCAB), key=lambda v: -logits[b, k + 1, v].item())[:TOP_K])
            law = torch.zeros(VOCAB, dtype=torch.float64)
            law[top] = _scores_by_hand(head, logits[b, k + 1], hidden[b, k + 1], prev, top).softmax(0)
            torch.testing.assert_close(sampled.probs[b, k].double(), law, atol=1e-6, rtol=1e-5)
            prev = int(sampled.tokens[b, k])
            assert prev in top.tolist()


def test_the_training_candidates_put_a_missing_target_last():
    candidates = torch.tensor([[5, 9, 2, 7], [5, 9, 2, 7]])
    training, where, inside = training_candidates(candidates, torch.tensor([2, 11]))
    assert training.tolist() == [[5, 9, 2, 7], [5, 9, 2, 11]]
    assert where.tolist() == [2, 3] and inside.tolist() == [True, False]


def test_the_loss_is_the_unary_term_plus_the_selector_ce(pairs):
    """selector_loss_alpha = 0: exactly DFlash's loss of the same backbone; alpha = 1 adds the decay-weighted
    mean of the K-way CE over the training candidates (written out here); hits are the walk's; gradients
    reach the selector and the convolutions."""
    target, _ = pairs("llama")
    _, batch, states = fixtures.greedy_answers_batch(target)
    head = _off_identity(_head(target))
    feats = fixtures.aux_features(states, head)
    anchors, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], BLOCK, 6, torch.Generator().manual_seed(0)
    )
    args = (feats, states.logits, anchors, valid)
    recipe = DFlash2Recipe(target="t", data="d", out="o", block_size=BLOCK, selector_loss_alpha=0.0)
    unary_only, _, _, _ = dflash2_losses(head, batch, *args, recipe, None)
    torch.testing.assert_close(unary_only, dflash_losses(head, batch, *args, recipe, None)[0])
    recipe = DFlash2Recipe(target="t", data="d", out="o", block_size=BLOCK, selector_loss_alpha=1.0)
    head.zero_grad()
    loss, hits, label, _ = dflash2_losses(head, batch, *args, recipe, None)
    loss.backward()
    assert head.candidate_selector.predecessor_codebook.grad.abs().sum() > 0
    assert head.layers[0].mlp_conv.kernel_projection.weight.grad.abs().sum() > 0
    # by hand: slot k of the block at p drafts p + k; its predecessor is the data's token at p + k - 1
    h = fixtures.teacher_forced_blocks(head, batch, feats, anchors, BLOCK)[0]  # [B*A, Bs, H]
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    B, A = anchors.shape
    ce, walk_hits, weights = (
        torch.zeros(B, A, BLOCK - 1),
        torch.zeros(B, A, BLOCK - 1, dtype=torch.bool),
        torch.zeros(B, A, BLOCK - 1),
    )
    with torch.no_grad():
        for b in range(B):
            for a in range(A):
                for k in range(1, BLOCK):
                    at = min(int(anchors[b, a]) + k - 1, T - 1)
                    unary = head.lm_head(h[b * A + a, k])
                    wanted = int(states.logits[b, at].argmax())
                    top = unary.topk(TOP_K).indices
                    serving = _scores_by_hand(head, unary, h[b * A + a, k], int(ids[b, at]), top)
                    walk_hits[b, a, k - 1] = int(top[serving.argmax()]) == wanted
                    if wanted not in top.tolist():
                        top[-1] = wanted
                    scores = _scores_by_hand(head, unary, h[b * A + a, k], int(ids[b, at]), top)
                    ce[b, a, k - 1] = scores.logsumexp(0) - scores[top.tolist().index(wanted)]
                    weights[b, a, k - 1] = torch.exp(torch.tensor(-(k - 1) / recipe.decay_gamma))
    weights = weights * label
    torch.testing.assert_close(loss.detach() - unary_only, (ce * weights).sum() / weights.sum(), atol=1e-5, rtol=1e-4)
    assert torch.equal(hits, walk_hits & label) and label.any()


@pytest.mark.parametrize("layers", [1, 2])
def test_the_parameter_count_is_the_built_heads(pairs, layers):
    """`head_parameters` (the memory estimate's count, before the target loads) against the head
    `train` builds: backbone, convolutions and selector trained; the target's embeddings and lm_head frozen."""
    target, _ = pairs("llama")
    shape = dict(num_layers=layers, conv_kernel_size=3, conv_group_size=12, selector_rank=5)
    recipe = DFlash2Recipe(target="t", data="d", out="o", aux_layers=[0, 2], **shape)
    head = DFlash2Head.for_target(target, block_size=BLOCK, mask_token_id=VOCAB - 1, aux_layer_ids=[0, 2], **shape)
    assert head_parameters(recipe, target) == fixtures.parameter_counts(head)


def test_bad_settings_are_refused_naming_the_key():
    shape = dict(
        mask_token_id=1, aux_layer_ids=[0], vocab_size=VOCAB, hidden_size=48, num_attention_heads=4, block_size=BLOCK
    )
    for bad, message in (
        (
            {"draft_vocab_size": 64},
            "draft_vocab_size=64 of vocab_size=320; DFlash2 drafts over the target's full vocabulary",
        ),
        ({"conv_group_size": 20}, "conv_group_size=20 does not divide hidden_size=48"),
        ({"conv_kernel_size": 5}, "conv_kernel_size=5 exceeds block_size=4"),
        ({"selector_top_k": 0}, "selector_top_k=0; expected an integer >= 1"),
        ({"selector_top_k": 321}, r"selector_top_k=321 exceeds the vocabulary \(320\)"),
    ):
        with pytest.raises(DFlash2Error, match=message):
            DFlash2Config(**{**shape, **bad})
    for bad, message in (
        ({"draft_vocab_size": 64}, "draft_vocab_size = 64: DFlash2 drafts over the target's full vocabulary"),
        ({"vocab_map": "v.safetensors"}, "vocab_map = 'v.safetensors': DFlash2 drafts over"),
        ({"selector_rank": 0}, "selector_rank = 0 must be >= 1"),
        ({"conv_kernel_size": 9}, "conv_kernel_size = 9 must be <= block_size = 8"),
        ({"selector_loss_alpha": -1.0}, "selector_loss_alpha = -1.0 must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            DFlash2Recipe(target="t", data="d", out="o", **bad)


# ---------------------------------------------------------------------- the drafter in the decoder
@pytest.fixture(scope="module")
def fitted(pairs):
    """(target, a DFlash2 head fitted to the target's greedy continuations of `prompts`, prompts, recipe):
    30 AdamW steps of `dflash2_losses` from a head whose convolutions start off the identity."""
    target, _ = pairs("llama")
    prompts, batch, states = fixtures.greedy_answers_batch(target)
    head = _off_identity(_head(target), scale=0.05)
    recipe = DFlash2Recipe(target="t", data="d", out="o", block_size=BLOCK, max_anchors=32)
    losses = fixtures.fit_block_head(head, batch, states, recipe, dflash2_losses, 30, BLOCK)
    assert sum(losses[-3:]) < sum(losses[:3]) / 2, losses
    return target, head.eval(), prompts, recipe


def test_greedy_equals_target_only_at_b1_and_b3(fitted):
    """Greedy decoding with the head is target-only's, on the growing store and the static one."""
    target, head, prompts, _ = fitted
    # the anchor drafts nothing: every call proposes at most BLOCK - 1
    checks = dict(rows=3, singles=1, min_accepted=5, min_batch_accepted=10, drafts_every_slot=True)
    fixtures.assert_greedy_is_target_only(target, DFlash2Drafter, head, prompts, BLOCK - 1, **checks)


def test_the_walk_over_every_anchor_is_what_the_decoder_gets(fitted):
    """Held-out blocks anchored at every position, walked as the decoder walks them: the same calls and
    the same tau as greedy decoding (the teacher-forced predecessor is the draft a correct chain made)."""
    target, head, prompts, recipe = fitted
    chains, starts = fixtures.anchored_blocks(target, head, recipe, dflash2_losses)
    assert chains.shape[-1] == BLOCK - 1 and starts.sum(1).tolist() == [40] * len(prompts)
    fixtures.assert_walk_is_decoded(target, DFlash2Drafter(head), prompts, chains, starts, BLOCK - 1)


def _check_row(drafter, b, context, proposal, sampling):
    """Compares a sampled proposal's q (row b) with the head recomputed from scratch on the row's whole
    context: the backbone over the target's features of every token but the last, then the walk over
    the drafts actually made, q_k = the target's law (temperature, top-k) of the edge scores on the
    top-K backbone logits, zero elsewhere. A row that drafts nothing is not checked."""
    head, count = drafter.head, proposal.counts[b]
    if not count:
        return False
    h = fixtures.block_hidden(drafter.target, head, context, BLOCK)[0]  # [Bs, H]
    prev = context[-1]
    for k in range(1, 1 + count):
        unary = head.lm_head(h[k])  # [V]
        top = unary.topk(TOP_K).indices
        z = _scores_by_hand(head, unary, h[k], prev, top) / sampling.temperature
        if sampling.top_k:
            z[z < z.topk(min(sampling.top_k, TOP_K)).values[-1]] = float("-inf")
        law = torch.zeros(VOCAB, dtype=torch.float64)
        law[top] = z.softmax(0)
        torch.testing.assert_close(proposal.probs[b, k - 1].double(), law, atol=1e-5, rtol=1e-4)
        prev = int(proposal.tokens[b, k - 1])
    return True


Checked = fixtures.checking_drafter_class(DFlash2Drafter, _check_row)


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 2)])
def test_each_draft_comes_from_the_law_it_reports(fitted, temperature, top_k):
    """Sampled proposals at batch 3 (ragged rows, rejections): q_k is the law of the scores after the
    draft actually made before slot k, on slot k's candidates only."""
    target, head, prompts, _ = fitted
    drafter = Checked(head, target)
    fixtures.decode_ragged_sampled(
        target, prompts, drafter, BLOCK - 1, SamplingConfig(temperature=temperature, top_k=top_k)
    )
    assert drafter.checked >= 6, drafter.checked


@pytest.mark.slow
@pytest.mark.parametrize("batch_size, temperature, top_k", [(1, 1.0, 0), (3, 1.0, 0), (3, 0.7, 8)])
def test_sampled_decode_is_lossless(fitted, batch_size, temperature, top_k):
    """check_lossless: chi-square of t1 and (t1, t2) against the target's exact law. Drafts come from the
    top-4 candidates of 320 tokens only, so the target's other tokens arrive through the residual, and on
    this flat toy target about 5% of the drafts are accepted (both branches of the verifier run)."""
    target, head, prompts, _ = fitted
    fixtures.assert_lossless(
        target,
        DFlash2Drafter(head),
        prompts[0],
        200 * batch_size,
        batch_size,
        rate=(0.02, 0.95),
        temperature=temperature,
        top_k=top_k,
    )


# ---------------------------------------------------------------------- on disk
def test_both_layouts_round_trip_with_the_same_weights_and_drafts(fitted, tmp_path):
    target, _, prompts, _ = fitted
    head = _off_identity(_head(target, aux=(0, 1))).eval()  # a server captures ids below L = 2
    out = generate(target, DFlash2Drafter(head), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK - 1)
    save_dflash2(head, tmp_path / "hf")
    export_dflash2(head, tmp_path / "vllm")
    frozen = set(head.frozen_keys())
    state = {k: v for k, v in head.state_dict().items() if k not in frozen}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"}  # the target's: never written
    for folder in ("hf", "vllm"):
        again = load_dflash2(tmp_path / folder, target=target)
        assert isinstance(again, DFlash2Head) and (again.config.selector_rank, again.config.selector_top_k) == (
            RANK,
            TOP_K,
        )
        assert set(load_file(str(tmp_path / folder / "model.safetensors"))) == set(state), folder
        assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items()), folder
        decoded = generate(target, DFlash2Drafter(again), prompts[0], max_new_tokens=16, num_draft_tokens=BLOCK - 1)
        assert (decoded.tokens, decoded.stats.accepted) == (out.tokens, out.stats.accepted), folder
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["speculators_model_type"] == "dflash2"
    assert {k: config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    }
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    assert (
        config["draft_vocab_size"] == VOCAB
        and config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    )
    # speculators' layout back to draftsmith's through the registry's exporter, checked against the target
    back = export_folder(tmp_path / "vllm", tmp_path / "back", "hf", num_speculative_tokens=3, target=lambda: target)
    assert json.loads((back / "config.json").read_text())["model_type"] == "draftsmith_dflash2"
    assert all(torch.equal(load_dflash2(back, target=target).state_dict()[k], v) for k, v in state.items())
    # a speculators folder with a reduced vocabulary is not a DFlash2 head (speculators refuses it too)
    config["draft_vocab_size"] = 64
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlash2Error, match="draft_vocab_size=64 of vocab_size=320; DFlash2 drafts over"):
        load_dflash2(tmp_path / "vllm", target=target)


@pytest.mark.slow
def test_speculators_judges_the_export_and_builds_a_checkpoint_draftsmith_loads(tmp_path):
    """Both directions with the real speculators 0.9.0 (its venv, tests/test_speculators_interop.py):
    the export parses as DFlash2SpeculatorConfig with exactly the keys and shapes of a DFlash2DraftModel
    built from it and loads finite; speculators' own backbone over its own anchored blocks and its
    selector's scores of its top-K give draftsmith's; a checkpoint its `from_training_args` builds (every
    tensor moved off its init) loads into draftsmith, computes the same and decodes greedy-identical."""
    from test_speculators_interop import JUDGE, _run, speculators_python

    python = speculators_python()
    target = fixtures.tiny_model("llama", layers=4)  # aux 1, 2, 3: below L, as a server captures them
    target.save_pretrained(tmp_path / "target")
    fixtures.tiny_tokenizer().save_pretrained(tmp_path / "target")
    H, T, gen = target.config.hidden_size, 12, torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, T, 3 * H, generator=gen),
        "input_ids": torch.randint(3, VOCAB, (1, T), generator=gen),
        "last": torch.randn(1, T, H, generator=gen),
    }
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    head = _head(target, aux=(1, 2, 3), target_name_or_path=str(tmp_path / "target"))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name or "_conv." in name else 0.05))
    export_dflash2(head.eval(), tmp_path / "export")
    flags = {
        "speculator_type": "dflash2",
        "target_layer_ids": [1, 2, 3],
        "mask_token_id": VOCAB - 1,
        "block_size": BLOCK,
    }
    flags |= {"selector_rank": RANK, "selector_top_k": TOP_K}
    files = [str(tmp_path / "inputs.safetensors")]
    jobs = [
        {"check": [str(tmp_path / "export"), *files, str(tmp_path / "export.out")]},
        {
            "build": [
                str(tmp_path / "built"),
                str(tmp_path / "target"),
                json.dumps(flags),
                *files,
                str(tmp_path / "built.out"),
            ]
        },
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    check, build = json.loads(
        _run([python, JUDGE, tmp_path / "jobs.json"], "the speculators judge", 900).splitlines()[-1]
    )
    assert (check["config_class"], check["model_class"]) == ("DFlash2SpeculatorConfig", "DFlash2DraftModel")
    assert (check["missing"], check["unexpected"], check["shape_mismatches"], check["not_finite"]) == ([], [], [], [])
    assert check["mask_token_id"] == VOCAB - 1 and check["flags"] == {
        "target_hidden_size": None,
        "sample_from_anchor": False,
        "block_size": BLOCK,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    }
    assert {"candidate_selector.predecessor_codebook", "layers.0.mlp_conv.base_kernel"} <= set(build["saved"])
    built = load_dflash2(tmp_path / "built", target=target)
    assert isinstance(built, DFlash2Head) and built.config.aux_layer_ids == [1, 2, 3]
    for name, ours in (("export", head), ("built", built)):
        theirs = load_file(str(tmp_path / f"{name}.out"))
        mine = fixtures.speculators_blocks(ours, inputs, theirs["indices"])
        assert torch.equal(theirs["candidates"], mine.pop("candidates")), name
        for key, value in mine.items():
            torch.testing.assert_close(theirs[key], value, rtol=1e-4, atol=1e-4, msg=f"{name} {key}")
    prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(7))
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    assert (
        generate(target, DFlash2Drafter(built), prompt, max_new_tokens=24, num_draft_tokens=BLOCK - 1).tokens
        == reference
    )


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_walk_among_candidates_weighs_and_hits_as_its_vocabulary_wide_law(weighting):
    """weighted_slots takes the walk as (candidates, scores): the same loss, weights and hits as the
    law written over the whole vocabulary (-inf off the candidates), which it no longer builds."""
    from types import SimpleNamespace

    from draftsmith.train.blocks import weighted_slots

    torch.manual_seed(3)
    B, A, S, V, K = 2, 3, 4, 50, 5
    recipe = SimpleNamespace(loss_weighting=weighting, dpace_alpha=0.5, decay_gamma=4.0)
    targets = torch.randn(B, A, S, V)
    label = torch.rand(B, A, S) > 0.2
    candidates = torch.randn(B, A, S, V).topk(K, dim=-1).indices
    best = targets.argmax(-1)
    candidates[0, 0, 0, 2] = best[0, 0, 0]  # some slots hold the target's token among their candidates
    scores = torch.randn(B, A, S, K)
    scores[0, 0, 0, 2] = 10.0  # ... and draft it
    dense = torch.full((B, A, S, V), float("-inf")).scatter(-1, candidates, scores)
    per_slot = torch.rand(B, A, S, requires_grad=True)
    loss, hits, weight_sum = weighted_slots(recipe, per_slot, (candidates, scores), targets, label)
    expected = weighted_slots(recipe, per_slot, dense, targets, label)
    torch.testing.assert_close(loss, expected[0])
    assert torch.equal(hits, expected[1]) and hits[0, 0, 0] == label[0, 0, 0]
    torch.testing.assert_close(weight_sum, expected[2])
