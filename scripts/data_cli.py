"""The data commands of `draftsmith`: what comes from the target.

    draftsmith generate --target DIR --prompts SRC --out DIR [--max-new-tokens N] [--temperature T]
                        [--top-p P] [--num-samples N] [--batch-size B] [--chat-template auto|none|FILE]
    draftsmith inspect-data DIR [--index I]
    draftsmith vocab-map --data DIR --draft-vocab-size N [--out FILE]
    draftsmith cache-hidden --target DIR --data DIR --layers 2,mid,-3 --dtype bf16 --out DIR [--max-disk 50GB]
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.scripts.cli import UsageError, _float_in, _int_at_least, _positive_int


def add_data_commands(sub) -> None:
    gen = sub.add_parser("generate", help="self-distillation data: the target answers the prompts itself")
    gen.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    gen.add_argument("--prompts", required=True, help="JSONL/JSON/parquet/CSV file, a `datasets` folder, or a hub dataset name (online)")
    gen.add_argument("--split", default="train", help="split of a dataset folder or hub dataset")
    gen.add_argument("--limit", type=_positive_int("--limit"), help="use only the first N prompts")
    gen.add_argument("--out", required=True, help="output folder (a re-run with the same arguments resumes it)")
    gen.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=512, help="per assistant turn; longer answers are cut and flagged")
    gen.add_argument("--max-length", type=_int_at_least("--max-length", 2), help="prompt + answer tokens (default: the target's max positions); longer prompts are skipped and counted")
    gen.add_argument("--temperature", type=_float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"), default=0.0)
    gen.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0, True, "in (0, 1]"), default=1.0)
    gen.add_argument("--top-k", type=_int_at_least("--top-k", 0, " (0 = off)"), default=0)
    gen.add_argument("--num-samples", type=_positive_int("--num-samples"), default=1, help="answers per prompt (needs --temperature > 0)")
    gen.add_argument("--batch-size", type=_positive_int("--batch-size"), default=8)
    gen.add_argument("--shard-size", type=_positive_int("--shard-size"), default=256, help="samples per shard (the unit of resumption)")
    gen.add_argument("--chat-template", default="auto", help="auto (the tokenizer's, if any), none (raw prompts), or a Jinja FILE")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    gen.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    gen.add_argument("--no-progress", action="store_true", help="no progress bars")
    gen.set_defaults(func=cmd_generate)

    ins = sub.add_parser("inspect-data", help="show a sample of generated data: what the drafter is trained on, and the provenance")
    ins.add_argument("data", help="folder written by `draftsmith generate`")
    ins.add_argument("--index", type=int, default=0, help="row to show (negative counts from the end)")
    ins.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour trained spans (auto: when stdout is a terminal)")
    ins.set_defaults(func=cmd_inspect_data)

    vm = sub.add_parser("vocab-map", help="EAGLE-3's reduced draft vocabulary (d2t/t2d) from the data's token frequencies")
    vm.add_argument("--data", required=True, help="folder written by `draftsmith generate`")
    vm.add_argument("--draft-vocab-size", type=_positive_int("--draft-vocab-size"), required=True)
    vm.add_argument("--out", help="file to write (default DATA/vocab-map-N.safetensors)")
    vm.set_defaults(func=cmd_vocab_map)

    ch = sub.add_parser("cache-hidden", help="offline hidden states of chosen target layers for the data (opt-in; online training needs none)")
    ch.add_argument("--target", required=True, help="folder of the target that generated the data")
    ch.add_argument("--data", required=True, help="folder written by `draftsmith generate`")
    ch.add_argument("--layers", required=True, help="comma-separated HF hidden_states ids: i, -k (= L-k), mid (= L//2), last (after the final norm)")
    ch.add_argument("--out", required=True, help="cache folder (a re-run with the same arguments resumes it)")
    ch.add_argument("--dtype", default="bf16", help="dtype the states are stored in: bf16 (default), fp16, fp32")
    ch.add_argument("--model-dtype", default="auto", help="dtype of the target's forward: auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    ch.add_argument("--max-disk", default="50GB", help="refuse to start when the estimate exceeds this (e.g. 500MB, 2TB); default 50GB")
    ch.add_argument("--topk-logits", type=_int_at_least("--topk-logits", 0, " (0 = off)"), default=0, help="also store the target's top-k logits per token")
    ch.add_argument("--batch-size", type=_positive_int("--batch-size"), default=8)
    ch.add_argument("--shard-size", type=_positive_int("--shard-size"), default=256, help="samples per safetensors file")
    ch.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    ch.add_argument("--no-progress", action="store_true", help="no progress bars")
    ch.set_defaults(func=cmd_cache_hidden)


def cmd_generate(args) -> int:
    from draftsmith.distill.chat import ChatTemplateError, resolve_chat_template
    from draftsmith.distill.data import DataError
    from draftsmith.distill.generate import GenerateSettings, describe_summary, generate_dataset
    from draftsmith.distill.sources import SourceError, load_source
    from draftsmith.heads.models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    try:
        settings = GenerateSettings(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            num_samples=args.num_samples, batch_size=args.batch_size, shard_size=args.shard_size,
            max_length=args.max_length, seed=args.seed,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise UsageError(f"--target {args.target!r} has no tokenizer: generation needs one to read the prompts")
    try:
        source = load_source(args.prompts, split=args.split, limit=args.limit)
        template = resolve_chat_template(args.chat_template, tokenizer)
        model = load_causal_lm(args.target, device=device, dtype=dtype, role="target")
        summary = generate_dataset(
            model, tokenizer, source, args.out, settings, template=template, template_spec=args.chat_template,
            target_path=args.target, dtype=dtype, progress=not args.no_progress,
        )  # fmt: skip
    except (SourceError, ChatTemplateError, DataError) as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        print(f"draftsmith generate: interrupted; complete shards are kept in {args.out}; rerun the same command to resume", file=sys.stderr)
        return 130
    print(describe_summary(summary))
    print(f"\nwrote {args.out}/ ; look at a sample with: draftsmith inspect-data {args.out}")
    return 0


_TRAINED = ("\033[1;32m", "\033[0m")  # bold green
_CONTEXT = ("\033[2m", "\033[0m")  # dim
_MARKERS = ("\u27e6", "\u27e7")  # ⟦ trained ⟧ when colour is off


def render_sample(tokenizer, input_ids: list[int], loss_mask: list[int], color: bool) -> str:
    """The sample's text with the trained spans (mask 1) set apart from the context (mask 0)."""
    pieces = []
    start = 0
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or loss_mask[i] != loss_mask[start]:
            text = tokenizer.decode(input_ids[start:i], skip_special_tokens=False)
            if loss_mask[start]:
                pieces.append(f"{_TRAINED[0]}{text}{_TRAINED[1]}" if color else f"{_MARKERS[0]}{text}{_MARKERS[1]}")
            else:
                pieces.append(f"{_CONTEXT[0]}{text}{_CONTEXT[1]}" if color else text)
            start = i
    return "".join(pieces)


