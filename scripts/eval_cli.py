"""The measuring commands of `draftsmith`: what a drafter is worth against its target.

    draftsmith eval --target DIR (--drafter KIND[:NAME]=DIR ... | --prompt-lookup) [--tree KIND=SPEC] --prompts FILE --out DIR
    draftsmith tune --target DIR --drafter KIND=DIR --prompts FILE [--k-max 8] [--write]
    draftsmith check-lossless --target DIR (--drafter KIND=DIR | --prompt-lookup) [--temperature 1.0]

KIND is a registered method (heads/registry.py); `--KIND [NAME=]DIR` and `--KIND-tree SPEC` are the
same as `--drafter KIND[:NAME]=DIR` and `--tree KIND=SPEC`.

The jobs themselves are `draftsmith.eval.jobs`; the drafters come from `draftsmith.eval.drafter_specs`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.eval.evaluator import EvalSettings
from draftsmith.heads.registry import METHODS
from draftsmith.scripts._args import (
    UsageError,
    add_count,
    add_device_args,
    add_no_progress,
    add_seconds,
    add_settings_args,
    float_in,
    list_of,
    settings_from_args,
)


def _int_or_none(text, minimum):
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= minimum else None


def _rate_or_none(text):
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 and value != float("inf") else None


BATCH_SIZES = list_of("--batch-sizes", lambda t: _int_or_none(t, 1), "a batch size (an integer >= 1)", "1,2,4,8")
CONCURRENCY = list_of("--concurrency", lambda t: _int_or_none(t, 1), "a number of clients (an integer >= 1)", "1,2,4,8")
QPS = list_of("--qps", _rate_or_none, "an arrival rate (requests per second > 0)", "0.5,1,2,4")
TREE_BUDGETS = list_of(
    "--tree-budgets", lambda t: _int_or_none(t, 1), "a number of tree nodes (an integer >= 1)", "4,8,16,32"
)
PROMPTS_HELP = (
    "prompt source (JSONL/JSON/parquet/CSV file, saved dataset folder or hub name): rows with "
    '"messages", "conversations", MT-bench "turns", "input_ids" or a "prompt" text'
)


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    """How prompts are rendered (distill/prompts.py): the same for eval, tune and check-lossless."""
    p.add_argument(
        "--chat-template",
        default="auto",
        metavar="auto|none|FILE",
        help="renders conversations with the generation prompt: auto (the tokenizer's own), none, or a Jinja file",
    )
    p.add_argument(
        "--plain-prompts",
        choices=["raw", "chat"],
        default="raw",
        help='plain "prompt" rows: raw (the text as it is, default) or chat (one user turn through the chat template, as instruct targets are trained)',
    )


ALLOW_MISMATCH_HELP = (
    "use heads trained on another target (its fingerprint differs): only when --target is a fine-tune of it"
)


def add_drafter_args(p, *, one: bool = False) -> None:
    """`--drafter KIND[:NAME]=DIR` (one, or repeatable) and its per-kind alias `--KIND [NAME=]DIR`."""
    kinds = ", ".join(METHODS)
    group = p.add_mutually_exclusive_group(required=True) if one else p
    group.add_argument(
        "--drafter",
        action=None if one else "append",
        metavar="KIND[:NAME]=DIR",
        help=f"a trained drafter for this target: KIND one of {kinds}; its rows are named NAME, else after "
        "the kind (several of a kind: after their folders)" + ("" if one else "; repeat for several"),
    )
    for m in METHODS.values():
        group.add_argument(
            f"--{m.kind}",
            action=None if one else "append",
            metavar="DIR" if one else "[NAME=]DIR",
            help=f"the same as --drafter {m.kind}" + ("=DIR" if one else "[:NAME]=DIR"),
        )


def drafter_values(args) -> list[str]:
    """The `--drafter` values, with each `--KIND [NAME=]DIR` alias written as one."""
    values = [args.drafter] if isinstance(args.drafter, str) else list(args.drafter or ())
    for kind in METHODS:
        given = getattr(args, kind, None)
        for value in [given] if isinstance(given, str) else given or ():
            name, sep, folder = value.partition("=")
            named = sep and name and folder and not Path(value).expanduser().exists()
            values.append(f"{kind}:{name}={folder}" if named else f"{kind}={value}")
    return values


def tree_values(args) -> list[str]:
    """The `--tree` values, with each `--KIND-tree SPEC` alias written as one."""
    values = list(args.tree or ())
    for m in METHODS.values():
        spec = getattr(args, f"{m.kind}_tree", None) if m.tree_spec else None
        if spec is not None:
            values.append(f"{m.kind}={spec}")
    return values


def add_tree_args(p) -> None:
    """`--tree KIND=SPEC` (repeatable), `--tree-nodes` and the per-kind alias `--KIND-tree SPEC`."""
    from draftsmith.eval.drafter_specs import DrafterSpecs as D  # the defaults live there

    p.add_argument(
        "--tree",
        action="append",
        metavar="KIND=SPEC",
        help="also decode KIND's drafters as a tree: "
        + "; ".join(f"{m.kind}={m.tree_spec}" for m in METHODS.values() if m.tree_spec),
    )
    add_count(p, "--tree-nodes", default=D.tree_nodes, help="node budget of an auto tree")
    for m in METHODS.values():
        if m.tree_spec:
            p.add_argument(f"--{m.kind}-tree", metavar="SPEC", help=f"the same as --tree {m.kind}=SPEC")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from draftsmith.eval.drafter_specs import DrafterSpecs as D  # the defaults live there

    p.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    add_drafter_args(p)
    p.add_argument("--prompt-lookup", action="store_true", help="use prompt lookup (n-gram) drafting")
    add_count(p, "--max-ngram", default=D.max_ngram, help="prompt lookup: longest n-gram to match")
    add_tree_args(p)
    p.add_argument(
        "--lossy",
        choices=["typical"],
        help="typical acceptance (LOSSY: output differs from the target's; reported as such), for the kinds "
        f"that take it: {', '.join(m.kind for m in METHODS.values() if m.typical)}",
    )
    p.add_argument(
        "--typical-epsilon",
        type=float,
        default=D.typical_epsilon,
        help="typical acceptance: posterior threshold epsilon",
    )
    p.add_argument(
        "--typical-delta", type=float, default=D.typical_delta, help="typical acceptance: entropy factor delta"
    )
    p.add_argument("--allow-target-mismatch", action="store_true", help=ALLOW_MISMATCH_HELP)
    add_device_args(p)
    add_no_progress(p)


def add_commands(sub) -> None:
    ev = sub.add_parser("eval", help="acceptance, speedup and KL of drafters against target-only decoding")
    _add_model_args(ev)
    ev.add_argument("--prompts", required=True, help=PROMPTS_HELP)
    add_count(ev, "--limit", help="use only the first N prompts")
    ev.add_argument(
        "--task-key",
        help='field of a prompt row that names its task, for per-task tables (default "task", else "category")',
    )
    _add_prompt_args(ev)
    add_settings_args(ev.add_argument_group("decoding (eval.evaluator.EvalSettings)"), EvalSettings)
    ev.add_argument(
        "--out", required=True, help="folder for report.json and report.md (and serving.* with --batch-sizes)"
    )
    ev.add_argument(
        "--overwrite", action="store_true", help="replace the report of an earlier run in --out (else refused)"
    )
    sv = ev.add_argument_group("serving scale (serving.json, serving.md, serving.html and figures)")
    sv.add_argument(
        "--batch-sizes", type=BATCH_SIZES, help="also measure batched decoding at these batch sizes, e.g. 1,2,4,8,16,32"
    )
    sv.add_argument(
        "--qps", type=QPS, help="simulate Poisson arrivals at these rates (requests/s) on the largest batch size"
    )
    add_seconds(
        sv, "--latency-target", help="find the highest load whose request latency percentile stays within SECONDS"
    )
    sv.add_argument(
        "--percentile",
        type=float_in("--percentile", 0.0, 100.0, True, "in (0, 100]"),
        default=90.0,
        help="the latency percentile of --latency-target (default 90)",
    )
    sv.add_argument(
        "--price-per-hour",
        type=float_in("--price-per-hour", 0.0, None, False, ">= 0 dollars per hour"),
        help="price of the engine per hour: cost per 1k tokens and per answer",
    )
    en = ev.add_argument_group(
        "serving engine (engine.json, engine.md, engine.html): load test of a running OpenAI-compatible server"
    )
    en.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="drive this server (repeat to spread the load) instead of, or with a drafter flag beside, the local decoder",
    )
    en.add_argument("--concurrency", type=CONCURRENCY, help="closed-loop clients per level (default 1,2,4,8)")
    add_count(en, "--requests", default=32, help="answers per level, at least its concurrency (default 32)")
    add_seconds(en, "--level-seconds", default=120.0, help="no new request after this long in a level (default 120)")
    en.add_argument("--served-model", help="the model id to request (default: the one the server lists)")
    en.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the server's API key (sent as a Bearer token, never written)",
    )
    add_seconds(en, "--request-timeout", default=600.0, help="seconds per request (default 600)")
    en.add_argument(
        "--compare-serving",
        metavar="SERVING_JSON",
        help="the serving.json of a `--batch-sizes` sweep of the same target: its methods simulated at the same concurrency levels",
    )
    ev.set_defaults(func=cmd_eval)

    sized = ", ".join(m.title for m in METHODS.values() if m.sized_trees)  # those whose trees tune sizes
    decoded = [m for m in METHODS.values() if m.tune_trees]  # those whose trees tune decodes one by one
    tu = sub.add_parser(
        "tune",
        help=f"choose K ({sized}: also the tree size; {', '.join(m.title for m in decoded)}: also the tree) from "
        "measured acceptance and costs; --write records it",
    )
    tu.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    add_drafter_args(tu, one=True)
    tu.add_argument("--prompts", required=True, help=PROMPTS_HELP)
    add_count(tu, "--limit", help="use only the first N prompts")
    _add_prompt_args(tu)
    add_count(
        tu,
        "--k-max",
        default=8,
        help="measure acceptance at this K and search K = 0..k-max (at most what the drafter proposes, when it bounds it)",
    )
    tu.add_argument("--tree-budgets", type=TREE_BUDGETS, help=f"{sized}: tree sizes (nodes) to try (default 4,8,16,32)")
    tu.add_argument(
        "--trees",
        nargs="+",
        metavar="SPEC",
        help="the trees to decode and choose among: "
        + "; ".join(f"{m.title}: {m.tree_spec} (default {' '.join(m.tune_trees)})" for m in decoded),
    )
    tuned = ("max_new_tokens", "temperature", "top_k", "top_p", "repeats", "seed", "ignore_eos")
    add_settings_args(tu.add_argument_group("decoding (eval.evaluator.EvalSettings)"), EvalSettings, only=tuned)
    tu.add_argument("--allow-target-mismatch", action="store_true", help=ALLOW_MISMATCH_HELP)
    tu.add_argument(
        "--write", action="store_true", help="record the chosen setting in the drafter folder's config.json"
    )
    tu.add_argument("--out", help="folder for tuning.json and the speedup-vs-setting figures")
    add_device_args(tu)
    add_no_progress(tu)
    tu.set_defaults(func=cmd_tune)

    ck = sub.add_parser("check-lossless", help="chi-square test that speculative sampling matches the target")
    _add_model_args(ck)
    checked = ("num_draft_tokens", "top_k", "top_p", "seed", "static_cache", "compile")
    add_settings_args(ck.add_argument_group("decoding (eval.evaluator.EvalSettings)"), EvalSettings, only=checked)
    ck.add_argument(
        "--temperature", type=float_in("--temperature", 0.0, None, True, "> 0 (the check needs sampling)"), default=1.0
    )
    ck.add_argument("--prompt", default="def main():\n    ", help="text prompt (tokenized with the target's tokenizer)")
    ck.add_argument("--prompts", help="instead of --prompt: a prompt source (as for eval) whose first row is checked")
    _add_prompt_args(ck)
    ck.add_argument("--samples", type=int, default=2000, help="decodes (>= 100; more = more power)")
    ck.add_argument("--threshold", type=float, default=1e-3, help="fail when a p-value is below this (in (0, 1))")
    add_count(
        ck,
        "--batch-size",
        default=1,
        help="decode B copies of the prompt per call (the batched path; every row is one sample)",
    )
    ck.set_defaults(func=cmd_check_lossless)


def _specs(args):
    from draftsmith.eval.drafter_specs import DrafterSpecs

    return DrafterSpecs(
        target=args.target,
        drafters=tuple(drafter_values(args)),
        prompt_lookup=args.prompt_lookup,
        max_ngram=args.max_ngram,
        trees=tuple(tree_values(args)),
        tree_nodes=args.tree_nodes,
        lossy=args.lossy,
        typical_epsilon=args.typical_epsilon,
        typical_delta=args.typical_delta,
        allow_target_mismatch=args.allow_target_mismatch,
        device=args.device,
        dtype=args.dtype,
    )


def _sweep_settings(args):
    """The serving-scale settings of `eval`, or None without --batch-sizes."""
    from draftsmith.eval.sweep import SweepSettings

    if args.batch_sizes is None:
        given = _given(args, "--qps", "--latency-target", "--price-per-hour")
        if given:
            raise UsageError(
                f"{', '.join(given)} need --batch-sizes: the serving analysis runs on step costs measured per batch size (e.g. --batch-sizes 1,2,4,8)"
            )
        return None
    try:
        return SweepSettings(
            batch_sizes=tuple(args.batch_sizes),
            qps=tuple(args.qps or ()),
            latency_target_s=args.latency_target,
            percentile=args.percentile,
            price_per_hour=args.price_per_hour,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def _eval_settings(args, num_draft_tokens: int, **options):
    return settings_from_args(EvalSettings, args, num_draft_tokens=num_draft_tokens, **options)


ENGINE_FLAGS = ("--concurrency", "--served-model", "--api-key-env", "--compare-serving")


def _given(args, *flags: str) -> list[str]:
    """The `flags` (`--x-y`, read as `args.x_y`) given on the command line (not None)."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]


