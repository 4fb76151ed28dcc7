"""Which divergence trains the best parallel head? A loss ablation on the demo target.

    python scripts/ablate_heads.py                              # the default head, 6 losses x 2 seeds
    python scripts/ablate_heads.py --method NAME --losses soft_ce,lk_hybrid --steps 50
    python scripts/ablate_heads.py --help                       # the NAMEs (--method) it takes

The runs, the evaluation and the table are `draftsmith.demo.ablate_heads`; this parses the flags.
"""

from __future__ import annotations

import sys

from draftsmith.demo.ablate_heads import HeadAblationSettings, head_recipes, run_head_ablation
from draftsmith.scripts._args import ABLATION_HELP, parse_settings

HELP = ABLATION_HELP | {
    "losses": "comma-separated divergences, one head per loss and seed",
    "seeds": "comma-separated seeds (the spread of each loss)",
    "steps": "training steps per head (the shared budget)",
}


def main(argv=None) -> int:
    methods = ", ".join(head_recipes(HeadAblationSettings.target))
    helps = HELP | {
        "method": f"which head: a shipped recipe of the demo target's family, one of {methods} (default: the first)"
    }
    run_head_ablation(parse_settings(HeadAblationSettings, __doc__, helps, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