def cmd_inspect_data(args) -> int:
    from draftsmith.distill.data import DataError, DistillData
    from draftsmith.heads.models import load_tokenizer

    try:
        data = DistillData(args.data)
    except DataError as err:
        raise UsageError(str(err)) from None
    if len(data) == 0:
        raise UsageError(f"{args.data!r} holds no samples")
    if not -len(data) <= args.index < len(data):
        raise UsageError(f"--index {args.index} is out of range: {args.data} has {len(data)} samples (0..{len(data) - 1})")
    prov, summary = data.provenance, data.summary
    target = prov["target"]
    tokenizer = load_tokenizer(target["path"])
    if tokenizer is None:
        raise UsageError(f"the target's tokenizer is not at {target['path']!r} any more: cannot decode the sample")
    row = data[args.index]
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    s = prov["settings"]
    template = prov["chat_template"]
    print(f"data      {data.dir}  ({summary['samples']} samples, {summary['tokens']} tokens, {summary['trained_tokens']} trained, {100 * summary['truncation_rate']:.1f}% truncated)")
    print(f"hash      {data.data_hash}")
    print(f"target    {target['name_or_path']} (fingerprint {target['fingerprint'][:12]}, {target['dtype']})")
    print(f"source    {prov['source']['name']} ({prov['source']['format']}, {prov['source']['records']} records)")
    print(
        f"template  {template['spec']}" + (f" (sha256 {template['hash'][:12]})" if template["used"] else " (not used: raw prompts)")
    )
    print(
        f"sampling  T = {s['temperature']:g}, top_p = {s['top_p']:g}, top_k = {s['top_k']}, seed {s['seed']}, "
        f"max_new_tokens {s['max_new_tokens']}, max_length {s['max_length']}, {s['num_samples']} sample(s) per prompt"
    )
    print()
    print(
        f"sample {args.index % len(data)}: record {row['record_index']}, sample {row['sample_index']}, {row['length']} tokens "
        f"({row['prompt_length']} before the last answer), {row['num_trained']} trained, {row['num_turns']} turn(s) generated, "
        f"finish: {row['finish_reason']}"
    )
    legend = f"{_TRAINED[0]}trained{_TRAINED[1]} / {_CONTEXT[0]}context (not trained){_CONTEXT[1]}" if color else "\u27e6trained\u27e7 / context (not trained)"
    print(f"legend: {legend}")
    print("-" * 72)
    print(render_sample(tokenizer, list(row["input_ids"]), list(row["loss_mask"]), color))
    print("-" * 72)
    return 0


