"""The data commands of `draftsmith`: what comes from the target.

    draftsmith generate --target DIR --prompts SRC --out DIR [--max-new-tokens N] [--temperature T]
                        [--top-p P] [--num-samples N] [--batch-size B] [--chat-template auto|none|FILE]
                        [--endpoint URL ... [--api-key-env VAR] [--concurrency 8]]   (a serving engine answers)
    accelerate launch --multi_gpu --num_processes N -m draftsmith.scripts.cli generate ...   (the shards split)
    draftsmith inspect-data DIR [--index I]
    draftsmith verify-data DIR
    draftsmith vocab-map --data DIR --draft-vocab-size N [--out FILE]
    draftsmith cache-hidden --target DIR --data DIR --layers 2,mid,-3 --dtype bf16 --out DIR [--max-disk 50GB]
    draftsmith make-prompts --out DIR [--train 1024] [--heldout 128] [--seed 0]

The jobs themselves are `draftsmith.distill.jobs`.
"""

from __future__ import annotations

import sys

from draftsmith.scripts._args import (
    UsageError,
    add_count,
    add_device_args,
    add_no_progress,
    add_seconds,
    add_whole,
    float_in,
    int_at_least,
    positive_int,
    settings_from_args,
)


def add_commands(sub) -> None:
    gen = sub.add_parser("generate", help="self-distillation data: the target answers the prompts itself")
    gen.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    gen.add_argument(
        "--prompts",
        required=True,
        help="JSONL/JSON/parquet/CSV file, a `datasets` folder, or a hub dataset name (online)",
    )
    gen.add_argument("--split", default="train", help="split of a dataset folder or hub dataset")
    add_count(gen, "--limit", help="use only the first N prompts")
    gen.add_argument("--out", required=True, help="output folder (a re-run with the same arguments resumes it)")
    add_count(gen, "--max-new-tokens", default=512, help="per assistant turn; longer answers are cut and flagged")
    gen.add_argument(
        "--max-length",
        type=int_at_least("--max-length", 2),
        help="prompt + answer tokens (default: the target's max positions); longer prompts are skipped and counted",
    )
    gen.add_argument(
        "--temperature", type=float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"), default=0.0
    )
    gen.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, True, "in (0, 1]"), default=1.0)
    add_whole(gen, "--top-k", default=0, note=" (0 = off)")
    add_count(gen, "--num-samples", default=1, help="answers per prompt (needs --temperature > 0)")
    gen.add_argument("--batch-size", type=positive_int("--batch-size"), default=8)
    add_count(gen, "--shard-size", default=256, help="samples per shard (the unit of resumption)")
    gen.add_argument(
        "--chat-template", default="auto", help="auto (the tokenizer's, if any), none (raw prompts), or a Jinja FILE"
    )
    gen.add_argument("--seed", type=int, default=0)
    _add_endpoint_args(gen)
    add_device_args(gen)
    add_no_progress(gen)
    gen.set_defaults(func=cmd_generate)

    ins = sub.add_parser(
        "inspect-data", help="show a sample of generated data: what the drafter is trained on, and the provenance"
    )
    ins.add_argument("data", help="folder written by `draftsmith generate`")
    ins.add_argument("--index", type=int, default=0, help="row to show (negative counts from the end)")
    ins.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour trained spans (auto: when stdout is a terminal)",
    )
    ins.set_defaults(func=cmd_inspect_data)

    ver = sub.add_parser(
        "verify-data", help="check a data folder: every shard file against its checksum, and the data hash recomputed"
    )
    ver.add_argument("data", help="folder written by `draftsmith generate`")
    ver.set_defaults(func=cmd_verify_data)

    vm = sub.add_parser(
        "vocab-map",
        help="a reduced draft vocabulary (d2t/t2d, for heads that take `draft_vocab_size`) from the data's token "
        "frequencies",
    )
    vm.add_argument("--data", required=True, help="folder written by `draftsmith generate`")
    vm.add_argument("--draft-vocab-size", type=positive_int("--draft-vocab-size"), required=True)
    vm.add_argument("--out", help="file to write (default DATA/vocab-map-N.safetensors)")
    vm.set_defaults(func=cmd_vocab_map)

    ch = sub.add_parser(
        "cache-hidden",
        help="offline hidden states of chosen target layers for the data (opt-in; online training needs none)",
    )
    ch.add_argument("--target", required=True, help="folder of the target that generated the data")
    ch.add_argument("--data", required=True, help="folder written by `draftsmith generate`")
    ch.add_argument(
        "--layers",
        required=True,
        help="comma-separated HF hidden_states ids: i, -k (= L-k), mid (= L//2), last (after the final norm); none: top-k only",
    )
    ch.add_argument("--out", required=True, help="cache folder (a re-run with the same arguments resumes it)")
    ch.add_argument("--dtype", default="bf16", help="dtype the states are stored in: bf16 (default), fp16, fp32")
    ch.add_argument(
        "--model-dtype",
        default="auto",
        help="dtype of the target's forward: auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16",
    )
    ch.add_argument(
        "--max-disk",
        default="50GB",
        help="refuse to start when the estimate exceeds this (e.g. 500MB, 2TB); default 50GB",
    )
    add_whole(
        ch,
        "--topk-logits",
        default=0,
        help="also store the target's top-k logits and their tail per token (train/draft.py's teacher_cache)",
        note=" (0 = off)",
    )
    ch.add_argument("--batch-size", type=positive_int("--batch-size"), default=8)
    add_count(ch, "--shard-size", default=256, help="samples per safetensors file")
    add_device_args(ch, dtype=False)
    add_no_progress(ch)
    ch.set_defaults(func=cmd_cache_hidden)

    mp = sub.add_parser(
        "make-prompts", help="instruction prompts made offline (stdlib code, Shakespeare): train.jsonl + heldout.jsonl"
    )
    mp.add_argument("--out", required=True, help="folder to write train.jsonl and heldout.jsonl into")
    add_count(mp, "--train", default=1024, help="rows of train.jsonl")
    add_whole(mp, "--heldout", default=128, help="rows of heldout.jsonl (from sources train never sees)")
    mp.add_argument(
        "--seed", type=int, default=0, help="picks the items and the wording; the held-out sources stay the same"
    )
    mp.set_defaults(func=cmd_make_prompts)


