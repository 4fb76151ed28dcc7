"""The speculative decoder: one loop for target-only and speculative decoding.

Each iteration: the drafter proposes k tokens, the target scores [last token, x_1..x_k] in
one forward, `verify_chain` keeps a prefix and adds one token (the correction at the first
rejection, or the bonus after a full acceptance), the caches are cropped. With no drafter
k = 0, and the same loop is plain autoregressive decoding: the speedup baseline runs the very
same code.

The target's cache always holds every token but the last; the first iteration therefore
already speculates (the prompt's last token is fed together with the first drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.eval.drafters import Drafter, Proposal
from draftsmith.eval.sampling import (
    SamplingConfig,
    acceptance_probability,
    kl_divergence,
    total_variation,
    verify_chain,
)
from draftsmith.heads.target import CausalLMAdapter


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class DecodeStats:
    """Counters of one or more decodes. Merge with `+`.

    `proposed[j]` / `accepted[j]`: drafts proposed / kept at target call j.
    `reached[i]` / `accepted_at[i]`: how often draft position i+1 was verified on the true
    trajectory (every earlier draft accepted) / accepted there.
    Distances (only with `measure_distances=True`), per position, on reached positions:
    sums of KL(p || q) and TV(p, q) of the raw (T=1) distributions and of the exact
    acceptance probability sum_x min(p, q) of the sampling distributions.
    """

    num_draft_tokens: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    new_tokens: int = 0
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    kl_sum: list[float] = field(default_factory=list)
    tv_sum: list[float] = field(default_factory=list)
    accept_prob_sum: list[float] = field(default_factory=list)
    distance_count: list[int] = field(default_factory=list)
    kl_count: list[int] = field(default_factory=list)  # positions with draft distributions

    def __post_init__(self):
        k = self.num_draft_tokens
        for name in ("reached", "accepted_at", "distance_count", "kl_count"):
            if not getattr(self, name):
                setattr(self, name, [0] * k)
        for name in ("kl_sum", "tv_sum", "accept_prob_sum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * k)

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        k = max(self.num_draft_tokens, other.num_draft_tokens)

        def add(a, b):
            a = list(a) + [0] * (k - len(a))
            b = list(b) + [0] * (k - len(b))
            return [x + y for x, y in zip(a, b)]

        return DecodeStats(
            num_draft_tokens=k,
            proposed=self.proposed + other.proposed,
            accepted=self.accepted + other.accepted,
            reached=add(self.reached, other.reached),
            accepted_at=add(self.accepted_at, other.accepted_at),
            new_tokens=self.new_tokens + other.new_tokens,
            drafter_seconds=self.drafter_seconds + other.drafter_seconds,
            target_seconds=self.target_seconds + other.target_seconds,
            prefill_seconds=self.prefill_seconds + other.prefill_seconds,
            ttft_seconds=self.ttft_seconds + other.ttft_seconds,
            total_seconds=self.total_seconds + other.total_seconds,
            kl_sum=add(self.kl_sum, other.kl_sum),
            tv_sum=add(self.tv_sum, other.tv_sum),
            accept_prob_sum=add(self.accept_prob_sum, other.accept_prob_sum),
            distance_count=add(self.distance_count, other.distance_count),
            kl_count=add(self.kl_count, other.kl_count),
        )

    @property
    def target_calls(self) -> int:
        """Decoding calls of the target (the prefill is not one)."""
        return len(self.proposed)

    @property
    def tau(self) -> float:
        """Mean tokens per target call, counting the bonus/correction token (plain decoding = 1)."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def alpha(self) -> float:
        """Conditional acceptance over all reached positions (Leviathan's alpha, pooled)."""
        return sum(self.accepted_at) / max(1, sum(self.reached))

    @property
    def alpha_per_position(self) -> list[float | None]:
        """alpha_i = P(draft i accepted | drafts 1..i-1 accepted); None if never reached."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    @staticmethod
    def _mean(sums, counts) -> list[float | None]:
        return [s / c if c else None for s, c in zip(sums, counts)]

    @property
    def kl_per_position(self):
        return self._mean(self.kl_sum, self.kl_count)

    @property
    def tv_per_position(self):
        return self._mean(self.tv_sum, self.kl_count)

    @property
    def expected_alpha_per_position(self):
        """Mean of sum_x min(p, q) at reached positions: the theory for alpha_per_position."""
        return self._mean(self.accept_prob_sum, self.distance_count)


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded)
    stats: DecodeStats


class _Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self) -> float:
        synchronize(self.device)
        return time.perf_counter()


def _as_prompt(input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a LongTensor")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be 1-D or [1, T]; got batch {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D or [1, T] tensor, got {list(input_ids.shape)}")
    return input_ids


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(t) for t in torch.as_tensor(eos_token_id).flatten().tolist()}


@torch.inference_mode()
def generate(
    target: PreTrainedModel | CausalLMAdapter,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    measure_distances: bool = False,
) -> Generation:
    """Decode up to `max_new_tokens` from `target`, speculating with `drafter` (None = target only).

    Lossless: with sampling the output is distributed exactly as the target's own sampling
    under (temperature, top_k, top_p); with temperature 0 it equals greedy decoding.
    `measure_distances` adds per-position KL/TV/expected-acceptance to the stats (off for
    timing runs: it costs a softmax per position).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    adapter = target if isinstance(target, CausalLMAdapter) else CausalLMAdapter(target)
    device = adapter.device
    prompt = _as_prompt(input_ids).to(device)
    eos = _eos_set(eos_token_id)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    k_max = num_draft_tokens if drafter is not None else 0
    stats = DecodeStats(num_draft_tokens=k_max)
    now = _Timer(device)
    seq = torch.empty(prompt.numel() + max_new_tokens + k_max + 1, dtype=torch.long, device=device)
    seq[: prompt.numel()] = prompt
    length = prompt.numel()
    new: list[int] = []

    start = now()
    adapter.reset()
    if length > 1:
        adapter.forward(prompt[:-1].unsqueeze(0), logits_to_keep=1)
    stats.prefill_seconds = now() - start
    if drafter is not None:
        drafter.start(prompt)

    while len(new) < max_new_tokens:
        # Never draft past the budget: the call emits at most k + 1 tokens.
        k = min(k_max, max_new_tokens - len(new) - 1)
        proposal = None
        if k > 0:
            t0 = now()
            proposal = drafter.propose(seq[:length], k, sampling, generator)
            stats.drafter_seconds += now() - t0
            k = len(proposal)
        t0 = now()
        drafts = proposal.tokens.to(device) if k else seq[:0]
        last = seq[length - 1 : length]
        fed = (torch.cat([last, drafts]) if k else last).unsqueeze(0)
        logits = adapter.forward(fed).logits[0]  # [k+1, V]
        # One device->host copy per call (the accepted count and the emitted tokens together).
        if sampling.greedy:
            # `verify_chain_greedy` on host lists: keep the drafts that equal the target's
            # argmax, then emit the argmax at the first mismatch (or the bonus). argmax needs no
            # float copy of the logits: a bf16 -> fp32 cast is exact and keeps the order.
            choice = logits.argmax(-1)  # [k+1]
            ids = torch.cat([choice, drafts]).tolist() if k else choice.tolist()
            n = 0
            while n < k and ids[k + 1 + n] == ids[n]:
                n += 1
            emitted = ids[: n + 1]  # drafts[:n] equal choice[:n]
            seq[length : length + n + 1] = choice[: n + 1]
            p = None
        else:
            logits = logits.float()
            p = sampling.probs(logits)
            q = proposal.probs.to(device)[None] if k and proposal.probs is not None else None
            n, nxt = verify_chain(p[None], drafts[None], q, generator)
            nxt = nxt.to(device)
            ids = torch.cat([n.to(device), nxt, drafts]).tolist()
            n = ids[0]
            emitted = ids[2 : 2 + n] + ids[1:2]
            seq[length : length + n + 1] = torch.cat([drafts[:n], nxt])
        # The cache held length-1 tokens and was fed k+1: keep the last token and n drafts.
        adapter.crop(length + n)
        stats.target_seconds += now() - t0
        if drafter is not None and k:
            drafter.accepted(n)
        if measure_distances and k:
            _add_distances(stats, logits.float(), p, proposal, sampling, reached=min(n + 1, k))
        length += n + 1
        if not new:
            stats.ttft_seconds = now() - start
        stats.proposed.append(k)
        stats.accepted.append(n)
        for i in range(min(n + 1, k)):
            stats.reached[i] += 1
            stats.accepted_at[i] += int(i < n)
        hit = next((i for i, t in enumerate(emitted) if t in eos), None)
        new.extend(emitted if hit is None else emitted[: hit + 1])
        if hit is not None:
            break

    stats.new_tokens = len(new)
    stats.total_seconds = now() - start
    return Generation(tokens=new, stats=stats)


def _add_distances(stats, logits, p, proposal: Proposal, sampling, reached: int) -> None:
    """Per-position distances on the positions whose context is the true trajectory."""
    tokens = proposal.tokens[:reached].to(logits.device)
    if sampling.greedy:
        expected = (logits[:reached].argmax(-1) == tokens).float()
    elif proposal.probs is None:  # deterministic: accepted with probability p(x)
        expected = p[:reached].gather(-1, tokens[:, None]).squeeze(-1)
    else:
        expected = acceptance_probability(p[:reached], proposal.probs[:reached].to(p.device))
    if proposal.logits is not None:
        p_raw = torch.softmax(logits[:reached], -1)
        q_raw = torch.softmax(proposal.logits[:reached].to(logits.device).float(), -1)
        kl, tv = kl_divergence(p_raw, q_raw).tolist(), total_variation(p_raw, q_raw).tolist()
    else:
        kl = tv = None
    for i, e in enumerate(expected.tolist()):
        stats.accept_prob_sum[i] += e
        stats.distance_count[i] += 1
        if kl is not None:
            stats.kl_sum[i] += kl[i]
            stats.tv_sum[i] += tv[i]
            stats.kl_count[i] += 1