def cmd_vocab_map(args) -> int:
    from draftsmith.distill.data import DataError, DistillData
    from draftsmith.distill.vocab import VocabMapError, build_vocab_map, save_vocab_map

    try:
        data = DistillData(args.data)
        vmap = build_vocab_map(data.token_counts(), args.draft_vocab_size, data.data_hash)
    except (DataError, VocabMapError) as err:
        raise UsageError(str(err)) from None
    out = Path(args.out) if args.out else data.dir / f"vocab-map-{args.draft_vocab_size}.safetensors"
    save_vocab_map(vmap, out)
    print(vmap.describe())
    print(f"wrote {out}")
    return 0


def cmd_cache_hidden(args) -> int:
    from draftsmith.distill.data import DataError, DistillData
    from draftsmith.distill.hidden_cache import CacheError, cache_hidden_states, human_bytes, parse_size, resolve_layers
    from draftsmith.heads.models import load_causal_lm, output_vocab_size, parse_dtype, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    store_dtype = parse_dtype(args.dtype)
    model_dtype = resolve_dtype(args.model_dtype, device)
    try:
        max_disk = parse_size(args.max_disk)
        data = DistillData(args.data)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.target).get_text_config()
        resolve_layers(args.layers, config.num_hidden_layers)  # before the (slow) model load
        output_vocab_size(args.target, "target")
        model = load_causal_lm(args.target, device=device, dtype=model_dtype, role="target")
        from draftsmith.heads.models import target_fingerprint

        if data.provenance["target"]["fingerprint"] != target_fingerprint(model):
            print(
                f"warning: {args.data} was generated by {data.provenance['target']['name_or_path']}, not by this target "
                "(fingerprints differ); the states are still this target's",
                file=sys.stderr,
            )
        manifest = cache_hidden_states(
            model, data, args.out, layers_spec=args.layers, dtype=store_dtype, max_disk=max_disk,
            batch_size=args.batch_size, topk=args.topk_logits, shard_size=args.shard_size,
            target_path=args.target, progress=not args.no_progress,
        )  # fmt: skip
    except (CacheError, DataError) as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        print(f"draftsmith cache-hidden: interrupted; complete shards are kept in {args.out}; rerun the same command to resume", file=sys.stderr)
        return 130
    run = manifest.get("last_run") or {}
    print(f"layers {manifest['layers']} ({manifest['layers_spec']}), {manifest['dtype']}, {manifest['samples']} samples, {manifest['tokens']} tokens")
    print(f"wrote {human_bytes(manifest['bytes'])} ({manifest['bytes'] / max(1, manifest['tokens']):.0f} B/token on disk) to {args.out}")
    if run.get("tokens_per_second"):
        print(f"extraction: {run['tokens']} tokens in {run['seconds']:.1f} s ({run['tokens_per_second']:.0f} tokens/s on {run['device']})")
    return 0
