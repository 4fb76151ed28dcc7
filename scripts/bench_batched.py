"""Batched decoding on its three paths, side by side: the default dynamic ragged cache, the
static ragged cache, and the static cache with compiled steps (`generate_batch(...,
static_cache=, compile=)`), for target-only decoding and each drafter given, at one batch size:
every `--drafter KIND[:NAME]=DIR` (its chain, and its tree with `--tree KIND=SPEC` where the
method decodes trees) and prompt lookup (built by `eval.drafter_specs`, as `draftsmith eval`
builds them; the kinds and tree specs: --help).

    D=~/.cache/draftsmith
    python scripts/bench_batched.py --target $D/demo-target-cpu/target \
        --drafter draft=$D/demo-heads-cpu/distilled-draft/draft --drafter KIND=$D/demo-heads-cpu/RECIPE/head \
        --tree KIND=SPEC --prompt-lookup --prompt-file $D/demo-target-cpu/prompts/heldout.jsonl --batch-size 4

Greedy, no eos (every row emits exactly --max-new-tokens), one warm-up per configuration
(compilation happens there and is reported apart), then --repeats rounds in which every
configuration runs once, interleaved, so that load from other work hits all of them alike.
Each cell: the median over rounds of tokens/s, and its ratio to the default path of the same
method. Rows must decode the same tokens on every path; a mismatch is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from draftsmith.decoding import generate_batch
from draftsmith.distill.chat import resolve_chat_template
from draftsmith.eval.drafter_specs import DrafterSpecs, SpecError, load_drafters
from draftsmith.eval.evaluator import load_prompts
from draftsmith.scripts.eval_cli import add_drafter_args, add_tree_args, drafter_values, tree_values

PATHS = {"default": {}, "static": {"static_cache": True}, "compiled": {"compile": True}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target model folder")
    add_drafter_args(parser)
    parser.add_argument("--prompt-lookup", action="store_true", help="add prompt lookup")
    add_tree_args(parser)
    parser.add_argument("--prompt-file", required=True, help='prompts: JSON lines with "prompt" (text) or "input_ids"')
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: comparable across runs on a shared machine)"
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"comma-separated, from {', '.join(PATHS)} (default: all; default is always run)",
    )
    args = parser.parse_args(argv)
    paths = ["default"] + [p for p in dict.fromkeys(args.paths.split(",")) if p and p != "default"]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; expected some of {', '.join(PATHS)}")
    if args.batch_size < 1 or args.max_new_tokens < 1 or args.num_draft_tokens < 1 or args.repeats < 1:
        parser.error("--batch-size, --max-new-tokens, -k and --repeats must be >= 1")
    torch.set_num_threads(args.threads)

    if not (drafter_values(args) or args.prompt_lookup):
        parser.error("give a drafter: --drafter KIND[:NAME]=DIR (repeatable) and/or --prompt-lookup")
    specs = DrafterSpecs(
        target=args.target,
        drafters=tuple(drafter_values(args)),
        prompt_lookup=args.prompt_lookup,
        trees=tuple(tree_values(args)),
        tree_nodes=args.tree_nodes,
        device=args.device or "auto",
        dtype=args.dtype,
    )
    try:
        target, tokenizer, drafters, device, dtype = load_drafters(specs)
    except SpecError as err:
        parser.error(str(err))
    template = resolve_chat_template(
        "auto", tokenizer
    )  # conversations through the chat template; plain rows as they are
    prompts = load_prompts(args.prompt_file, tokenizer, limit=args.batch_size, template=template)
    if len(prompts) < args.batch_size:
        parser.error(
            f"--prompt-file {args.prompt_file} holds {len(prompts)} prompts, fewer than --batch-size {args.batch_size}"
        )
    methods = {"target-only": (lambda: None, 0)}
    for name, drafter in drafters.items():  # K: -k for chains, a tree's own depth
        depth = getattr(drafter, "max_depth", None) if getattr(drafter, "tree", None) is not None else None
        methods[name] = (lambda drafter=drafter: drafter, depth or args.num_draft_tokens)

    def run(method: str, path: str):
        make, k = methods[method]
        return generate_batch(
            target, prompts, make(), num_draft_tokens=k, max_new_tokens=args.max_new_tokens, **PATHS[path]
        )

    tokens, compile_seconds, tau = {}, {}, {}
    for method in methods:
        for path in paths:
            warm = run(method, path)
            tokens[method, path], compile_seconds[method, path], tau[method] = (
                warm.tokens,
                warm.compile_seconds,
                warm.stats.tau,
            )
            print(f"warm-up {method} / {path}: compile {warm.compile_seconds:.1f} s", file=sys.stderr, flush=True)
    speed = {key: [] for key in tokens}
    for _ in range(args.repeats):
        for key in speed:
            result = run(*key)
            speed[key].append(result.new_tokens / result.total_seconds)

    print(
        f"batch {args.batch_size}, K = {args.num_draft_tokens}, {args.max_new_tokens} new tokens per row, greedy, "
        f"{device.type} {str(dtype).removeprefix('torch.')}, median of {args.repeats}; tau counts the bonus token\n"
    )
    others = paths[1:]
    print(
        "| method | tau | "
        + " | ".join(f"{p} tok/s" for p in paths)
        + "".join(f" | {p} / default" for p in others)
        + (" | compile s" if "compiled" in paths else "")
        + " | same tokens |"
    )
    print("|---|---:|" + "---:|" * (len(paths) + len(others) + ("compiled" in paths)) + "---|")
    mismatches = 0
    for method in methods:
        median = {p: statistics.median(speed[method, p]) for p in paths}
        same = all(tokens[method, p] == tokens[method, "default"] for p in paths)
        mismatches += not same
        print(
            f"| {method} | {tau[method]:.2f} | "
            + " | ".join(f"{median[p]:.0f}" for p in paths)
            + "".join(f" | {median[p] / median['default']:.2f}x" for p in others)
            + (f" | {compile_seconds[method, 'compiled']:.0f}" if "compiled" in paths else "")
            + f" | {'yes' if same else 'NO'} |"
        )
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
