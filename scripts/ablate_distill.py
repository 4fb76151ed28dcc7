"""Which divergence and which data make the best draft? An ablation on the demo target.

    python scripts/ablate_distill.py                     # cpu demo target, ~25 min on 2 cores
    python scripts/ablate_distill.py --steps 50 --prompts 6 --out runs/ablate-quick

The runs, the evaluation and the table are `draftsmith.demo.ablate`; this parses the flags.
"""

from __future__ import annotations

import sys

from draftsmith.demo.ablate import AblationSettings, run_ablation
from draftsmith.scripts._args import ABLATION_HELP, parse_settings

HELP = ABLATION_HELP | {
    "steps": "training steps per run (the shared budget)",
    "only": "comma-separated run names to train (e.g. ce/fixed,tv/generated); default all",
}


def main(argv=None) -> int:
    run_ablation(parse_settings(AblationSettings, __doc__, HELP, argv, short={"num_draft_tokens": "-k"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
