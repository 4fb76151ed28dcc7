"""Small statistics used by the losslessness checks and the reports (no scipy needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    bins: int


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution: P(X >= statistic)."""
    if dof <= 0:
        return 1.0
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), x))


def chi_square_gof(counts, probs, min_expected: float = 5.0) -> ChiSquare:
    """Pearson goodness-of-fit of observed `counts` against exact category `probs`.

    Categories whose expected count is below `min_expected` are pooled into one bin (with the
    mass of categories never observed), the usual validity condition of the test. An
    observation in a category of probability zero is an impossible event: p-value 0.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {list(counts.shape)} and probs {list(probs.shape)} differ")
    n = counts.sum()
    if n <= 0:
        raise ValueError("no observations")
    if bool(((probs <= 0) & (counts > 0)).any()):
        return ChiSquare(statistic=math.inf, dof=max(1, int((probs > 0).sum()) - 1), p_value=0.0, bins=0)
    probs = probs / probs.sum()
    expected = n * probs
    big = expected >= min_expected
    obs = list(counts[big].tolist())
    exp = list(expected[big].tolist())
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp >= min_expected or (rest_exp > 0 and not exp):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0:
        # The pooled bin is itself too small to be tested on its own (one observation there
        # would dominate the statistic): merge it into the smallest kept bin.
        j = min(range(len(exp)), key=exp.__getitem__)
        obs[j] += rest_obs
        exp[j] += rest_exp
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    statistic = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    dof = len(obs) - 1
    return ChiSquare(statistic=statistic, dof=dof, p_value=chi2_sf(statistic, dof), bins=len(obs))


def token_cdf(tokens, probs) -> tuple[torch.Tensor, torch.Tensor]:
    """(F(t - 1), p(t)) per row, float64, for observed `tokens` [N] of the distributions `probs`
    [N, V] (rows renormalised; F the CDF over token ids): the inputs of `pit_uniformity`."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=probs.device).flatten()
    probs = probs.double()
    probs = probs / probs.sum(-1, keepdim=True)
    p_t = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return probs.cumsum(-1).gather(-1, tokens[:, None]).squeeze(-1) - p_t, p_t


def pit_uniformity(below, p_t, bins: int = 20, generator: torch.Generator | None = None) -> ChiSquare:
    """Do observed tokens follow their own exact distributions, one context per observation?
    The randomised probability integral transform: with F a row's CDF over token ids,
    u = F(t - 1) + U * p(t), U ~ Uniform(0, 1), is exactly Uniform(0, 1) when t ~ p. Pearson's
    test of the u in `bins` equal bins then checks all rows at once, however few share a context
    (a per-context histogram would have ~1 sample per cell). `below`, `p_t`: from `token_cdf`.
    A token of probability zero is an impossible event: p-value 0."""
    below, p_t = torch.as_tensor(below, dtype=torch.float64), torch.as_tensor(p_t, dtype=torch.float64)
    if bool((p_t <= 0).any()):
        return ChiSquare(statistic=math.inf, dof=bins - 1, p_value=0.0, bins=bins)
    u = below + torch.rand(p_t.numel(), generator=generator, dtype=torch.float64) * p_t
    counts = torch.bincount((u * bins).floor().long().clamp(0, bins - 1), minlength=bins)
    return chi_square_gof(counts, torch.full((bins,), 1.0 / bins, dtype=torch.float64))


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence."""
    vals = sorted(values)
    if not vals:
        return math.nan
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
