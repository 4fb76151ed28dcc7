"""The commands of `draftsmith` that bring their own models: the demo and a toy pair.

    draftsmith demo [--quick] [--budget default|long] [--out DIR] [--target smollm2|micro] [--cache-dir DIR] [--remeasure]
    draftsmith make-toy --out DIR [--family llama]

The work is `draftsmith.demo.run`, `draftsmith.demo.target` and `draftsmith.heads.toy`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from draftsmith.scripts._args import UsageError, add_count, add_device_args, add_no_progress, float_in, positive_int


def add_commands(sub) -> None:
    toy = sub.add_parser(
        "make-toy", help="write a toy target/draft pair (random weights) and prompts, for trying the tools"
    )
    toy.add_argument("--out", required=True, help="folder to create (target/, draft/, prompts.jsonl)")
    toy.add_argument(
        "--family",
        default="llama",
        help="llama (default), qwen2, mistral, gpt_neox, or any transformers family of heads/toy.py MATRIX, e.g. qwen3_5_text",
    )
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--force", action="store_true", help="replace an existing folder")
    toy.set_defaults(func=cmd_make_toy)

    demo = sub.add_parser(
        "demo", help="a real target (SmolLM2-135M-Instruct), every drafter method trained on it and ranked"
    )
    demo.add_argument(
        "--quick", action="store_true", help="a smoke run in about a minute (micro target, few short decodes)"
    )
    demo.add_argument("--budget", help="training budget: default, or long (each head trained longer: a learning curve)")
    demo.add_argument("--out", help="output folder (default runs/demo-<target>)")
    demo.add_argument("--target", help="demo target: smollm2 (default), micro (default with --quick)")
    demo.add_argument(
        "--cache-dir",
        help="where demo targets and heads are cached (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
    )
    demo.add_argument(
        "--rebuild", action="store_true", help="rebuild the demo target even when a valid cached one exists"
    )
    demo.add_argument(
        "--remeasure", action="store_true", help="evaluate again even if --out has a report measured from these inputs"
    )
    add_count(demo, "--prompts", help="number of held-out prompts")
    demo.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"))
    demo.add_argument("--num-draft-tokens", "-k", type=positive_int("--num-draft-tokens (K)"))
    add_count(demo, "--repeats", help="timed passes (median reported)")
    demo.add_argument("--temperature", type=float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"))
    demo.add_argument(
        "--sampled-temperature",
        type=float_in("--sampled-temperature", 0.0, None, False, ">= 0 (0 = no second table)"),
        help="a second pass and table at this temperature (default 1; 0 = none)",
    )
    demo.add_argument(
        "--no-tune", action="store_true", help="skip the table of each chain drafter at the K `tune` picks"
    )
    demo.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=["default", "max-autotune"],
        help="decode over a static KV cache with torch.compile'd steps (compile time reported apart)",
    )
    add_device_args(demo, auto="bf16 where native: cuda, CPUs with AVX512-BF16 or AMX; else fp32")
    add_no_progress(demo)
    demo.set_defaults(func=cmd_demo)


def cmd_make_toy(args) -> int:
    from draftsmith.heads.toy import TOY_FAMILIES, make_toy

    if args.family not in TOY_FAMILIES:
        raise UsageError(f"--family {args.family!r}: expected one of {', '.join(TOY_FAMILIES)}")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise UsageError(f"--out {str(out)!r} already exists (pass --force to replace it)")
    make_toy(out, family=args.family, seed=args.seed)
    print(f"wrote a toy {args.family} target/draft pair (random weights) and prompts to {out}/")
    print(
        f"next: draftsmith eval --target {out}/target --draft {out}/draft --prompt-lookup --prompts {out}/prompts.jsonl --out {out}/eval"
    )
    return 0


def cmd_demo(args) -> int:
    from draftsmith.demo.run import QUICK, DemoSettings, run_demo, with_overrides

    try:
        settings = with_overrides(
            QUICK if args.quick else DemoSettings(),
            target=args.target,
            budget=args.budget,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=args.num_draft_tokens,
            repeats=args.repeats,
            temperature=args.temperature,
            compile=args.compile,
        )
        if args.sampled_temperature is not None:
            settings = replace(settings, sampled_temperature=args.sampled_temperature or None)
        if args.no_tune:
            settings = replace(settings, tune=False)
    except ValueError as err:
        raise UsageError(str(err)) from None
    options = {"cache_dir": args.cache_dir, "device": args.device, "progress": not args.no_progress}
    return _building(
        "demo",
        "nothing half-built was cached (an unfinished target build is removed)",
        lambda: run_demo(
            settings, out=args.out, dtype=args.dtype, force_build=args.rebuild, remeasure=args.remeasure, **options
        ),
    )


def _building(command: str, on_interrupt: str, job) -> int:
    """Run a job that may build the demo target: its errors are usage errors, and Ctrl-C says
    what was left behind (exit status 130)."""
    from draftsmith.demo.target import DemoTargetError

    try:
        job()
    except DemoTargetError as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        print(f"draftsmith {command}: interrupted; {on_interrupt}", file=sys.stderr)
        return 130
    return 0
