"""Which divergence trains the best parallel head? A loss ablation on the demo target.

    python scripts/ablate_heads.py                              # the default head, 6 losses x 2 seeds
    python scripts/ablate_heads.py --method NAME --losses soft_ce,lk_hybrid --steps 50
    python scripts/ablate_heads.py --help                       # the NAMEs (--method) it takes

The runs, the evaluation and the table are `draftsmith.demo.ablate_heads`; this parses the flags.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from draftsmith.demo.ablate_heads import HeadAblationSettings, head_recipes, run_head_ablation

HELP = {
    "losses": "comma-separated divergences, one head per loss and seed",
    "seeds": "comma-separated seeds (the spread of each loss)",
    "steps": "training steps per head (the shared budget)",
    "prompts": "held-out prompts for the evaluation",
    "target": "demo target (smollm2, micro)",
    "cache_dir": "demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    methods = ", ".join(head_recipes(HeadAblationSettings.target))
    helps = HELP | {
        "method": f"which head: a shipped recipe of the demo target's family, one of {methods} (default: the first)"
    }
    for f in fields(HeadAblationSettings):
        kind = type(f.default) if isinstance(f.default, (int, float)) else None
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=helps.get(f.name))
    args = parser.parse_args(argv)
    try:
        settings = HeadAblationSettings(**vars(args))
    except ValueError as err:
        parser.error(str(err))
    run_head_ablation(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
