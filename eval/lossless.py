"""A statistical check that speculative decoding with a given pair is lossless.

Decode the same prompt many times with different seeds through the real decoder, and compare
the histograms of the first new token and of the first two new tokens with the target's exact
distributions:
    P(t1)     = p(t1 | prompt)
    P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1)
(both after the sampling warpers). Pearson's chi-square test gives a p-value for each. Decoding
runs with K drafts, so the first two tokens cover the acceptance test, the residual and (for
K = 1) the bonus token. For K >= 2 the bonus is token K + 1 of the first call (drawn when all
K drafts were accepted), so a third test checks t_{K+1} against p(. | prompt, t1..tK), each
sample against its own context (`stats.pit_uniformity`: the randomised probability integral
transform, uniform exactly when every t_{K+1} follows its conditional).

Every path of the decoder can be checked: `batch_size=B` decodes B copies of the prompt per
call through the batched loop (each row is one sample, with its own generator), and
`static_cache` / `compile` run it over the preallocated caches and compiled steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from draftsmith.decoding import Drafter, generate_batch
from draftsmith.decoding.loop import DEFAULT_NUM_DRAFT_TOKENS
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.eval.stats import ChiSquare, chi_square_gof, pit_uniformity, token_cdf

MIN_SAMPLES = 100  # fewer decodes leave the chi-square test without power or validity


@dataclass
class LosslessResult:
    samples: int
    first_token: ChiSquare
    first_two_tokens: ChiSquare
    acceptance_rate: float
    threshold: float
    bonus_token: ChiSquare | None = None  # t_{K+1} given t1..tK; None at K = 1 (the first-two test covers it)
    num_draft_tokens: int = 1

    @property
    def tests(self) -> list[ChiSquare]:
        return [self.first_token, self.first_two_tokens] + ([self.bonus_token] if self.bonus_token else [])

    @property
    def passed(self) -> bool:
        return min(t.p_value for t in self.tests) >= self.threshold

    def describe(self) -> str:
        verdict = (
            "PASS: consistent with lossless speculative sampling"
            if self.passed
            else "FAIL: the speculative output is NOT distributed as the target's"
        )
        k = self.num_draft_tokens
        labels = ["first token:", "first two tokens:"]
        labels += [f"token {k + 1} (bonus) | t1..t{k}:"] if self.bonus_token else []
        width = max(len(label) for label in labels) + 1
        rate = f"share of drafted tokens accepted in these runs: {self.acceptance_rate:.2f}"
        lines = [f"samples: {self.samples}  ({rate})"]
        lines += [
            f"{label:<{width}} chi2 = {t.statistic:.1f}, dof = {t.dof}, p = {t.p_value:.4f}"
            for label, t in zip(labels, self.tests)
        ]
        lines.append(f"verdict ({'all' if self.bonus_token else 'both'} p >= {self.threshold:g}): {verdict}")
        return "\n".join(lines)


@torch.inference_mode()
def next_token_probs(target, prompt: torch.Tensor, sampling: SamplingConfig, continuations, batch: int = 64):
    """p(. | prompt, c) [len(continuations), V] (after the warpers) for equal-length continuations c."""
    device = target.device
    prompt = prompt.to(device)
    out = []
    for start in range(0, len(continuations), batch):
        tail = torch.tensor(continuations[start : start + batch], dtype=torch.long, device=device)
        seqs = torch.cat([prompt.expand(len(tail), -1), tail.reshape(len(tail), -1)], dim=1)
        out.append(sampling.probs(target(seqs).logits[:, -1]))
    return torch.cat(out)


@torch.inference_mode()
def exact_first_two(target, prompt: torch.Tensor, sampling: SamplingConfig, first_tokens: list[int], batch: int = 64):
    """p(t1) [V], and p(t2 | t1) [len(first_tokens), V] for the given t1 values."""
    p1 = sampling.probs(target(prompt.to(target.device)[None]).logits[0, -1])
    if not first_tokens:
        return p1, p1.new_zeros(0, p1.numel())
    return p1, next_token_probs(target, prompt, sampling, [[t] for t in first_tokens], batch)


def bonus_token_test(
    target,
    prompt: torch.Tensor,
    sampling: SamplingConfig,
    samples: list[list[int]],
    k: int,
    seed: int = 0,
    batch: int = 64,
) -> ChiSquare:
    """Token k + 1 of every sample against p(. | prompt, its own t1..tk): the bonus token of a call
    that accepted all k drafts, else the next call's first token; both must follow p. Batched,
    keeping only F(t - 1) and p(t) per sample (never [samples, V] at once)."""
    parts = []
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        probs = next_token_probs(target, prompt, sampling, [tokens[:k] for tokens in chunk], batch)
        parts.append(torch.stack(token_cdf([tokens[k] for tokens in chunk], probs)).cpu())
    below, p_t = torch.cat(parts, dim=1)
    generator = torch.Generator().manual_seed(seed)  # the transform's own uniforms: a repeatable p-value
    return pit_uniformity(below, p_t, generator=generator)


def check_lossless(
    target,
    drafter: Drafter,
    prompt: torch.Tensor,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    samples: int = 2000,
    seed: int = 0,
    threshold: float = 1e-3,
    progress: bool = True,
    batch_size: int = 1,
    static_cache: bool = False,
    compile: bool | str = False,
) -> LosslessResult:
    sampling = SamplingConfig(temperature, top_k, top_p)
    if sampling.greedy:
        raise ValueError("check-lossless needs sampling: temperature must be > 0")
    if not isinstance(samples, int) or samples < MIN_SAMPLES:
        raise ValueError(
            f"samples must be an integer >= {MIN_SAMPLES} for a meaningful chi-square test, got {samples!r}"
        )
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold is a p-value: it must be in (0, 1), got {threshold!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    model = target
    sequences, accepted, proposed = [], 0, 0
    calls = -(-samples // batch_size)
    for call in tqdm(range(calls), desc="check-lossless", unit="batch", disable=not progress):
        rows = min(batch_size, samples - call * batch_size)
        out = generate_batch(
            model,
            [prompt] * rows,
            drafter,
            max_new_tokens=num_draft_tokens + 1,  # the first call drafts all K tokens
            num_draft_tokens=num_draft_tokens,
            sampling=sampling,
            seed=seed + call,  # row b of call c draws from row_seed(seed + c, b): every sample its own stream
            static_cache=static_cache,
            compile=compile,
        )
        sequences += [list(tokens) for tokens in out.tokens]
        accepted += sum(sum(row.accepted) for row in out.rows)
        proposed += sum(sum(row.proposed) for row in out.rows)

    pairs = [tuple(tokens[:2]) for tokens in sequences]
    first = torch.tensor([p[0] for p in pairs])
    p1 = exact_first_two(model, prompt, sampling, [])[0].cpu()
    vocab = p1.numel()
    first_test = chi_square_gof(torch.bincount(first, minlength=vocab), p1)

    # Joint test over categories (t1, t2) for the likely t1 (expected count >= 1), plus one
    # category "any other t1". The set is fixed by p, not by what was observed: choosing it
    # from the samples would bias the test. chi_square_gof pools the small categories.
    likely = (p1 * samples >= 1.0).nonzero().flatten()
    likely = likely[p1[likely].argsort(descending=True)][:4096].sort().values.tolist()
    _, p2 = exact_first_two(model, prompt, sampling, likely)
    index = {t: i for i, t in enumerate(likely)}
    other = len(likely) * vocab
    joint_counts = torch.zeros(other + 1)
    for t1, t2 in pairs:
        joint_counts[index[t1] * vocab + t2 if t1 in index else other] += 1
    joint_probs = (p1[likely].double().unsqueeze(1) * p2.cpu().double()).flatten()
    joint_probs = torch.cat([joint_probs, (1 - p1[likely].double().sum()).clamp(min=0).reshape(1)])
    joint_test = chi_square_gof(joint_counts, joint_probs)
    k = num_draft_tokens
    bonus = bonus_token_test(model, prompt, sampling, sequences, k, seed) if k >= 2 else None
    return LosslessResult(
        samples=samples,
        first_token=first_test,
        first_two_tokens=joint_test,
        acceptance_rate=accepted / max(1, proposed),
        threshold=threshold,
        bonus_token=bonus,
        num_draft_tokens=k,
    )
