"""Greedy identity: a lossless decoder's greedy tokens are the target's own argmax tokens.

In fp32 a speculative decode equals target-only's token for token. In bf16 or fp16 it need not:
verifying K + 1 tokens in one forward rounds differently from feeding them one at a time (other
GEMM shapes, other reduction orders), and a logit of 40 has a bf16 resolution (ulp) of 0.25, so
where the target's top two tokens are that close the two decodes can part, each then continuing
as the target's greedy answer at its precision. So a row that differs is scored token by token:
one teacher-forced forward of the target over prompt + the row's tokens gives, for every emitted
token x_t, its gap below the best logit, max_v l_t(v) - l_t(x_t), in units of the dtype's ulp at
the row's largest logit magnitude (the scale its rounding works at). Rounding leaves gaps of an ulp or two (target-only's own tokens show the same);
a decoder that kept a wrong KV entry, position or draft emits tokens whole logits below the best.
"""

from __future__ import annotations

import math

import torch

TIE_ULPS = 8.0  # a gap within this many ulps is rounding (measured: <= 4 in bf16 over 96 SmolLM2 prompt-rows)


def ulp(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s numbers at |value| (the resolution of a logit of that size)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    exponent = torch.floor(torch.log2(value.abs().clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.exp2(exponent - mantissa)


@torch.no_grad()
def gaps_in_ulps(target, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """[len(tokens)] float: each token's gap below the best logit of its position, in ulps of the
    target's dtype at that position's largest |logit|, from one teacher-forced forward over prompt + tokens."""
    if not tokens:
        return torch.zeros(0)
    device = target.get_output_embeddings().weight.device
    ids = torch.cat([prompt.flatten().cpu(), torch.tensor(tokens)])[None].to(device)
    logits = target(input_ids=ids, logits_to_keep=len(tokens) + 1).logits[0, :-1].float().cpu()  # [n, V]
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    dtype = target.get_output_embeddings().weight.dtype
    return (best - chosen) / ulp(logits.abs().max(dim=-1).values, dtype)


def compare_greedy(target, prompts: list[torch.Tensor], answers: list[list[int]], reference: list[list[int]]) -> dict:
    """A greedy row (`answers`, one token list per prompt) against target-only's (`reference`):
    identical, or scored by `gaps_in_ulps` on the prompts where they differ, the reference's own
    tokens beside it (the rounding noise of the dtype). `verdict`: "identical", "rounding" (every
    gap <= TIE_ULPS) or "mismatch"."""
    differ = [i for i, (a, b) in enumerate(zip(answers, reference)) if a != b]
    if not differ:
        return {"verdict": "identical", "prompts_differing": 0, "prompts": len(prompts)}
    parted = [
        next(
            (t for t, (x, y) in enumerate(zip(answers[i], reference[i])) if x != y),
            min(map(len, (answers[i], reference[i]))),
        )
        for i in differ
    ]
    worst = max(_largest(gaps_in_ulps(target, prompts[i], answers[i])) for i in differ)
    noise = max(_largest(gaps_in_ulps(target, prompts[i], reference[i])) for i in differ)
    return {
        "verdict": "rounding" if worst <= TIE_ULPS else "mismatch",
        "prompts_differing": len(differ),
        "prompts": len(prompts),
        # the first differing token of each such prompt (or where the shorter one ends)
        "parted_at": parted,
        "max_gap_ulps": worst if math.isfinite(worst) else None,
        "target_only_max_gap_ulps": noise if math.isfinite(noise) else None,
        "tolerance_ulps": TIE_ULPS,
        "dtype": str(target.get_output_embeddings().weight.dtype).removeprefix("torch."),
    }


def _largest(gaps: torch.Tensor) -> float:
    return float(gaps.max()) if gaps.numel() else 0.0


def describe_identity(check: dict) -> str:
    """A row's `compare_greedy` in a few words (for tables and the demo's identity line)."""
    if check["verdict"] == "identical":
        return "yes"
    gap = f"max gap {check['max_gap_ulps']:.1f} ulp, target-only's own {check['target_only_max_gap_ulps']:.1f}"
    if check["verdict"] == "rounding":
        return f"{check['dtype']} rounding ({check['prompts_differing']}/{check['prompts']} prompts part at near-ties; {gap})"
    return f"NO ({check['prompts_differing']}/{check['prompts']} prompts; {gap} > {check['tolerance_ulps']:g})"
