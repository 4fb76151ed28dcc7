"""The teacher of heads with a reduced draft vocabulary (`train.teacher.aux_states_and_teacher`).

Offline it is the cached last state projected on the lm_head rows of the draft tokens only, and the
mask of positions whose target argmax lies outside the draft vocabulary comes from the cache's top-1
id or from a full-vocabulary argmax computed once per row. The reference is what the trainers did
before: project on the whole vocabulary, then restrict (`full[..., vocab]`) and mask
(`t2d[full.argmax(-1)]`). Same batch, same seed: same teacher, same masks, same losses (1e-5).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.distill.data import DistillData
from draftsmith.distill.vocab import build_vocab_map
from draftsmith.train.common import collate_rows
from draftsmith.train.teacher import aux_states_and_teacher, draft_vocab_ids, vocab_argmax

VD = 12  # draft tokens: few enough that many of the target's argmaxes fall outside


@pytest.fixture(scope="module")
def setup(toy_dir, toy_data, tmp_path_factory):
    """(target, data, batch, caches {"argmax": fp32 states of (0, 1, last), "top1": + the top-1 logit})."""
    from draftsmith.distill.hidden_cache import HiddenStateCache, cache_hidden_states

    out = tmp_path_factory.mktemp("draft-teacher")
    target = AutoModelForCausalLM.from_pretrained(toy_dir / "target", dtype=torch.float32).eval()
    data = DistillData(toy_data)
    caches = {"argmax": out / "argmax", "top1": out / "top1"}
    for name, topk in (("argmax", 0), ("top1", 1)):
        cache_hidden_states(
            target,
            data,
            caches[name],
            layers_spec="0,1,last",
            dtype=torch.float32,
            topk=topk,
            batch_size=3,
            target_path=str(toy_dir / "target"),
            progress=False,
            log=lambda *a: None,
        )
    # the top-1 ids are the stored state's argmax only when the states keep the forward's precision
    assert HiddenStateCache(caches["top1"]).top1_is_argmax(torch.float32)
    assert not HiddenStateCache(caches["argmax"]).top1_is_argmax(torch.float32)  # no top-k stored
    rounded = out / "bf16"
    cache_hidden_states(
        target, data, rounded, layers_spec="last", dtype=torch.bfloat16, topk=1, progress=False, log=lambda *a: None
    )
    assert not HiddenStateCache(rounded).top1_is_argmax(torch.float32)
    batch = collate_rows(data, list(range(len(data))), 128, 0)
    assert not batch["attention_mask"].bool().all()  # rows of several lengths: padding is exercised
    return target, data, batch, caches


def heads(target, data):
    """An EAGLE-3, a DFlash and a P-EAGLE head over the same VD-token draft vocabulary."""
    from draftsmith.heads.dflash import DFlashHead
    from draftsmith.heads.eagle import EagleHead, PEagleHead

    vocab_map = build_vocab_map(data.token_counts(), VD, data.data_hash)
    torch.manual_seed(0)
    return vocab_map, {
        "eagle3": EagleHead.for_target(target, "eagle3", aux_layer_ids=[0, 1], vocab_map=vocab_map),
        "dflash": DFlashHead.for_target(
            target, num_layers=1, block_size=4, mask_token_id=3, aux_layer_ids=[0, 1], vocab_map=vocab_map
        ),
        "peagle": PEagleHead.for_target(
            target, mask_token_id=3, num_depths=3, aux_layer_ids=[0, 1], vocab_map=vocab_map
        ),
    }


def full_vocabulary_reference(target, cache_dir, batch, vocab, t2d):
    """The trainers' former path: the cached last state on the whole vocabulary, then restricted and masked."""
    from draftsmith.distill.hidden_cache import HiddenStateCache

    cache = HiddenStateCache(cache_dir)
    B, T = batch["input_ids"].shape
    last = torch.zeros(B, T, target.config.hidden_size)
    for r, row in enumerate(batch["rows"]):
        h = cache[row]["hidden"][-1][:T]
        last[r, : h.shape[0]] = h
    with torch.no_grad():
        full = target.get_output_embeddings()(last).float()  # [B, T, V]
    return full[..., vocab], t2d[full.argmax(-1)]


