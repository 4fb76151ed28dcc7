"""Which divergence and which data make the best draft? An ablation on the demo target.

    python scripts/ablate_distill.py                     # cpu demo target, ~25 min on 2 cores
    python scripts/ablate_distill.py --steps 50 --prompts 6 --out runs/ablate-quick

The runs, the evaluation and the table are `draftsmith.demo.ablate`; this parses the flags.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from draftsmith.demo.ablate import AblationSettings, run_ablation

HELP = {
    "target": "demo target (smollm2, micro)",
    "steps": "training steps per run (the shared budget)",
    "prompts": "held-out prompts for the evaluation",
    "cache_dir": "demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
    "only": "comma-separated run names to train (e.g. ce/fixed,tv/generated); default all",
}


def main(argv=None) -> int:
    defaults = {f.name: f.default for f in fields(AblationSettings)}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in defaults.items():
        flags = ["-k", "--num-draft-tokens"] if name == "num_draft_tokens" else ["--" + name.replace("_", "-")]
        kind = type(default) if isinstance(default, (int, float)) else None
        parser.add_argument(*flags, type=kind, default=default, help=HELP.get(name))
    args = parser.parse_args(argv)
    try:
        settings = AblationSettings(**vars(args))
    except ValueError as err:
        parser.error(str(err))
    run_ablation(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