def _eval_job(args, settings, **more):
    """The local evaluation of `eval`: the drafter flags' specs, `settings`, the prompt and output flags."""
    from draftsmith.eval.jobs import EvalJob

    prompts = {"prompts": args.prompts, "limit": args.limit, "task_key": args.task_key}
    output = {"out": args.out, "progress": not args.no_progress, "overwrite": args.overwrite}
    return EvalJob(_specs(args), settings, **prompts, **output, **more)


def cmd_eval(args) -> int:
    from draftsmith.eval.drafter_specs import SpecError
    from draftsmith.eval.jobs import run_eval

    if args.endpoint:
        return _cmd_engine(args)
    given = _given(args, *ENGINE_FLAGS)
    if given:
        raise UsageError(f"{', '.join(given)} apply to a served model: give --endpoint URL")
    settings = _eval_settings(
        args, args.num_draft_tokens, static_cache=args.static_cache or bool(args.compile), compile=args.compile or False
    )
    prompt_format = {"chat_template": args.chat_template, "plain_prompts": args.plain_prompts}
    job = _eval_job(args, settings, **prompt_format, sweep=_sweep_settings(args))
    try:
        run_eval(job)
    except SpecError as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_tune(args) -> int:
    from draftsmith.eval.drafter_specs import SpecError
    from draftsmith.eval.jobs import TuneJob, run_tune

    settings = _eval_settings(args, args.k_max, measure_distances=False)
    budgets = tuple(args.tree_budgets) if args.tree_budgets else None
    trees = tuple(args.trees) if args.trees else None
    given = {
        "drafter": drafter_values(args)[0],
        "tree_budgets": budgets,
        "trees": trees,
        "progress": not args.no_progress,
    }
    job = settings_from_args(TuneJob, args, settings=settings, **given)  # the other fields: their flags
    try:
        result = run_tune(job)
    except SpecError as err:
        raise UsageError(str(err)) from None
    if args.write and result["recorded"] is None:
        print(
            f"draftsmith tune: --write: nothing recorded in {result['folder']}/config.json: no K beats target-only decoding",
            file=sys.stderr,
        )
        return 1
    if result["recorded"] is not None:
        from draftsmith.publish.serve import serving_commands

        print(serving_commands(result["folder"], target=args.target).text())  # what serves the recorded setting
    return 0