def recipe_of(kind, toy_dir, toy_data, cache):
    from draftsmith.train.dflash import DFlashRecipe
    from draftsmith.train.eagle import EagleRecipe
    from draftsmith.train.peagle import PEagleRecipe

    common = dict(target=str(toy_dir / "target"), data=str(toy_data), out="unused", hidden_cache=str(cache))
    if kind == "eagle3":
        return EagleRecipe(**common, ttt_steps=3)
    if kind == "dflash":
        return DFlashRecipe(**common, block_size=4, max_anchors=6)
    return PEagleRecipe(**common, num_depths=3, max_anchors=6)


def losses_of(kind, head, recipe, batch, feats, teacher, in_vocab):
    """(loss, hits, trained mask) of one forward of the head's loss, seeded alike for every call."""
    from draftsmith.train.blocks import sample_anchors
    from draftsmith.train.dflash import dflash_losses
    from draftsmith.train.eagle import eagle_losses
    from draftsmith.train.peagle import peagle_losses

    torch.manual_seed(0)
    if kind == "eagle3":
        per_step, hits, counts = eagle_losses(head, batch, feats, teacher, recipe, in_vocab, train=True, steps=3)
        return torch.stack(per_step), torch.stack(hits), torch.stack(counts)
    if kind == "dflash":
        gen = torch.Generator().manual_seed(0)
        anchors, valid = sample_anchors(batch["loss_mask"], batch["attention_mask"], 4, 6, gen)
        loss, hits, label, _ = dflash_losses(head, batch, feats, teacher, anchors, valid, recipe, in_vocab)
        return loss, hits, label
    generator = torch.Generator().manual_seed(0)
    loss, hits, label, _, _ = peagle_losses(head, batch, feats, teacher, recipe, in_vocab, generator)
    return loss, hits, label


def test_vocab_argmax_over_slices_is_torch_argmax_ties_included():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 50, bias=True)
    with torch.no_grad():
        lm_head.weight[37] = lm_head.weight[5]  # a tie across slices: the first index wins
        lm_head.bias[37] = lm_head.bias[5]
        lm_head.weight[12] = lm_head.weight[11]  # and one inside a slice
        lm_head.bias[12] = lm_head.bias[11]
        hidden = torch.randn(4, 9, 8)
        hidden[0, 0] = lm_head.weight[5] * 10  # rows whose maximum is the tied pair
        hidden[0, 1] = lm_head.weight[11] * 10
        want = lm_head(hidden).argmax(-1)
        for chunk in (7, 16, 50, 64):
            assert torch.equal(vocab_argmax(hidden, lm_head, chunk=chunk), want)
    assert want[0, 0] == 5 and want[0, 1] == 11


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "peagle"])
@pytest.mark.parametrize("source", ["argmax", "top1"])
def test_draft_vocab_teacher_gives_the_full_vocabulary_losses_and_masks(setup, toy_dir, toy_data, kind, source):
    target, data, batch, caches = setup
    vocab_map, by_kind = heads(target, data)
    head = by_kind[kind]
    vocab = draft_vocab_ids(head, vocab_map, "cpu")
    recipe = recipe_of(kind, toy_dir, toy_data, caches[source])
    states = aux_states_and_teacher(recipe, target, data, (0, 1), 2, torch.device("cpu"), vocab, head.t2d)
    real = batch["attention_mask"].bool()

    want_teacher, want_in_vocab = full_vocabulary_reference(target, caches[source], batch, vocab, head.t2d)
    assert want_in_vocab[real].any() and not want_in_vocab[real].all()  # the mask matters here
    for _ in range(2):  # computed (or read from the cache's top-1), then the rows' kept argmax
        feats, teacher, in_vocab = states(batch)
        assert teacher.shape[-1] == VD
        torch.testing.assert_close(teacher, want_teacher, atol=1e-5, rtol=1e-5)
        assert torch.equal(in_vocab[real], want_in_vocab[real])

    got = losses_of(kind, head, recipe, batch, feats, teacher, in_vocab)
    want = losses_of(kind, head, recipe, batch, feats, want_teacher, want_in_vocab)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # hits and trained masks
    assert got[2].any()


