"""The distillation divergences of `distill/losses.py`, on tiny fp32 tensors.

Each divergence is pinned three ways: against an independent reference (`F.kl_div`, the
definitions written out on probabilities), against its known properties (zero on identical
inputs, bounds, limits, symmetry), and the chunked / vocabulary-sliced / `Projected` paths
against the plain one in value and gradient. Also: one-hot and padded-vocabulary targets keep
gradients finite, masked-out rows are never read, bf16 is computed in fp32, bad arguments
name themselves, and a few SGD steps lower every divergence.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.distill.losses import (
    DIVERGENCES,
    Projected,
    cross_entropy,
    divergence,
    forward_kl,
    jsd,
    reverse_kl,
    smooth_l1,
    soft_cross_entropy,
    total_variation,
)

SHAPE = (2, 5, 37)  # N = 10 rows, V = 37: prime, so no chunk size below divides it
H = 16
# Chunk configurations for (chunk_size, vocab_chunk_size): none divides N = 10 or V = 37.
CHUNKINGS = [(3, None), (None, 8), (3, 8), (4, 36)]


def make(seed, shape=SHAPE, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def mask_of(seed, shape=SHAPE[:-1]):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    m.view(-1)[0], m.view(-1)[-1] = True, False  # at least one kept and one dropped row
    return m


def kl(log_a, log_b):
    """KL(a || b) per row, by the reference implementation."""
    return F.kl_div(log_b, log_a, log_target=True, reduction="none").sum(-1)


def grad_of(value, *inputs):
    return torch.autograd.grad(value, inputs)


# --- values against references and properties ---------------------------------------------


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_identical_inputs_give_zero_and_soft_ce_the_entropy(kind):
    x = make(0)
    value = divergence(kind, x, x.clone(), reduction="none")
    if kind == "soft_ce":
        logp = F.log_softmax(x, -1)
        torch.testing.assert_close(value, -(logp.exp() * logp).sum(-1))
        assert value.min() > 1.0  # the entropy of a 37-way softmax of N(0, 1.5^2) logits is far from 0
    else:
        assert value.abs().max() < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_and_reverse_kl_match_kl_div(temperature):
    s, t, mask = make(1).requires_grad_(), make(2), mask_of(3)
    for fn, swap in ((forward_kl, False), (reverse_kl, True)):
        ls, lt = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
        ref = (kl(ls, lt) if swap else kl(lt, ls))[mask].mean()
        value = fn(s, t, mask, temperature=temperature)
        torch.testing.assert_close(value, ref)
        torch.testing.assert_close(grad_of(value, s)[0], grad_of(ref, s)[0])
    assert not torch.allclose(forward_kl(s, t, mask), reverse_kl(s, t, mask))  # the two really differ


def test_jsd_matches_its_definition_on_probabilities():
    s, t, beta = make(4).requires_grad_(), make(5), 0.3
    p, q = F.softmax(t, -1), F.softmax(s, -1)
    log_m = torch.log(beta * p + (1 - beta) * q)
    ref = (beta * kl(p.log(), log_m) + (1 - beta) * kl(q.log(), log_m)).mean()
    value = jsd(s, t, beta=beta)
    torch.testing.assert_close(value, ref)
    torch.testing.assert_close(grad_of(value, s)[0], grad_of(ref, s)[0])


def test_jsd_ends_and_limits_are_the_two_kls():
    s, t = make(6, scale=2.0), make(7, scale=2.0)
    fwd, rev = forward_kl(s, t), reverse_kl(s, t)
    assert jsd(s, t, beta=0.0) == fwd and jsd(s, t, beta=1.0) == rev
    # jsd/beta -> KL(p||q) and jsd/(1-beta) -> KL(q||p); the gap is O(beta) (a chi^2 term).
    torch.testing.assert_close(jsd(s, t, beta=1e-4) / 1e-4, fwd, rtol=1e-2, atol=0)
    torch.testing.assert_close(jsd(s, t, beta=1 - 1e-4) / 1e-4, rev, rtol=1e-2, atol=0)


def test_symmetric_jsd_is_bounded_by_ln2_and_symmetric():
    s, t = make(8, scale=3.0), make(9, scale=3.0)
    value = jsd(s, t, reduction="none")
    assert value.min() > 0 and value.max() <= math.log(2)
    torch.testing.assert_close(value, jsd(t, s, reduction="none"))
    # Disjoint supports reach the bound.
    a, b = torch.full(SHAPE, -1e4), torch.full(SHAPE, -1e4)
    a[..., 0], b[..., 1] = 0.0, 0.0
    torch.testing.assert_close(jsd(a, b, reduction="none"), torch.full(SHAPE[:-1], math.log(2)))


def test_tv_is_one_minus_overlap_and_lies_in_unit_interval():
    s, t = make(10, scale=3.0), make(11, scale=3.0)
    value = total_variation(s, t, reduction="none")
    overlap = torch.minimum(F.softmax(s, -1), F.softmax(t, -1)).sum(-1)  # = acceptance alpha
    torch.testing.assert_close(value, 1 - overlap)
    assert value.min() > 0 and value.max() < 1
    # One-hot-like on different tokens: no overlap, TV reaches 1.
    a, b = torch.full(SHAPE, float("-inf")), torch.full(SHAPE, -30.0)
    a[..., 3], b[..., 4] = 0.0, 30.0
    assert total_variation(b, a, reduction="none").min() > 1 - 1e-6


def test_soft_ce_and_kl_tv_are_their_compositions():
    s, t = make(12), make(13)
    logp = F.log_softmax(t, -1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    torch.testing.assert_close(soft_cross_entropy(s, t), forward_kl(s, t) + entropy)
    mix = 0.7 * forward_kl(s, t) + 0.3 * total_variation(s, t)
    torch.testing.assert_close(divergence("kl_tv", s, t, tv_weight=0.3), mix)
    assert divergence("kl_tv", s, t, tv_weight=0.0) == forward_kl(s, t)


def test_nla_and_lk_hybrid_by_hand():
    # Two tokens written out: p = (0.7, 0.2, 0.1), q = (0.4, 0.4, 0.2), so alpha = sum min(p, q)
    # = 0.4 + 0.2 + 0.1 = 0.7 and TV = 0.3; KL(p || q) = sum p log(p / q).
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.4, 0.2], [0.5, 0.25, 0.25]])
    t, s = p.log() + 1.0, q.log() - 2.0  # logits up to a constant
    alpha = torch.tensor([0.7, 1.0])
    kl_pq = torch.tensor([0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.5) + 0.1 * math.log(0.5), 0.0])
    torch.testing.assert_close(divergence("nla", s, t, reduction="none"), -alpha.log())
    lam = torch.exp(-3.0 * alpha)  # eta = 3: lambda = exp(-2.1) = 0.122 on the first token
    expected = lam * kl_pq + (1 - lam) * (1 - alpha)
    torch.testing.assert_close(divergence("lk_hybrid", s, t, reduction="none"), expected)
    torch.testing.assert_close(divergence("lk_hybrid", s, t, eta=0.0, reduction="none"), kl_pq)  # lambda = 1
    # Far apart (alpha ~ e^-40, below float32's p but not its log): nla stays finite and exact.
    far_s, far_t = torch.tensor([[40.0, 0.0]]), torch.tensor([[0.0, 40.0]])
    torch.testing.assert_close(divergence("nla", far_s, far_t), torch.tensor(40.0 - math.log(2.0)), atol=1e-4, rtol=0)


def test_nla_and_lk_hybrid_gradients():
    s, t = make(70, scale=2.0).requires_grad_(), make(71, scale=2.0)
    alpha = torch.minimum(F.softmax(s, -1), F.softmax(t, -1)).sum(-1).detach()

    def rows(kind):
        return divergence(kind, s, t, reduction="none")

    # -log alpha: d/ds = d TV/ds / alpha, row by row (TV = 1 - alpha).
    (g_nla,) = grad_of(divergence("nla", s, t, reduction="sum"), s)
    (g_tv,) = grad_of((rows("tv") / alpha).sum(), s)
    torch.testing.assert_close(g_nla, g_tv)
    # The hybrid's weight is not differentiated: its gradient is lambda dKL + (1 - lambda) dTV.
    lam = torch.exp(-3.0 * alpha)
    (g_lk,) = grad_of(divergence("lk_hybrid", s, t, reduction="sum"), s)
    (g_mix,) = grad_of((lam * rows("forward_kl") + (1 - lam) * rows("tv")).sum(), s)
    torch.testing.assert_close(g_lk, g_mix)
    # Direction: a small step against each gradient raises acceptance on every row.
    for g in (g_nla, g_lk):
        stepped = (s - 0.05 * g).detach()
        after = torch.minimum(F.softmax(stepped, -1), F.softmax(t, -1)).sum(-1)
        assert bool((after > alpha).all()), after - alpha


def test_teacher_gets_no_gradient():
    s, t = make(14).requires_grad_(), make(15).requires_grad_()
    for kind in DIVERGENCES:
        divergence(kind, s, t, chunk_size=3).backward()
    assert t.grad is None and s.grad is not None


# --- chunked, sliced and Projected paths against the plain one ------------------------------


@pytest.mark.parametrize("chunk_size, vocab_chunk_size", CHUNKINGS)
@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_equals_plain(kind, chunk_size, vocab_chunk_size, masked):
    s, t = make(20).requires_grad_(), make(21)
    mask = mask_of(22) if masked else None
    kw = dict(temperature=0.8, beta=0.3, tv_weight=0.4)
    plain = divergence(kind, s, t, mask, **kw)
    chunked = divergence(kind, s, t, mask, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, **kw)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_of(chunked, s)[0], grad_of(plain, s)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_size, vocab_chunk_size", [(None, None)] + CHUNKINGS)
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_projected_equals_materialized_logits(kind, chunk_size, vocab_chunk_size):
    hidden, teacher_hidden = make(23, SHAPE[:-1] + (H,)).requires_grad_(), make(24, SHAPE[:-1] + (H,))
    weight, bias = make(25, (SHAPE[-1], H), scale=0.3).requires_grad_(), make(26, (SHAPE[-1],)).requires_grad_()
    mask = mask_of(27)
    # The teacher shares the head's weight, as EAGLE/Medusa heads share the target's lm_head:
    # the weight's gradient must come from the student side only.
    student, teacher = Projected(hidden, weight, bias), Projected(teacher_hidden, weight, bias)
    ref_s = F.linear(hidden, weight, bias)
    ref_t = F.linear(teacher_hidden, weight, bias).detach()
    ref = divergence(kind, ref_s, ref_t, mask, temperature=1.3)
    value = divergence(
        kind, student, teacher, mask, temperature=1.3, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
    )
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grad_of(value, hidden, weight, bias), grad_of(ref, hidden, weight, bias)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_chunked_paths_keep_no_vocabulary_wide_tensor_for_backward():
    """Outside checkpointed regions autograd may keep only per-row values: nothing of width V."""
    n_rows, vocab = 40, 301
    hidden, weight = make(28, (n_rows, H)).requires_grad_(), make(29, (vocab, H)).requires_grad_()
    teacher = Projected(make(30, (n_rows, H)), weight)

    def saved_numels(**kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            divergence("jsd", Projected(hidden, weight), teacher, **kw)
        return sizes

    assert n_rows * vocab in saved_numels()  # the plain path keeps full logits: the control
    for kw in ({"chunk_size": 7}, {"vocab_chunk_size": 64}, {"chunk_size": 7, "vocab_chunk_size": 64}):
        assert max(saved_numels(**kw), default=0) <= n_rows, kw


# --- hard cases: one-hot targets, -inf, masks, dtypes ---------------------------------------


def one_hot_teacher(gap):
    t = torch.zeros(SHAPE)
    labels = torch.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE[:-1]) % SHAPE[-1]
    t.scatter_(-1, labels[..., None], 1.0)
    return torch.where(t > 0, 0.0, -gap)  # gap = inf gives exact zeros in p


@pytest.mark.parametrize("chunking", [(None, None), (3, 8)])
@pytest.mark.parametrize("gap", [1e4, float("inf")])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_one_hot_teacher_gives_finite_value_and_gradient(kind, gap, chunking):
    s, t = make(31).requires_grad_(), one_hot_teacher(gap)
    value = divergence(kind, s, t, chunk_size=chunking[0], vocab_chunk_size=chunking[1])
    if kind == "reverse_kl" and gap == float("inf"):
        assert value == float("inf")  # q puts mass where p has none: KL(q || p) is truly infinite
        return
    (grad,) = grad_of(value, s)
    assert torch.isfinite(value) and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("chunking", [(None, None), (None, 9), (4, 9)])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_padded_vocabulary_in_both_models_stays_finite(kind, chunking):
    """Entries 27..36 are -inf in teacher and student (a padded vocabulary): p = q = 0 there, so
    they add nothing; with slices of 9 the last two slices are entirely -inf."""
    s, t = make(32).requires_grad_(), make(33)
    pad = torch.arange(SHAPE[-1]) >= 27
    s_pad, t_pad = s.masked_fill(pad, float("-inf")), t.masked_fill(pad, float("-inf"))
    value = divergence(kind, s_pad, t_pad, chunk_size=chunking[0], vocab_chunk_size=chunking[1])
    (grad,) = grad_of(value, s)
    ref = divergence(kind, s[..., :27], t[..., :27])
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all() and (grad[..., 27:] == 0).all()


def test_student_minus_inf_where_teacher_has_mass_gives_inf():
    s, t = make(34), make(35)
    s[0, 0, 5] = float("-inf")
    assert forward_kl(s, t) == float("inf") and forward_kl(s, t, vocab_chunk_size=8) == float("inf")


@pytest.mark.parametrize("chunking", [(None, None), (3, 8)])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_masked_out_rows_are_never_read(kind, chunking):
    s, t, mask = make(36).requires_grad_(), make(37), mask_of(38)
    kw = dict(chunk_size=chunking[0], vocab_chunk_size=chunking[1])
    value = divergence(kind, s, t, mask, **kw)
    (grad,) = grad_of(value, s)
    garbage = torch.full(SHAPE, float("nan"))
    s2 = torch.where(mask[..., None], s, garbage)
    t2 = torch.where(mask[..., None], t, make(39, scale=50.0))
    value2 = divergence(kind, s2, t2, mask, **kw)
    (grad2,) = grad_of(value2, s)
    torch.testing.assert_close(value2, value)
    torch.testing.assert_close(grad2, grad)
    assert (grad[~mask] == 0).all() and grad[mask].abs().sum() > 0


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("chunking", [(None, None), (3, None), (3, 8)])
def test_empty_mask_gives_zero_and_a_finite_gradient(chunking, projected):
    hidden, weight = make(40, SHAPE[:-1] + (H,)).requires_grad_(), make(41, (SHAPE[-1], H)).requires_grad_()
    s = Projected(hidden, weight) if projected else make(42).requires_grad_()
    empty = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    kw = dict(chunk_size=chunking[0], vocab_chunk_size=chunking[1])
    for kind in DIVERGENCES:
        value = divergence(kind, s, make(43), empty, **kw)
        assert value == 0 and value.dtype == torch.float32
        value.backward()
        assert (divergence(kind, s, make(43), empty, reduction="none", **kw) == 0).all()
    for leaf in (hidden, weight) if projected else (s,):
        assert leaf.grad is not None and (leaf.grad == 0).all()


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_reductions_agree(kind):
    s, t, mask = make(44), make(45), mask_of(46)
    per_token = divergence(kind, s, t, mask, reduction="none")
    total = divergence(kind, s, t, mask, reduction="sum")
    assert per_token.shape == SHAPE[:-1] and (per_token[~mask] == 0).all() and (per_token[mask] > 0).all()
    torch.testing.assert_close(per_token.sum(), total)
    torch.testing.assert_close(divergence(kind, s, t, mask), total / mask.sum())
    # A 0/1 float mask means the same as the bool one.
    torch.testing.assert_close(divergence(kind, s, t, mask.float()), total / mask.sum())


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_bf16_inputs_are_computed_in_fp32(kind):
    s, t = make(47).bfloat16().requires_grad_(), make(48).bfloat16()
    value = divergence(kind, s, t, chunk_size=3, vocab_chunk_size=8)
    assert value.dtype == torch.float32
    # Exactly the fp32 computation on the bf16 values (the only rounding is in the inputs) ...
    torch.testing.assert_close(value, divergence(kind, s.float(), t.float()), rtol=1e-5, atol=1e-6)
    # ... and close to the fp32 logits they were rounded from.
    torch.testing.assert_close(value, divergence(kind, make(47), make(48)), rtol=2e-2, atol=2e-3)
    (grad,) = grad_of(value, s)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()


# --- argument checking ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(kind="kl"), "kind"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(beta=-0.1), "beta"),
        (dict(beta=1.5), "beta"),
        (dict(tv_weight=2.0), "tv_weight"),
        (dict(eta=-1.0), "eta"),
        (dict(reduction="avg"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(vocab_chunk_size=-4), "vocab_chunk_size"),
        (dict(teacher=torch.zeros(2, 5, 36)), "shape"),
        (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, named):
    call = dict(kind="jsd", student=make(49), teacher=make(50)) | kwargs
    with pytest.raises(ValueError, match=named) as info:
        divergence(**call)
    value = next(iter(kwargs.values()))
    if not isinstance(value, torch.Tensor):
        assert repr(value) in str(info.value) or str(value) in str(info.value)
    if named == "kind":
        assert all(name in str(info.value) for name in DIVERGENCES)


def test_bad_projected_and_helper_arguments():
    with pytest.raises(ValueError, match="Projected"):
        Projected(torch.zeros(2, 8), torch.zeros(37, 9))
    with pytest.raises(ValueError, match="bias"):
        Projected(torch.zeros(2, 8), torch.zeros(37, 8), torch.zeros(36))
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(make(51), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels.*37"):
        cross_entropy(make(51), torch.full(SHAPE[:-1], 37))
    with pytest.raises(ValueError, match="pred and target"):
        smooth_l1(torch.zeros(2, 5, 8), torch.zeros(2, 5, 7))
    with pytest.raises(ValueError, match="beta"):
        smooth_l1(torch.zeros(2, 5, 8), torch.zeros(2, 5, 8), beta=-1.0)


# --- cross-entropy and feature regression --------------------------------------------------


@pytest.mark.parametrize("chunking", [(None, None), (3, None), (None, 8), (4, 9)])
@pytest.mark.parametrize("projected", [False, True])
def test_cross_entropy_matches_f_cross_entropy(chunking, projected):
    hidden, weight = make(52, SHAPE[:-1] + (H,)).requires_grad_(), make(53, (SHAPE[-1], H)).requires_grad_()
    logits = F.linear(hidden, weight) if projected else make(54).requires_grad_()
    student = Projected(hidden, weight) if projected else logits
    leaves = (hidden, weight) if projected else (logits,)
    labels = torch.randint(0, SHAPE[-1], SHAPE[:-1], generator=torch.Generator().manual_seed(55))
    labels[0, 1] = -100
    mask = mask_of(56)
    value = cross_entropy(student, labels, mask, chunk_size=chunking[0], vocab_chunk_size=chunking[1])
    ref_labels = torch.where(mask, labels, -100)
    ref = F.cross_entropy(logits.reshape(-1, SHAPE[-1]), ref_labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(value, ref)
    for got, want in zip(grad_of(value, *leaves), grad_of(ref, *leaves)):
        torch.testing.assert_close(got, want)
    per_token = cross_entropy(student, labels, mask, reduction="none")
    assert per_token[0, 1] == 0 and (per_token[~mask] == 0).all()


def test_smooth_l1_is_a_masked_mean_of_feature_means():
    pred, target, mask = make(57, (2, 5, 8)).requires_grad_(), make(58, (2, 5, 8)), mask_of(59)
    for beta in (1.0, 0.5):
        d = (pred - target).abs()
        per_element = torch.where(d < beta, 0.5 * d**2 / beta, d - 0.5 * beta)
        per_token = per_element.mean(-1)
        torch.testing.assert_close(smooth_l1(pred, target, mask, beta=beta), per_token[mask].mean())
        torch.testing.assert_close(
            smooth_l1(pred, target, mask, beta=beta, reduction="none"), torch.where(mask, per_token, 0.0)
        )
    garbage = torch.where(mask[..., None], pred, torch.nan)
    torch.testing.assert_close(smooth_l1(garbage, target, mask), smooth_l1(pred, target, mask))
    assert smooth_l1(pred, target, torch.zeros_like(mask)) == 0


# --- optimisation --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_sgd_on_student_logits_lowers_each_divergence(kind):
    teacher = make(60, scale=2.0)
    student = torch.zeros(SHAPE, requires_grad=True)
    floor = soft_cross_entropy(teacher, teacher) if kind == "soft_ce" else 0.0
    opt = torch.optim.SGD([student], lr=20.0)  # "mean" over 10 rows scales each row's gradient by 1/10
    losses = []
    for _ in range(30):
        loss = divergence(kind, student, teacher, chunk_size=4, vocab_chunk_size=16)
        losses.append(loss.item() - float(floor))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0], losses


def _written_out(kind, s, t, T, tv_weight):
    """A divergence per row written out on probabilities, for autograd to differentiate."""
    lq, lp = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
    p, q = lp.exp(), lq.exp()
    kl, tv = (p * (lp - lq)).sum(-1), 0.5 * (p - q).abs().sum(-1)
    return {"soft_ce": -(p * lq).sum(-1), "forward_kl": kl, "tv": tv, "kl_tv": (1 - tv_weight) * kl + tv_weight * tv}[
        kind
    ]


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["soft_ce", "forward_kl", "tv", "kl_tv"])
def test_closed_form_gradients_are_autograds_through_the_formula(kind, dtype, chunk_size):
    """The kinds with their own backward (soft_ce, forward_kl: (q - p) / T; tv: q (s - <q, s>) / 2T;
    kl_tv their mix; into the kept rows, in the student's dtype) against autograd through the
    divergence written out on probabilities, over the kept rows only."""
    s, t, mask = make(40).to(dtype).requires_grad_(), make(41).to(dtype), mask_of(42)
    kw = {"temperature": 0.7, "tv_weight": 0.3, "chunk_size": chunk_size, "reduction": "none"}
    value = divergence(kind, s, t, mask, **kw)
    weights = make(43, SHAPE[:-1])  # an upstream gradient that differs per row
    (grad,) = torch.autograd.grad((value * weights).sum(), s)
    leaf = s.detach().float().requires_grad_()
    ref = _written_out(kind, leaf, t.float(), 0.7, 0.3) * mask
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), leaf)
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype and not grad[~mask.bool()].any()
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(grad.float(), ref_grad.to(dtype).float(), **tolerance)


def test_projected_cross_entropy_gradients_repeat_bit_for_bit_on_two_threads():
    """Hard-label CE through a Projected student reads each label's lm_head row: repeated labels (every
    batch has them) must not make the weight's gradient depend on thread scheduling (`weight[y]`'s
    backward adds with atomic adds on a multi-threaded CPU; F.embedding's is deterministic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(8192, 256, generator=gen).requires_grad_()
        hidden = torch.randn(4, 512, 256, generator=gen)
        labels = torch.randint(0, 300, (4, 512), generator=gen)
        mask = torch.ones(4, 512, dtype=torch.bool)

        def grad():
            weight.grad = None
            cross_entropy(Projected(hidden, weight), labels, mask).backward()
            return weight.grad.clone()

        first = grad()
        assert all(torch.equal(grad(), first) for _ in range(10))
    finally:
        torch.set_num_threads(threads)
