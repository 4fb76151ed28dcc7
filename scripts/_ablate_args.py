"""What the ablation scripts (scripts/ablate_*.py) parse the same way: one flag per field of their
settings dataclass, and the help of the demo flags they all take."""

from __future__ import annotations

import argparse
from dataclasses import fields

#: The help of the flags every ablation on the demo target takes.
DEMO_HELP = {
    "target": "demo target (smollm2, micro)",
    "prompts": "held-out prompts for the evaluation",
    "cache_dir": "demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
}


def parse_settings(settings_class, doc: str, helps: dict, argv=None, short: dict | None = None):
    """`settings_class` from the command line: a flag per field (--field-name, and `short[name]`
    before it where given), typed as its default when that is a number, with that default and
    `helps[name]`. A ValueError of the class's own checks exits with status 2, as a bad flag does."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for f in fields(settings_class):
        flag = "--" + f.name.replace("_", "-")
        names = [short[f.name], flag] if f.name in (short or {}) else [flag]
        kind = type(f.default) if isinstance(f.default, (int, float)) else None
        parser.add_argument(*names, type=kind, default=f.default, help=helps.get(f.name))
    args = parser.parse_args(argv)
    try:
        return settings_class(**vars(args))
    except ValueError as err:
        parser.error(str(err))
