"""What every command group of `draftsmith` parses the same way: checked numbers, lists, and
the --device/--dtype/--no-progress flags. A bad value names the flag, the value and what was
expected (argparse prints it and exits with status 2)."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """Bad command-line input: `draftsmith` prints it on one line and exits with status 2."""


def int_at_least(name, minimum, note=""):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}{note}, got {value}")
        return value

    return parse


def positive_int(name):
    return int_at_least(name, 1)


def float_in(name, low, high, low_open, what):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {value:g}")
        return value

    return parse


def list_of(name: str, parse_one, what: str, example: str):
    """A comma-separated list flag; a bad item names the flag, the item and what was expected."""

    def parse(text):
        items = [t.strip() for t in str(text).split(",")]
        values = []
        for item in items:
            value = parse_one(item)
            if value is None:
                raise argparse.ArgumentTypeError(f"{name} {text!r}: {item!r} is not {what}; expected e.g. {example}")
            values.append(value)
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{name} {text!r} repeats a value; give each once, e.g. {example}")
        return sorted(values)

    return parse


def add_count(p, flag: str, default: int | None = None, help: str | None = None) -> None:
    """A whole-number flag >= 1 whose error names it (`positive_int`)."""
    p.add_argument(flag, type=positive_int(flag), default=default, help=help)


def add_whole(p, flag: str, default: int | None = None, help: str | None = None, note: str = "") -> None:
    """A whole-number flag >= 0 whose error names it (`int_at_least`; `note` follows the bound)."""
    p.add_argument(flag, type=int_at_least(flag, 0, note), default=default, help=help)


def add_seconds(p, flag: str, default: float | None = None, help: str | None = None) -> None:
    """A duration flag, seconds > 0, whose error names it (`float_in`)."""
    p.add_argument(flag, type=float_in(flag, 0.0, None, True, "> 0 seconds"), default=default, help=help)


def add_device_args(p: argparse.ArgumentParser, *, dtype: bool = True, auto: str = "bf16 on cuda, fp32 on cpu") -> None:
    """--device (CUDA when available) and --dtype (auto: bf16 on CUDA, fp32 on CPU, or as `auto` says)."""
    p.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    if dtype:
        p.add_argument("--dtype", default="auto", help=f"auto ({auto}), float32, bfloat16, float16")


def add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_sampling_args(p: argparse.ArgumentParser, *, temperature: bool = True) -> None:
    """--temperature (0 = greedy), --top-k and --top-p."""
    if temperature:
        p.add_argument(
            "--temperature", type=float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"), default=0.0
        )
    p.add_argument(
        "--top-k",
        type=int_at_least("--top-k", 0, " (0 = off)"),
        default=0,
        help="keep the k most likely tokens (0 = off)",
    )
    p.add_argument(
        "--top-p",
        type=float_in("--top-p", 0.0, 1.0, True, "in (0, 1]"),
        default=1.0,
        help="nucleus sampling mass (1 = off)",
    )


def _flag_type(flag: str, kind: str, meta: dict):
    """The argparse type of a settings field: its number kind, checked against its bounds."""
    if meta["above"] is not None or meta["at_most"] is not None:
        low = meta["above"] if meta["above"] is not None else meta["at_least"]
        what = f"in ({low:g}, {meta['at_most']:g}]" if meta["at_most"] is not None else f"> {low:g}"
        return float_in(flag, low, meta["at_most"], meta["above"] is not None, what)
    if meta["at_least"] is not None:
        if kind == "int":
            return int_at_least(flag, meta["at_least"])
        return float_in(flag, meta["at_least"], None, False, f">= {meta['at_least']:g}")
    return {"int": int, "float": float}.get(kind, str)


def add_settings_args(p, settings_class, *, only=None, defaults=None) -> None:
    """One flag per field of a typed settings class (`eval.evaluator.setting` fields): --field-name
    (or the field's own flag), its help, type and bounds from the field, its default from the
    class (or `defaults`). `only`: these fields, in this order."""
    from dataclasses import MISSING, fields

    by_name = {f.name: f for f in fields(settings_class)}
    for name in only or by_name:
        f, meta = by_name[name], by_name[name].metadata
        default = (defaults or {}).get(name, f.default if f.default is not MISSING else None)
        flag = meta.get("flag") or "--" + name.replace("_", "-")
        names = [flag, meta["short"]] if meta.get("short") else [flag]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        if meta.get("choices"):  # an optional mode: the flag alone takes the first choice
            p.add_argument(
                *names,
                dest=name,
                nargs="?",
                const=meta["choices"][0],
                choices=meta["choices"],
                default=default,
                help=meta["help"],
            )
        elif kind == "bool":
            action = "store_false" if default else "store_true"
            p.add_argument(*names, dest=name, action=action, default=default, help=meta["help"])
        else:
            kind = kind.split("|")[0].strip()
            p.add_argument(*names, dest=name, type=_flag_type(flag, kind, meta), default=default, help=meta["help"])


def settings_from_args(settings_class, args, **values):
    """`settings_class` from the parsed flags of its fields (those the command has) and `values`;
    its own checks' ValueError becomes a UsageError."""
    from dataclasses import fields

    given = {f.name: getattr(args, f.name) for f in fields(settings_class) if hasattr(args, f.name)}
    try:
        return settings_class(**{**given, **values})
    except ValueError as err:
        raise UsageError(str(err)) from None


# ---------------------------------------------------------------------- the ablation scripts
#: The help of the flags every ablation on the demo target takes (scripts/ablate_*.py).
ABLATION_HELP = {
    "target": "demo target (smollm2, micro)",
    "prompts": "held-out prompts for the evaluation",
    "cache_dir": "demo cache (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)",
}


def parse_settings(settings_class, doc: str, helps: dict, argv=None, short: dict | None = None):
    """`settings_class` from a script's own command line: a flag per field (--field-name, and
    `short[name]` before it where given), typed as its default when that is a number, with that
    default and `helps[name]`. A ValueError of the class's own checks exits with status 2, as a bad
    flag does."""
    from dataclasses import fields

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