def cmd_check_lossless(args) -> int:
    from draftsmith.eval.drafter_specs import SpecError
    from draftsmith.eval.jobs import LosslessJob, run_check_lossless

    given = {"specs": _specs(args), "progress": not args.no_progress, "compile": args.compile or False}
    job = settings_from_args(LosslessJob, args, **given)  # the other fields: their flags
    try:
        passed = run_check_lossless(job)
    except SpecError as err:
        raise UsageError(str(err)) from None
    return 0 if passed else 1


def _cmd_engine(args) -> int:
    """`eval --endpoint`: the load test, with the local evaluation of a drafter flag's head beside it."""
    from draftsmith.distill.endpoint import EndpointError, EndpointSettings
    from draftsmith.eval.drafter_specs import SpecError
    from draftsmith.eval.serving.engine import LEVELS, EngineJob, LoadSettings, run_engine
    from draftsmith.eval.serving.prometheus import ExpositionError

    local_only = _given(args, "--batch-sizes", "--qps", "--price-per-hour")
    if local_only:
        raise UsageError(
            f"{', '.join(local_only)} measure the local decoder, not --endpoint: run that sweep as its "
            "own `draftsmith eval` and pass its serving.json with --compare-serving"
        )
    levels = tuple(args.concurrency or LEVELS)
    try:
        load = settings_from_args(LoadSettings, args, concurrency=levels, latency_target_s=args.latency_target)
        endpoint = EndpointSettings(
            urls=tuple(args.endpoint),
            served_model=args.served_model,
            api_key_env=args.api_key_env,
            concurrency=max(levels),
            timeout=args.request_timeout,
            retries=0,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    local = None
    if drafter_values(args) or args.prompt_lookup:
        settings = _eval_settings(args, args.num_draft_tokens)
        local = _eval_job(args, settings)
    given = {"endpoint": endpoint, "load": load, "local": local, "progress": not args.no_progress}
    job = settings_from_args(EngineJob, args, **given)  # the other fields: their flags
    try:
        run_engine(job)
    except (EndpointError, SpecError, ExpositionError) as err:
        raise UsageError(str(err)) from None
    return 0
