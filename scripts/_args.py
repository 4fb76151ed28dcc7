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


def add_device_args(p: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    """--device (CUDA when available) and --dtype (auto: bf16 on CUDA, fp32 on CPU)."""
    p.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    if dtype:
        p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")


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
