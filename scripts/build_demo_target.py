"""Build (or reuse) the embedded demo target: a small Llama and an independent small draft
trained here on the Python standard library, with a tokenizer, prompts and a model card.

    python scripts/build_demo_target.py                       # preset cpu, ~15 min on 2 cores
    python scripts/build_demo_target.py --preset gpu          # ~105M target, one GPU, <= 5 min
    python scripts/build_demo_target.py --cache-dir /data/ds --force

The same as `draftsmith build-target`; the code lives in `draftsmith.train.demo_target`.
"""

import argparse
import sys

from draftsmith.scripts.demo_cli import add_build_target_args, cmd_build_target
from draftsmith.scripts._args import UsageError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="build_demo_target.py", description="Build (or reuse) the demo target and its small draft.")
    add_build_target_args(parser)
    args = parser.parse_args(argv)
    from draftsmith.heads.models import ModelLoadError

    try:
        return cmd_build_target(args)
    except (UsageError, ModelLoadError) as err:
        print(f"draftsmith build-target: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
