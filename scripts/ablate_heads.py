"""Which divergence trains the best parallel head? A loss ablation on the demo target.

    python scripts/ablate_heads.py                              # DFlash, 6 losses x 2 seeds
    python scripts/ablate_heads.py --method eagle3 --losses soft_ce,lk_hybrid --steps 50

The runs, the evaluation and the table are `draftsmith.demo.ablate_heads`; this parses the flags.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from draftsmith.demo.ablate_heads import HeadAblationSettings, run_head_ablation

HELP = {
    "method": "which head: dflash, eagle3 or peagle",
    "losses": "comma-separated divergences, one head per loss and seed",
    "seeds": "comma-separated seeds (the spread of each loss)",
    "steps": "training steps per head (the shared budget)",
    "prompts": "held-out prompts for the evaluation",
    "target": "demo target (smollm2, micro)",
    "cache_dir": "demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(HeadAblationSettings):
        kind = type(f.default) if isinstance(f.default, (int, float)) else None
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=HELP.get(f.name))
    args = parser.parse_args(argv)
    try:
        settings = HeadAblationSettings(**vars(args))
    except ValueError as err:
        parser.error(str(err))
    run_head_ablation(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
