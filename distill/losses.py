"""Divergences that train a drafter (student, distribution q) to match a frozen target
(teacher, distribution p). Every drafter trainer (heads on the target, small draft
models) calls `divergence`; what each kind is for in speculative decoding:

- forward_kl  KL(p || q): mass-covering; the default distillation loss, q must cover every
              token the target might sample.
- reverse_kl  KL(q || p): mode-seeking; q concentrates on the target's likely tokens, which
              suits greedy or low-temperature serving.
- jsd         generalized Jensen-Shannon (GKD): bounded, interpolates between the two KLs.
- tv          total variation 0.5 sum |p - q|: exactly the rejection rate of one draft token,
              since acceptance alpha = sum min(p, q) = 1 - TV (DistillSpec's target).
- soft_ce     -sum p log q = KL(p || q) + H(p): same gradient as forward KL; the value that
              reference head trainers log.
- kl_tv       (1 - w) KL(p || q) + w TV: TV alone has small gradients far from the optimum
              and trains poorly from scratch; the KL term supplies them.
- nla         -log alpha, alpha = sum min(p, q) (LK losses, Samarin et al. 2026): its gradient
              is TV's divided by alpha, so it is large exactly where TV's is too small (a cold
              start) and tends to TV's as alpha -> 1. Computed as -logsumexp(min(log p, log q)):
              no underflow to log 0 however far apart p and q are.
- lk_hybrid   lambda KL(p || q) + (1 - lambda) TV with lambda = exp(-eta stopgrad(alpha)) per
              token (LK's adaptive hybrid, eta = 3): KL's gradient while the draft is far
              (alpha ~ 0, lambda ~ 1), TV's, i.e. acceptance itself, once it is close.

Conventions:
- `student`, `teacher`: logits [..., V] of the same shape, or `Projected(hidden, weight, bias)`
  whose logits hidden @ weight.T (+ bias) are computed slice by slice and never exist whole
  (8k tokens x 128k vocabulary in fp32 is 4 GB). The teacher is detached: no gradient into it.
- p = softmax(teacher / T), q = softmax(student / T), with no T^2 factor: Hinton's T^2 keeps a
  softened KL comparable to a hard-label loss, but here T is the serving temperature the
  drafter must match (DistillSpec), so the loss is the divergence itself.
- `mask` [...] (non-zero = kept): "mean" is the sum over kept tokens / their number (0, still
  differentiable, when none is kept), "sum" the sum, "none" the per-token values with zeros
  elsewhere. Rows outside the mask are never read (kept rows are gathered chunk by chunk),
  so padding may hold anything.
- `chunk_size` tokens per chunk and `vocab_chunk_size` vocabulary entries per slice bound the
  memory: each unit of work runs under activation checkpointing (recomputed in backward), so
  only one chunk's (or slice's) intermediates live at a time. The price is recomputing the
  logits in backward, and with vocabulary slices a second pass for the log-normalizers.
  Chunked and plain paths agree to float32 rounding in value and gradient.
- Computation is float32 whatever the input dtype (cast per chunk); results are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tv", "soft_ce", "kl_tv", "nla", "lk_hybrid")
REDUCTIONS = ("mean", "sum", "none")
# A finite stand-in for -inf where a max or a log-mixture would otherwise be -inf - (-inf) = NaN.
_FMIN = torch.finfo(torch.float32).min


@dataclass
class Projected:
    """Logits hidden @ weight.T (+ bias), [..., V], left uncomputed until a chunk needs them."""

    hidden: torch.Tensor  # [..., H]
    weight: torch.Tensor  # [V, H], e.g. the target's lm_head, shared by heads that reuse it
    bias: torch.Tensor | None = None  # [V]

    def __post_init__(self):
        w, h = tuple(self.weight.shape), tuple(self.hidden.shape)
        if len(w) != 2 or not h or h[-1] != w[1]:
            raise ValueError(f"Projected: hidden [..., H] and weight [V, H] must share H; got hidden {h}, weight {w}")
        if self.bias is not None and tuple(self.bias.shape) != w[:1]:
            raise ValueError(f"Projected: bias must have shape ({w[0]},), got {tuple(self.bias.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    def logits(self) -> torch.Tensor:
        """All logits at once, [..., V]: for small vocabularies and for reference checks."""
        return F.linear(self.hidden, self.weight, self.bias)


def divergence(
    kind: str,
    student,
    teacher,
    mask=None,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    tv_weight: float = 0.5,
    eta: float = 3.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Divergence `kind` (one of DIVERGENCES) between teacher p and student q, per token, reduced.

    jsd uses the GKD/TRL convention: m = beta p + (1 - beta) q,
    jsd = beta KL(p || m) + (1 - beta) KL(q || m). It vanishes at beta = 0 and 1, so those ends
    are defined as its limits jsd/beta -> KL(p || q) (beta -> 0) and jsd/(1 - beta) -> KL(q || p)
    (beta -> 1): beta = 0 is forward KL, beta = 1 reverse KL. `eta` is lk_hybrid's: the larger,
    the sooner (in alpha) the loss turns from KL to TV (LK's best setting: 3).
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"kind={kind!r} is not a divergence; valid names: {', '.join(DIVERGENCES)}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    for name, value in (("beta", beta), ("tv_weight", tv_weight)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta must be a finite number >= 0, got {eta}")
    shape = _shape(student, "student")
    if _shape(teacher, "teacher") != shape:
        raise ValueError(f"student and teacher shapes differ: {tuple(shape)} vs {tuple(teacher.shape)}")
    idx = _kept_rows(mask, shape[:-1], reduction, chunk_size, vocab_chunk_size)
    s, t, V = _flat(student, detach=False), _flat(teacher, detach=True), shape[-1]
    grad = torch.is_grad_enabled() and _requires_grad(s)
    sliced = vocab_chunk_size is not None and vocab_chunk_size < V

    def rows_fn(rows):
        if kind in _CLOSED_FORM and not sliced and isinstance(s, torch.Tensor):
            return _closed_form_rows(kind, s, t, rows, temperature, tv_weight)
        if not sliced:
            lq = torch.log_softmax(_logits(s, rows, 0, V, temperature), -1)
            lp = torch.log_softmax(_logits(t, rows, 0, V, temperature), -1)
            return _finish(kind, _terms(kind, lp, lq, beta, tv_weight), eta)
        # Two passes over the slices: the log-normalizers first, then the summands with
        # log q = z_s - lse_q and log p = z_t - lse_p, each slice checkpointed on its own.
        bounds = _bounds(V, vocab_chunk_size)
        lse_q = _streamed_logsumexp(s, rows, bounds, temperature, grad)
        lse_p = _streamed_logsumexp(t, rows, bounds, temperature, False)
        parts = [
            _call(grad, _slice_terms, kind, s, t, rows, lo, hi, temperature, lse_q, lse_p, beta, tv_weight)
            for lo, hi in bounds
        ]
        return _finish(kind, _merge(kind, parts), eta)

    values = _over_chunks(rows_fn, shape[:-1].numel(), idx, chunk_size, grad and not sliced)
    return _reduce(values, idx, shape[:-1], reduction)


def forward_kl(student, teacher, mask=None, **kwargs) -> torch.Tensor:
    return divergence("forward_kl", student, teacher, mask, **kwargs)


def reverse_kl(student, teacher, mask=None, **kwargs) -> torch.Tensor:
    return divergence("reverse_kl", student, teacher, mask, **kwargs)


def jsd(student, teacher, mask=None, **kwargs) -> torch.Tensor:
    return divergence("jsd", student, teacher, mask, **kwargs)


def total_variation(student, teacher, mask=None, **kwargs) -> torch.Tensor:
    return divergence("tv", student, teacher, mask, **kwargs)


def soft_cross_entropy(student, teacher, mask=None, **kwargs) -> torch.Tensor:
    return divergence("soft_ce", student, teacher, mask, **kwargs)


def cross_entropy(
    student, labels, mask=None, *, chunk_size=None, vocab_chunk_size=None, reduction="mean", ignore_index=-100
) -> torch.Tensor:
    """Hard cross-entropy -log q(label) = logsumexp(z) - z[label], with the chunking and mask
    conventions of `divergence`; labels equal to `ignore_index` count as masked out."""
    shape = _shape(student, "student")
    V = shape[-1]
    if tuple(labels.shape) != tuple(shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(shape[:-1])} (student without the "
            f"vocabulary axis), got {tuple(labels.shape)}"
        )
    keep = labels != ignore_index
    if mask is not None:
        _check_mask(mask, shape[:-1])
        keep = keep & mask.bool()
    idx = _kept_rows(keep, shape[:-1], reduction, chunk_size, vocab_chunk_size)
    y = labels.reshape(-1).long()
    bad = y[idx][(y[idx] < 0) | (y[idx] >= V)]
    if bad.numel():
        raise ValueError(f"labels must lie in [0, {V}) or equal ignore_index={ignore_index}; found {bad[0].item()}")
    s = _flat(student, detach=False)
    grad = torch.is_grad_enabled() and _requires_grad(s)
    sliced = vocab_chunk_size is not None and vocab_chunk_size < V

    def rows_fn(rows):
        if not sliced:
            lse = torch.logsumexp(_logits(s, rows, 0, V, 1.0), -1)
        else:
            lse = _streamed_logsumexp(s, rows, _bounds(V, vocab_chunk_size), 1.0, grad)
        return lse - _label_logits(s, rows, y[rows])

    values = _over_chunks(rows_fn, shape[:-1].numel(), idx, chunk_size, grad and not sliced)
    return _reduce(values, idx, shape[:-1], reduction)


# ---------------------------------------------------------------------------------------------
# A top-k teacher (`cache-hidden --topk-logits k`): p is known on its k likeliest tokens, and the
# rest of the vocabulary, the tail, is one more bucket holding p's remaining mass. Both p and q
# are compared as distributions over these k + 1 outcomes: every divergence is exactly defined
# on them, equals the full-vocabulary one when k = V, and (data processing) never exceeds it.


def topk_teacher(logits, k: int):
    """(values [..., k] float32, ids [..., k] int32, tail [...]) of teacher logits [..., V]: the
    top-k logits, their ids and the log-sum-exp of the other V - k logits (-inf when k = V)."""
    z = logits.detach().float()
    values, ids = z.topk(k, dim=-1)
    tail = torch.logsumexp(z.scatter(-1, ids, float("-inf")), -1)
    return values, ids.to(torch.int32), tail


def topk_buckets(logits, ids):
    """Logits [..., V] -> [..., k + 1]: those at the teacher's top-k `ids`, then the log-sum-exp
    of the rest (the tail bucket; _FMIN stands in for the ids so that an empty tail has no NaN
    gradient)."""
    z, ids = logits.float(), ids.long()
    rest = torch.logsumexp(z.scatter(-1, ids, _FMIN), -1, keepdim=True)
    return torch.cat([z.gather(-1, ids), rest], -1)


def topk_divergence(kind: str, student, values, ids, tail, mask=None, **kwargs) -> torch.Tensor:
    """`divergence(kind, ...)` between a top-k teacher (values, ids, tail from `topk_teacher`)
    and the student logits [..., V], over the k + 1 buckets. At temperature 1 only: the tail's
    log-sum-exp is of z, and that of z / T cannot be recovered from it."""
    if kwargs.get("temperature", 1.0) != 1.0:
        raise ValueError(f"a top-k teacher is defined at temperature 1, got {kwargs['temperature']}")
    if tuple(values.shape) != tuple(ids.shape) or tuple(tail.shape) != tuple(values.shape[:-1]):
        raise ValueError(
            f"top-k teacher: values {tuple(values.shape)}, ids {tuple(ids.shape)} and tail "
            f"{tuple(tail.shape)} must be [..., k], [..., k], [...]"
        )
    if tuple(student.shape[:-1]) != tuple(values.shape[:-1]):
        raise ValueError(f"student {tuple(student.shape)} and top-k teacher {tuple(values.shape)}: the rows differ")
    if mask is None:
        teacher = torch.cat([values.float(), tail.float()[..., None]], -1)
        return divergence(kind, topk_buckets(student, ids), teacher, **kwargs)
    # The buckets of the kept rows only: bucketing reads the whole vocabulary of every row it gets.
    reduction = kwargs.pop("reduction", "mean")
    idx = _kept_rows(mask, values.shape[:-1], reduction, None, None)
    mask = mask.bool()
    student, values, ids, tail = (x[mask] for x in (student, values, ids, tail))  # [N, ...]: no copy of the rest
    per_row = topk_divergence(kind, student, values, ids, tail, reduction="none", **kwargs)
    return _reduce(per_row, idx, mask.shape, reduction)


def dpace_weights(hard_ce: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE's per-slot weights of block drafts (arXiv 2605.18810), detached: with q_i = exp(-CE_i)
    the draft's probability of slot i's label, qt_i = (1 - alpha) q_i + alpha (smoothed), the chance
    the chain survives to slot m, P_m = prod_{i<=m} qt_i, and w_j = sum_{m>=j} P_m, the slots past j
    whose survival slot j's draft carries. hard_ce, mask [..., S] (the slots in drafting order);
    masked slots count as surviving (qt = 1) and weigh 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        mask = mask.to(torch.float32)
        smooth = (1 - alpha) * torch.exp(-hard_ce.detach().float()) + alpha
        prefix = torch.cumprod(torch.where(mask > 0, smooth, torch.ones_like(smooth)), dim=-1)
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1])
        return suffix * mask


def smooth_l1(pred, target, mask=None, beta=1.0, reduction="mean") -> torch.Tensor:
    """Feature regression (a head predicting the target's next hidden state): per token, the mean
    over the feature axis of F.smooth_l1_loss(pred, target, beta); then reduced over kept tokens
    like `divergence`.
    The target features come from the frozen model and are detached."""
    if tuple(pred.shape) != tuple(target.shape):
        raise ValueError(f"pred and target shapes differ: {tuple(pred.shape)} vs {tuple(target.shape)}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0 (0 is plain L1), got {beta}")
    idx = _kept_rows(mask, pred.shape[:-1], reduction, None, None)
    x, y = pred.reshape(-1, pred.shape[-1]), target.detach().reshape(-1, pred.shape[-1])
    if idx is not None:
        x, y = x[idx], y[idx]
    values = F.smooth_l1_loss(x.float(), y.float(), reduction="none", beta=beta).mean(-1)
    return _reduce(values, idx, pred.shape[:-1], reduction)


# ---------------------------------------------------------------------------------------------
# The summands. lp, lq are log p, log q on one vocabulary slice; each returns the sum over it
# (nla: log of the sum; lk_hybrid: the sums of its two terms, [N, 2]). Slices combine by
# `_merge`, and `_finish` turns the whole vocabulary's sums into the per-token loss.


def _terms(kind, lp, lq, beta, tv_weight):
    if kind == "nla":  # log alpha = log sum exp(min(log p, log q)); clamp: all -inf gives no NaN
        return torch.logsumexp(torch.minimum(lp, lq).clamp(min=_FMIN), -1)
    # Only the probabilities a kind reads are exponentiated: at [N, V] every pass over the
    # vocabulary costs as much as the head's own forward.
    if kind == "soft_ce":
        p = lp.exp()
        return -(p * torch.where(p > 0, lq, 0.0)).sum(-1)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _xlogratio(lp.exp(), lp, lq)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _xlogratio(lq.exp(), lq, lp)
    p, q = lp.exp(), lq.exp()
    if kind == "lk_hybrid":
        return torch.stack([_xlogratio(p, lp, lq), torch.minimum(p, q).sum(-1)], -1)  # KL, alpha
    if kind == "jsd":
        # log m = log(beta p + (1-beta) q) as a logsumexp of log-terms; the clamp keeps entries
        # where p = q = 0 at a finite log m (logaddexp(-inf, -inf) has a NaN gradient).
        lm = torch.logaddexp((lp + math.log(beta)).clamp(min=_FMIN), lq + math.log1p(-beta))
        return beta * _xlogratio(p, lp, lm) + (1 - beta) * _xlogratio(q, lq, lm)
    # Speculative sampling keeps a draft token with probability alpha = sum min(p, q) = 1 - TV.
    tv = 0.5 * (p - q).abs().sum(-1)
    if kind == "tv":
        return tv
    return (1 - tv_weight) * _xlogratio(p, lp, lq) + tv_weight * tv  # kl_tv


# The kinds whose gradient in the student's logits z has a closed form in q and p (q = softmax(z / T)):
# soft_ce and forward_kl (q - p) / T, tv q (s - <q, s>) / 2T with s = sign(q - p), kl_tv their mix.
_CLOSED_FORM = ("soft_ce", "forward_kl", "tv", "kl_tv")


def _closed_form_rows(kind, s, t, rows, T, tv_weight):
    """`kind` (one of _CLOSED_FORM) of `rows` of the logits tensors s (student) and t (teacher) [N, V]
    with its own backward. Autograd's path keeps log q, masks, products and the float copy of the
    rows, and walks each back through the vocabulary; `_ClosedForm` keeps log q and p, writes the
    gradient of s in s's dtype, and reads the vocabulary about half as often."""
    with torch.no_grad():
        z = _logits(t, rows, 0, t.shape[-1], T)
        if kind in ("forward_kl", "kl_tv"):  # log p for the KL's value
            lp = torch.log_softmax(z, -1)
            p = lp.exp()
        else:
            lp, p = None, torch.softmax(z, -1)
    if not (torch.is_grad_enabled() and s.requires_grad):
        lq = torch.log_softmax(_logits(s, rows, 0, s.shape[-1], T), -1)
        return _closed_form_values(kind, lq, lp, p, tv_weight)
    return _ClosedForm.apply(s, rows, lp, p, T, kind, tv_weight)


def _closed_form_values(kind, lq, lp, p, tv_weight, q=None):
    """The per-row values of a _CLOSED_FORM kind from log q, log p (None for soft_ce and tv), p and q
    (None: exp(log q)), as `_terms` has them."""
    if kind == "soft_ce":
        return _unguarded(
            lambda r: -(p[r] * lq[r]).sum(-1), lambda r: -(p[r] * torch.where(p[r] > 0, lq[r], 0.0)).sum(-1)
        )
    kl = None
    if kind != "tv":
        kl = _unguarded(lambda r: (p[r] * (lp[r] - lq[r])).sum(-1), lambda r: _xlogratio(p[r], lp[r], lq[r]))
    if kind == "forward_kl":
        return kl
    tv = 0.5 * (p - (lq.exp() if q is None else q)).abs().sum(-1)
    return tv if kind == "tv" else (1 - tv_weight) * kl + tv_weight * tv


def _unguarded(fast, guarded):
    """fast(all rows), with guarded() redone on the rows where fast gave NaN: a term 0 x -inf, where
    p = 0 meets log q = -inf (or log p = -inf), is 0 in `_xlogratio`'s guarded form."""
    values = fast(slice(None))
    bad = values.isnan()
    if bad.any():
        values[bad] = guarded(bad)
    return values


class _ClosedForm(torch.autograd.Function):
    """A _CLOSED_FORM kind per row of s[rows] / T against the fixed p; its gradient goes into s's rows."""

    @staticmethod
    def forward(ctx, s, rows, lp, p, T, kind, tv_weight):
        lq = torch.log_softmax(_logits(s, rows, 0, s.shape[-1], T), -1)
        q = lq.exp()
        ctx.save_for_backward(q, p, *([rows] if isinstance(rows, torch.Tensor) else []))
        ctx.rows, ctx.shape, ctx.dtype, ctx.T, ctx.kind, ctx.w = rows, s.shape, s.dtype, T, kind, tv_weight
        return _closed_form_values(kind, lq, lp, p, tv_weight, q)

    @staticmethod
    def backward(ctx, grad):
        q, p, *index = ctx.saved_tensors
        rows, kind, w = index[0] if index else ctx.rows, ctx.kind, ctx.w
        dz = q - p  # d KL / dz (T = 1)
        if kind == "tv" or kind == "kl_tv":
            sign = torch.sign(dz)
            dtv = sign.sub_((q * sign).sum(-1, keepdim=True)).mul_(q)  # 2 d TV / dz
            dz = dtv.mul_(0.5) if kind == "tv" else dz.mul_(1 - w).add_(dtv, alpha=0.5 * w)
        dz = dz.mul_(grad[:, None] / ctx.T).to(ctx.dtype)
        if isinstance(rows, slice) and rows == slice(0, ctx.shape[0]):
            return dz, None, None, None, None, None, None
        ds = dz.new_zeros(ctx.shape)
        if isinstance(rows, slice):
            ds[rows] = dz
        else:
            ds.index_copy_(0, rows, dz)
        return ds, None, None, None, None, None, None


def _merge(kind, parts):
    """The whole vocabulary's sums from the slices' (log alpha adds in log space)."""
    return torch.logsumexp(torch.stack(parts), 0) if kind == "nla" else sum(parts)


def _finish(kind, sums, eta):
    if kind == "nla":
        return -sums
    if kind == "lk_hybrid":
        kl, alpha = sums.unbind(-1)
        lam = torch.exp(-eta * alpha.detach())  # the mix follows alpha but is not trained through it
        return lam * kl + (1 - lam) * (1 - alpha)  # TV = 1 - alpha
    return sums


def _xlogratio(x, lx, ly):
    """sum x (log x - log y) with 0 log 0 = 0. The where sits inside the product so that an
    entry with x = 0 contributes neither a NaN value (0 * -inf) nor a NaN gradient."""
    return (x * torch.where(x > 0, lx - ly, 0.0)).sum(-1)


def _slice_terms(kind, s, t, rows, lo, hi, T, lse_q, lse_p, beta, tv_weight):
    lq = _logits(s, rows, lo, hi, T) - lse_q[:, None]
    lp = _logits(t, rows, lo, hi, T) - lse_p[:, None]
    return _terms(kind, lp, lq, beta, tv_weight)


# ---------------------------------------------------------------------------------------------
# Chunking machinery.


def _streamed_logsumexp(src, rows, bounds, T, grad):
    """log sum_v exp(z_v) over slices of the vocabulary with a running max (online softmax):
    acc = sum exp(z - m) is rescaled by exp(m_old - m_new) whenever the max grows. The maxes
    are detached (the result does not depend on them); an all -inf slice gets the finite _FMIN
    so no -inf - (-inf) appears in value or gradient."""
    m = acc = None
    for lo, hi in bounds:
        shift, part = _call(grad, _slice_sumexp, src, rows, lo, hi, T)
        if m is None:
            m, acc = shift, part
        else:
            m_new = torch.maximum(m, shift)
            acc = acc * torch.exp(m - m_new) + part * torch.exp(shift - m_new)
            m = m_new
    return m + torch.log(acc)


def _slice_sumexp(src, rows, lo, hi, T):
    z = _logits(src, rows, lo, hi, T)
    shift = z.detach().amax(-1).clamp(min=_FMIN)
    return shift, torch.exp(z - shift[:, None]).sum(-1)


def _logits(src, rows, lo, hi, T):
    """float32 logits / T of `rows` (a slice or an index tensor) for vocabulary entries [lo, hi)."""
    if isinstance(src, Projected):
        bias = None if src.bias is None else src.bias[lo:hi].float()
        z = F.linear(src.hidden[rows].float(), src.weight[lo:hi].float(), bias)
    else:
        z = src[rows, lo:hi].float()
    return z if T == 1.0 else z / T


def _label_logits(src, rows, y):
    """z[label] for each row without touching the rest of the vocabulary."""
    if isinstance(src, Projected):
        # F.embedding, not weight[y]: indexing's backward adds repeated labels' gradients with atomic adds
        # on a multi-threaded CPU, in an order that changes from run to run; embedding's is deterministic
        z = (src.hidden[rows].float() * F.embedding(y, src.weight).float()).sum(-1)
        return z if src.bias is None else z + src.bias[y].float()
    return src[torch.arange(src.shape[0], device=src.device)[rows], y].float()


def _over_chunks(rows_fn, n, idx, chunk_size, may_checkpoint):
    """Per-token values of the kept rows (all n when idx is None), chunk_size rows at a time.
    A chunk is checkpointed whole only when chunk_size is given and the caller allows it (a
    vocabulary-sliced path checkpoints each slice itself); the plain path keeps everything.
    With no kept row, one empty chunk still runs, so the result stays attached to the graph."""
    m = n if idx is None else idx.numel()
    step = chunk_size or max(m, 1)
    out = []
    for a in range(0, max(m, 1), step):
        rows = slice(a, min(a + step, m)) if idx is None else idx[a : a + step]
        out.append(_call(may_checkpoint and chunk_size is not None, rows_fn, rows))
    return torch.cat(out)


def _bounds(V, step):
    return [(lo, min(lo + step, V)) for lo in range(0, V, step)]


def _call(use_checkpoint, fn, *args):
    # Non-reentrant checkpointing keeps only fn's inputs and reruns fn in backward; nothing here
    # draws random numbers, so the RNG state need not be saved.
    if use_checkpoint:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def _reduce(values, idx, shape, reduction):
    if reduction == "none":
        if idx is None:
            return values.reshape(shape)
        return values.new_zeros(shape.numel()).index_copy(0, idx, values).reshape(shape)
    total = values.sum()
    return total if reduction == "sum" else total / max(values.numel(), 1)


def _kept_rows(mask, batch_shape, reduction, chunk_size, vocab_chunk_size):
    """Validates the shared arguments; returns the flat indices of the kept rows (None: all)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (type(value) is not int or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if mask is None:
        return None
    _check_mask(mask, batch_shape)
    return mask.reshape(-1).bool().nonzero().squeeze(1)


def _check_mask(mask, batch_shape):
    if tuple(mask.shape) != tuple(batch_shape):
        raise ValueError(
            f"mask must have shape {tuple(batch_shape)} (the inputs without their last axis), got {tuple(mask.shape)}"
        )


def _shape(x, name):
    if isinstance(x, (torch.Tensor, Projected)):
        return torch.Size(x.shape)
    raise TypeError(f"{name} must be a logits tensor or a Projected, got {type(x).__name__}")


def _flat(x, detach):
    """[..., V] -> [N, V] rows (a Projected keeps its hidden [N, H]); the teacher is detached."""
    if isinstance(x, Projected):
        h, w, b = x.hidden.reshape(-1, x.hidden.shape[-1]), x.weight, x.bias
        if detach:
            h, w, b = h.detach(), w.detach(), None if b is None else b.detach()
        return Projected(h, w, b)
    x = x.reshape(-1, x.shape[-1])
    return x.detach() if detach else x


def _requires_grad(src):
    if isinstance(src, Projected):
        return any(p is not None and p.requires_grad for p in (src.hidden, src.weight, src.bias))
    return src.requires_grad
