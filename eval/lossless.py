"""A statistical check that speculative decoding with a given pair is lossless.

Decode the same prompt many times with different seeds through the real decoder, and compare
the histograms of the first new token and of the first two new tokens with the target's exact
distributions:
    P(t1)     = p(t1 | prompt)
    P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1)
(both after the sampling warpers). Pearson's chi-square test gives a p-value for each. Decoding
runs with K drafts, so the first two tokens cover the acceptance test, the residual and (for
K = 1) the bonus token.

Every path of the decoder can be checked: `batch_size=B` decodes B copies of the prompt per
call through the batched loop (each row is one sample, with its own generator), and
`static_cache` / `compile` run it over the preallocated caches and compiled steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from draftsmith.eval.runtime import Drafter, generate_batch
from draftsmith.eval.runtime.sampling import SamplingConfig
from draftsmith.eval.stats import ChiSquare, chi_square_gof


@dataclass
class LosslessResult:
    samples: int
    first_token: ChiSquare
    first_two_tokens: ChiSquare
    acceptance_rate: float
    threshold: float

    @property
    def passed(self) -> bool:
        return min(self.first_token.p_value, self.first_two_tokens.p_value) >= self.threshold

    def describe(self) -> str:
        verdict = (
            "PASS: consistent with lossless speculative sampling"
            if self.passed
            else "FAIL: the speculative output is NOT distributed as the target's"
        )
        return (
            f"samples: {self.samples}  (draft acceptance in these runs: {self.acceptance_rate:.2f})\n"
            f"first token:       chi2 = {self.first_token.statistic:.1f}, dof = {self.first_token.dof}, "
            f"p = {self.first_token.p_value:.4f}\n"
            f"first two tokens:  chi2 = {self.first_two_tokens.statistic:.1f}, dof = {self.first_two_tokens.dof}, "
            f"p = {self.first_two_tokens.p_value:.4f}\n"
            f"verdict (both p >= {self.threshold:g}): {verdict}"
        )


@torch.inference_mode()
def exact_first_two(target, prompt: torch.Tensor, sampling: SamplingConfig, first_tokens: list[int], batch: int = 64):
    """p(t1) [V], and p(t2 | t1) [len(first_tokens), V] for the given t1 values."""
    device = target.device
    prompt = prompt.to(device)
    logits = target(prompt[None]).logits[0, -1]
    p1 = sampling.probs(logits)
    p2 = []
    for start in range(0, len(first_tokens), batch):
        t1 = torch.tensor(first_tokens[start : start + batch], device=device)
        seqs = torch.cat([prompt.expand(len(t1), -1), t1[:, None]], dim=1)
        p2.append(sampling.probs(target(seqs).logits[:, -1]))
    return p1, torch.cat(p2) if p2 else p1.new_zeros(0, p1.numel())


def check_lossless(
    target,
    drafter: Drafter,
    prompt: torch.Tensor,
    *,
    num_draft_tokens: int = 4,
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
    if not isinstance(samples, int) or samples < 100:
        raise ValueError(f"samples must be an integer >= 100 for a meaningful chi-square test, got {samples!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    model = target
    pairs, accepted, proposed = [], 0, 0
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
        pairs += [tuple(tokens[:2]) for tokens in out.tokens]
        accepted += sum(sum(row.accepted) for row in out.rows)
        proposed += sum(sum(row.proposed) for row in out.rows)

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
    return LosslessResult(
        samples=samples,
        first_token=first_test,
        first_two_tokens=joint_test,
        acceptance_rate=accepted / max(1, proposed),
        threshold=threshold,
    )
