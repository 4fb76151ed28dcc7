"""Greedy data through a serving engine against local generation, in one run.

    draftsmith make-toy --out runs/toy
    python -m draftsmith.scripts.endpoint_check --target runs/toy/target --prompts runs/toy/prompts.jsonl \
        --out runs/endpoint-check --limit 64 --max-new-tokens 64 --batch-size 16 --concurrency 8 --device cpu

Starts `transformers serve` on the target (or uses --endpoint URL ...), makes the data both ways
and prints the share of token-identical samples, why the others differ, and both throughputs;
the report is OUT/report.json. The library call is `draftsmith.distill.endpoint_check.check_endpoint`.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.scripts._args import add_count, add_device_args, positive_int, settings_from_args


def main(argv=None) -> int:
    from draftsmith.distill.endpoint_check import EndpointCheckJob, check_endpoint, describe_check

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True, help="a new folder: local/, endpoint/, report.json")
    p.add_argument("--limit", type=positive_int("--limit"), default=64)
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64)
    add_count(p, "--batch-size", default=16, help="local generation")
    add_count(p, "--concurrency", default=8, help="requests in flight")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL",
        help="a running server (default: start transformers serve)",
    )
    p.add_argument(
        "--continuous-batching", action="store_true", help="start transformers serve with --continuous-batching"
    )
    p.add_argument("--chat-template", default="auto")
    add_device_args(p)
    a = p.parse_args(argv)
    job = settings_from_args(EndpointCheckJob, a, endpoints=tuple(a.endpoint))  # each other field: its flag
    print(describe_check(check_endpoint(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
