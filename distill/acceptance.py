"""Expected accepted length from per-position acceptance: the `tau_simulated` every trainer's
held-out evaluation reports, and the tau the chain tuner (eval/tune.py) predicts for each K.

A chain of K drafts is verified left to right and stops at the first rejection; draft i is
accepted with probability alpha_i given that drafts 1..i-1 were. One target call then yields

    tau(K) = 1 + sum_{i=1..K} prod_{j<=i} alpha_j

tokens. The 1 is the bonus token: the target's own token at the first rejection (or after the
K-th draft) comes with every call, so target-only decoding has tau = 1 and K drafts that are
always right give K + 1.
"""

from __future__ import annotations


def simulated_tau(alphas, k: int | None = None):
    """tau(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j, counting the bonus token; K = `k`, or every
    position given.

    `alphas`: alpha_1, alpha_2, ... as floats, or as tensors of one shape, one chain per element
    (0/1 hits of teacher-forced drafts, or acceptance probabilities; float64 keeps long sums
    exact). Returns a float, or a tensor of that shape.
    """
    tau = reach = 1.0
    for alpha in list(alphas)[:k]:
        reach = reach * alpha  # P(drafts 1..i are all accepted)
        tau = tau + reach
    return tau
