"""Sampling maths of speculative decoding, on plain tensors.

Everything here works on a batch of rows so that the same code serves one sequence, many
sequences and the 10^5-draw statistical tests. Nothing here knows about models.

Notation (Leviathan et al. 2023, Chen et al. 2023):
    p_i  the target's final sampling distribution at draft position i (after the warpers)
    q_i  the distribution the draft token x_i was actually drawn from
The chain rule below makes the emitted tokens distributed exactly as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the target samples: temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer (0 = off), got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        return "sampling " + " ".join(parts)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The final sampling distribution for `logits [..., V]` (float32).

        Greedy returns the one-hot of the argmax, so that greedy is the T -> 0 limit of
        sampling and every formula below holds unchanged.
        """
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(self.warp(logits), dim=-1)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k, then top-p, as HF's logits warpers order them."""
        logits = logits.float() / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
            # *before* it already reaches top_p. The first token is always kept.
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs [..., V]`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def draw_rows(q: torch.Tensor, generators, live: list[bool]) -> torch.Tensor:
    """One token per row b of q [B, V], drawn with row b's generator where `live[b]`; elsewhere
    the argmax (never verified), leaving that generator untouched, so a row draws what it would
    draw alone."""
    return torch.stack(
        [
            draw(q[b].to(g.device), g).reshape(()).to(q.device) if on else q[b].argmax()
            for b, (g, on) in enumerate(zip(generators, live))
        ]
    )


def verify_chain(
    p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a chain of K draft tokens, for B rows at once.

    Args:
        p: [B, K+1, V] target distributions; p[:, i] scores draft token i, p[:, K] is the bonus.
        draft_tokens: [B, K] the proposed tokens x_1..x_K.
        q: [B, K, V] the distributions the tokens were drawn from, or None for deterministic
            proposals (q = 1 on the proposed token: prompt lookup, argmax drafts).
    Returns:
        num_accepted [B] (n in 0..K) and next_token [B]: the residual sample at the first
        rejection, or the bonus sample from p[:, K] when all K were accepted. The row emits
        draft_tokens[:n] followed by next_token.

    The rule, per position i (stop at the first rejection):
        accept x_i  with probability  min(1, p_i(x_i) / q_i(x_i))
        on reject   sample from       norm(max(0, p_i - q_i))
    For q one-hot on x_i this is: accept with p_i(x_i); on reject sample from p_i with x_i
    removed. Either way the emitted token is distributed exactly as p_i.
    """
    batch, k = draft_tokens.shape
    if p.shape[:2] != (batch, k + 1):
        raise ValueError(f"p must be [B, K+1, V] = [{batch}, {k + 1}, V], got {list(p.shape)}")
    p_x = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    u = torch.rand(batch, k, generator=generator, device=p.device)
    if q is None:
        accept = u < p_x  # r < min(1, p/1)
    else:
        q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        accept = u * q_x < p_x  # r < p/q without dividing by zero
    # n = length of the accepted prefix: the first False, or K when all accepted.
    num_accepted = accept.long().cumprod(-1).sum(-1)

    rows = torch.arange(batch, device=p.device)
    p_n = p[rows, num_accepted]  # [B, V]: p at the first rejection, or the bonus p_K
    rejected = num_accepted < k
    stop = num_accepted.clamp(max=k - 1) if k else num_accepted
    if k:
        if q is None:
            q_n = torch.zeros_like(p_n).scatter_(-1, draft_tokens[rows, stop].unsqueeze(-1), 1.0)
        else:
            q_n = q[rows, stop]
        residual = (p_n - q_n).clamp_(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p_n <= q_n everywhere, i.e. p_n == q_n, where rejection has
        # probability 0; fall back to p_n so that a float round-off cannot produce NaNs.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
        final = torch.where(rejected.unsqueeze(-1), residual, p_n)
    else:
        final = p_n
    return num_accepted, draw(final, generator)


def verify_chain_greedy(target_argmax: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    """Greedy verification of one row: the longest prefix of the K drafts that matches the
    target's argmax before each, then the target's argmax at the first mismatch (or the bonus
    position). target_argmax: K + 1 ids; returns (num_accepted, next_token)."""
    n = next((i for i, (t, x) in enumerate(zip(target_argmax, draft_tokens)) if t != x), len(draft_tokens))
    return n, target_argmax[n]


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance a token drawn from q is kept."""
    return torch.minimum(p, q).sum(-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_x p log(p / q) over the last axis; inf where q misses p's support."""
    p, q = p.float(), q.float()
    terms = torch.where(p > 0, p * (torch.log(p) - torch.log(q)), torch.zeros_like(p))
    return terms.sum(-1)


def split_kl(p: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, KL(p_V || q)) over the last axis, V = the draft's vocabulary (finite q logits):
    m = sum_{x not in V} p(x), the target mass the draft cannot propose, and the KL of p restricted
    to V and renormalised, p_V = p 1[V] / (1 - m). A full-vocabulary draft has m = 0 and the full
    KL; a reduced draft vocabulary gets a finite KL where KL(p || q) is inf. p_V is normalised by
    its own sum, never by 1 - m: when the target puts almost all its mass outside V (a draft's
    candidate set the target does not rank), 1 - m cancels to float noise and the KL explodes."""
    p = p.float()
    vocab = torch.isfinite(q_logits)
    m = torch.where(vocab, torch.zeros_like(p), p).sum(-1)
    inside = torch.where(vocab, p, torch.zeros_like(p))
    p_v = inside / inside.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    log_q = torch.log_softmax(q_logits.float(), -1)
    terms = torch.where(p_v > 0, p_v * (torch.log(p_v) - log_q), torch.zeros_like(p_v))
    return m, terms.sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.float() - q.float()).abs().sum(-1)