def test_eagle_losses_project_only_the_kept_positions(setup, toy_dir, toy_data):
    """The trainer's path (the kept positions' logits only) gives the losses and hits of every
    position's logits (`dense`, the on-policy replay's path)."""
    from draftsmith.train.eagle import eagle_losses

    target, data, batch, caches = setup
    vocab_map, by_kind = heads(target, data)
    head = by_kind["eagle3"]
    vocab = draft_vocab_ids(head, vocab_map, "cpu")
    recipe = recipe_of("eagle3", toy_dir, toy_data, caches["argmax"])
    feats, teacher, in_vocab = aux_states_and_teacher(
        recipe, target, data, (0, 1), 2, torch.device("cpu"), vocab, head.t2d
    )(batch)
    kept, dense = (
        eagle_losses(head, batch, feats, teacher, recipe, in_vocab, train=True, steps=3, dense=d) for d in (False, True)
    )
    torch.testing.assert_close(torch.stack(kept[0]), torch.stack(dense[0]), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.stack(kept[1]), torch.stack(dense[1]))  # hits
    assert torch.equal(torch.stack(kept[2]), torch.stack(dense[2])) and kept[2][0].any()  # kept positions
    assert not torch.stack(kept[2])[:, ~batch["attention_mask"].bool()[:, 1:]].any()  # padding is never kept


def test_online_teacher_is_restricted_once(setup, toy_dir, toy_data):
    """Online (no cache) the forward's full logits are restricted once per batch: the same teacher and mask."""
    from draftsmith.train.eagle import EagleRecipe

    target, data, batch, caches = setup
    vocab_map, by_kind = heads(target, data)
    head = by_kind["eagle3"]
    vocab = draft_vocab_ids(head, vocab_map, "cpu")
    online = EagleRecipe(target=str(toy_dir / "target"), data=str(toy_data), out="unused")
    _, teacher, in_vocab = aux_states_and_teacher(
        online, target, data, (0, 1), 2, torch.device("cpu"), vocab, head.t2d
    )(batch)
    want_teacher, want_in_vocab = full_vocabulary_reference(target, caches["argmax"], batch, vocab, head.t2d)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(teacher[real], want_teacher[real], atol=1e-4, rtol=1e-4)
    assert torch.equal(in_vocab[real], want_in_vocab[real])


def test_the_lazy_teacher_projects_only_the_rows_read_and_gives_the_same_losses(setup, toy_dir, toy_data):
    """`lazy=True` (the DFlash family, offline): TeacherStates instead of [B, T, Vd] logits; the rows
    `teacher_rows` projects, and the block loss, hits and trained slots, are the dense teacher's."""
    from draftsmith.train.teacher import TeacherStates, teacher_rows

    target, data, batch, caches = setup
    vocab_map, by_kind = heads(target, data)
    head = by_kind["dflash"]
    vocab = draft_vocab_ids(head, vocab_map, "cpu")
    recipe = recipe_of("dflash", toy_dir, toy_data, caches["argmax"])
    dense = aux_states_and_teacher(recipe, target, data, (0, 1), 2, torch.device("cpu"), vocab, head.t2d)(batch)
    lazy = aux_states_and_teacher(recipe, target, data, (0, 1), 2, torch.device("cpu"), vocab, head.t2d, lazy=True)
    feats, teacher, in_vocab = lazy(batch)
    assert isinstance(teacher, TeacherStates) and torch.equal(in_vocab, dense[2])
    index = torch.tensor([[3, 0, 5], [1, 1, 4]])[: batch["input_ids"].shape[0]]
    want = dense[1].gather(1, index[..., None].expand(-1, -1, VD))
    torch.testing.assert_close(teacher_rows(teacher, index), want)
    torch.testing.assert_close(teacher_rows(dense[1], index), want)
    got = losses_of("dflash", head, recipe, batch, feats, teacher, in_vocab)
    expected = losses_of("dflash", head, recipe, batch, *dense)
    torch.testing.assert_close(got[0], expected[0])
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]) and got[2].any()
