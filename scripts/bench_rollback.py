"""What rolling back a hybrid target's recurrent state costs, batch 1, greedy.

    python scripts/bench_rollback.py                                    # random Qwen3.5, hidden 256, 8 layers
    python scripts/bench_rollback.py --family qwen3_next --num-draft-tokens 1 --repeats 9
    python scripts/bench_rollback.py --hidden 1024 --layers 16 --device cuda --dtype bf16

Three decodes of the same prompts, alternated within every repeat, each row the median over repeats
of the time per generated token (EOS off: every run emits --max-new-tokens tokens):

    target-only        plain decoding of the hybrid target (one column per call)
    rejected-K         a drafter whose K drafts are always rejected: every call feeds the last token
                       and K drafts, records the recurrent states after each column and keeps only
                       the first (every recurrent layer is rolled back on every call)
    attention-K        the same always-rejected drafter on a Llama of the same width and depth:
                       what feeding K + 1 columns costs where there is no state to roll back

rejected-K / target-only is the whole overhead of speculating with nothing accepted; its share beyond
attention-K / (attention-only target-only) is what the recurrent rollback adds. The profile line gives
the share of a rejected-K decode spent in the rollback's own code (`decoding/recurrent.py`: priming the
cache layers, stacking the per-column states, picking each row's), from cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from draftsmith.decoding import generate
from draftsmith.decoding.drafters import Drafter, Proposal
from draftsmith.decoding.target import synchronize
from draftsmith.heads.models import resolve_device, resolve_dtype


class AlwaysRejected(Drafter):
    """K copies of a token the target does not pick (checked: the run's acceptance must be 0)."""

    name = "always-rejected"

    def __init__(self, token: int):
        self.token = token

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        width = max(num_tokens)
        tokens = torch.full((len(contexts), width), self.token, dtype=torch.long)
        return Proposal(tokens=tokens, counts=list(num_tokens))


def build(family: str, hidden: int, layers: int, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.heads.toy import MATRIX

    heads = max(4, hidden // 64)
    config = dict(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    config |= dict(num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads)
    config |= dict(max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.05)
    extra = dict(MATRIX.get(family, {}))
    extra.pop("layer_types", None)  # the family's own default layout at this depth
    if "linear_num_value_heads" in extra:  # Gated DeltaNet heads sized to the width
        extra |= dict(linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=64)
        extra |= dict(linear_value_head_dim=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **(config | extra)), dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked distributions, as the tests' toys
    return model.to(device).eval()


def per_token(model, drafter, prompts, k: int, new: int, device) -> tuple[float, int]:
    """Seconds per generated token over `prompts` and the drafts accepted."""
    synchronize(device)
    start, accepted = time.perf_counter(), 0
    for prompt in prompts:
        out = generate(model, drafter, prompt, max_new_tokens=new, num_draft_tokens=k)
        accepted += sum(out.stats.accepted)
    synchronize(device)
    return (time.perf_counter() - start) / (new * len(prompts)), accepted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5_text", help="a hybrid family of heads/toy.py MATRIX")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None, help="default: CUDA when available")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    hybrid = build(args.family, args.hidden, args.layers, device, dtype)
    plain = build("llama", args.hidden, args.layers, device, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (n,), generator=gen).to(device) for n in (24, 40, 16)][: args.prompts]
    k, new = args.num_draft_tokens, args.max_new_tokens
    drafter = AlwaysRejected(token=8191)
    rows = {
        "target-only": (hybrid, None, 1),
        f"rejected-{k}": (hybrid, drafter, k),
        "attention target-only": (plain, None, 1),
        f"attention-{k}": (plain, drafter, k),
    }
    for model, d, kk in rows.values():  # warm-up
        per_token(model, d, prompts[:1], kk, 8, device)
    times = {name: [] for name in rows}
    for r in range(args.repeats):
        for name in list(rows)[r % len(rows) :] + list(rows)[: r % len(rows)]:  # rotate the order
            seconds, accepted = per_token(*rows[name][:2], prompts, rows[name][2], new, device)
            if rows[name][1] is not None and accepted:
                raise SystemExit(f"{name}: {accepted} drafts were accepted; pick another --family or token")
            times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    hybrid_ratio = median[f"rejected-{k}"] / median["target-only"]
    plain_ratio = median[f"attention-{k}"] / median["attention target-only"]
    profile = cProfile.Profile()
    profile.enable()
    per_token(hybrid, drafter, prompts, k, new, device)
    profile.disable()
    stats = pstats.Stats(profile)
    total = stats.total_tt
    own = sum(v[2] for (file, _, _), v in stats.stats.items() if file.endswith("decoding/recurrent.py"))
    layers = sum(t == "linear_attention" for t in getattr(hybrid.config, "layer_types", []))
    print(f"{args.family}: hidden {args.hidden}, {args.layers} layers ({layers} recurrent), {dtype}, {device}, K = {k}")
    for name, value in median.items():
        print(f"  {name:<24} {value * 1e3:8.2f} ms per token")
    print(f"  rejected / target-only: {hybrid_ratio:.3f}x (hybrid), {plain_ratio:.3f}x (attention only)")
    print(f"  the rollback beyond feeding K + 1 columns: {hybrid_ratio / plain_ratio:.3f}x")
    print(f"  profile of rejected-{k}: decoding/recurrent.py's own code {own / total:.1%} of {total:.2f} s")
    if args.out:
        figures = {"ms_per_token": {n: v * 1e3 for n, v in median.items()}, "hybrid_ratio": hybrid_ratio}
        figures |= {"attention_ratio": plain_ratio, "recurrent_share": own / total, "args": vars(args)}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