def _add_endpoint_args(gen) -> None:
    ep = gen.add_argument_group("serving engine (OpenAI-compatible: vLLM, SGLang, TGI, transformers serve)")
    ep.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="answer with this server instead of loading the target (repeat to spread requests)",
    )
    ep.add_argument(
        "--served-model", help="model id to request (default: the one model the endpoints list at /v1/models)"
    )
    ep.add_argument(
        "--api-key-env", metavar="VAR", help="environment variable holding the API key (the key is never written)"
    )
    add_count(ep, "--concurrency", default=8, help="requests in flight over all endpoints")
    add_seconds(ep, "--request-timeout", default=600.0)
    add_whole(ep, "--retries", default=4, help="tries after the first, each on the next endpoint, with backoff")
    ep.add_argument(
        "--send",
        choices=("auto", "ids", "text"),
        default="auto",
        help="prompts as token ids to /v1/completions, or as text/messages (auto: ids when the server takes them)",
    )
    ep.add_argument(
        "--reasoning",
        choices=("keep", "strip", "refuse"),
        default="keep",
        help="a <think> block or reasoning_content: train on it, drop it, or drop the sample",
    )


def _endpoint_settings(args):
    from draftsmith.distill.endpoint import EndpointSettings

    if not args.endpoint:
        return None
    return EndpointSettings(
        urls=tuple(args.endpoint),
        served_model=args.served_model,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        timeout=args.request_timeout,
        retries=args.retries,
        send=args.send,
        reasoning=args.reasoning,
    )


def cmd_generate(args) -> int:
    from draftsmith.distill.chat import ChatTemplateError
    from draftsmith.distill.data import DataError
    from draftsmith.distill.endpoint import EndpointError
    from draftsmith.distill.generate import GenerateSettings
    from draftsmith.distill.jobs import GenerateJob, run_generate
    from draftsmith.distill.sources import SourceError

    settings = settings_from_args(GenerateSettings, args)
    try:
        endpoint = _endpoint_settings(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    job = settings_from_args(GenerateJob, args, settings=settings, endpoint=endpoint, progress=not args.no_progress)
    return _run_resumable("generate", run_generate, job, (SourceError, ChatTemplateError, DataError, EndpointError))


def _run_resumable(command: str, run, job, errors) -> int:
    """`run(job)` of a job that writes complete shards to `job.out` and resumes from them: `errors`
    become UsageError; an interrupt keeps the shards written and says how to resume (exit 130)."""
    try:
        run(job)
    except errors as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        print(
            f"draftsmith {command}: interrupted; complete shards are kept in {job.out}; rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    return 0


def cmd_inspect_data(args) -> int:
    from draftsmith.distill.data import DataError
    from draftsmith.distill.jobs import inspect_sample

    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    try:
        print(inspect_sample(args.data, args.index, color))
    except DataError as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_verify_data(args) -> int:
    from draftsmith.distill.data import DataError, DistillData

    try:
        report = DistillData(args.data).verify()
    except DataError as err:
        raise UsageError(str(err)) from None
    unchecked = report["shards"] - report["with_checksums"]
    files = f"{report['with_checksums']} with file checksums, all matching" + (
        f"; {unchecked} written without checksums" if unchecked else ""
    )
    print(
        f"ok: {args.data}: {report['samples']} samples in {report['shards']} shard(s), {files}; data hash {report['data_hash']} recomputed and matches"
    )
    return 0


def cmd_vocab_map(args) -> int:
    from draftsmith.distill.data import DataError
    from draftsmith.distill.jobs import make_vocab_map
    from draftsmith.distill.vocab import VocabMapError

    try:
        make_vocab_map(args.data, args.draft_vocab_size, args.out)
    except (DataError, VocabMapError) as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_cache_hidden(args) -> int:
    from draftsmith.distill.data import DataError
    from draftsmith.distill.hidden_cache import CacheError
    from draftsmith.distill.jobs import CacheHiddenJob, run_cache_hidden

    job = settings_from_args(CacheHiddenJob, args, progress=not args.no_progress)
    return _run_resumable("cache-hidden", run_cache_hidden, job, (CacheError, DataError))


def cmd_make_prompts(args) -> int:
    from draftsmith.distill.instructions import build_instruction_prompts

    try:
        summary = build_instruction_prompts(args.out, num_train=args.train, num_heldout=args.heldout, seed=args.seed)
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from None
    for split in ("train", "heldout"):
        part = summary[split]
        tasks = ", ".join(f"{kind} {n}" for kind, n in part["tasks"].items())
        kinds = ", ".join(f"{kind} {n}" for kind, n in part["source_kinds"].items())
        print(
            f"wrote {part['file']}: {part['rows']} prompts ({tasks}) from {len(part['sources'])} sources ({kinds} rows)"
        )
    print(f"held-out sources: {', '.join(summary['heldout']['sources'])}")
    if "note" in summary:
        print(f"note: {summary['note']}")
    return 0
