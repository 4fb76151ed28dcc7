"""Build (or reuse) the embedded demo target: a small Llama and an independent small draft
trained here on the Python standard library, with a tokenizer, prompts and a model card.

    python scripts/build_demo_target.py                       # preset cpu, ~15 min on 2 cores
    python scripts/build_demo_target.py --preset gpu          # ~105M target, one GPU, <= 5 min
    python scripts/build_demo_target.py --cache-dir /data/ds --force

The same as `draftsmith build-target`; the code lives in `draftsmith.scripts.demo_target`.
"""

import sys

from draftsmith.scripts.demo_target import _main

if __name__ == "__main__":
    sys.exit(_main())
