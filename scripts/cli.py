"""The `draftsmith` command.

    draftsmith make-toy --out DIR
    draftsmith eval --target DIR (--draft [NAME=]DIR ... | --medusa DIR [--medusa-tree auto] | --eagle DIR [--eagle-tree 4,4,16] | --prompt-lookup) --prompts FILE.jsonl --out DIR
                    [--batch-sizes 1,2,4,8 [--qps 0.5,1,2] [--latency-target S] [--percentile 90] [--price-per-hour USD]]
    draftsmith tune --target DIR (--draft DIR | --medusa DIR | --eagle DIR) --prompts FILE.jsonl [--k-max 8] [--write] [--out DIR]
    draftsmith check-lossless --target DIR (--draft DIR | --prompt-lookup) [--temperature 1.0]
    draftsmith demo [--quick] [--out DIR] [--preset cpu|gpu|micro] [--cache-dir DIR]
    draftsmith build-target [--preset cpu|gpu|micro] [--cache-dir DIR] [--force]
    draftsmith export HEADS_DIR --format medusa|vllm|sglang|hf --out DIR
    draftsmith push RUN_DIR --repo-id ORG/NAME [--private] [--format ...] [--dry-run --out DIR]
    draftsmith generate --target DIR --prompts SRC --out DIR      (self-distillation data)
    draftsmith inspect-data DIR [--index I]
    draftsmith vocab-map --data DIR --draft-vocab-size N
    draftsmith cache-hidden --target DIR --data DIR --layers 2,mid,-3 --out DIR

Every command that loads a model takes --device (default: CUDA when available) and --dtype.
Errors in the input print one line naming the file, key or value, and exit with status 2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch


class UsageError(ValueError):
    pass


def _int_at_least(name, minimum, note=""):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}{note}, got {value}")
        return value

    return parse


def _positive_int(name):
    return _int_at_least(name, 1)


def _float_in(name, low, high, low_open, what):
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


def _list_of(name: str, parse_one, what: str, example: str):
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


BATCH_SIZES = _list_of("--batch-sizes", lambda t: _int_or_none(t, 1), "a batch size (an integer >= 1)", "1,2,4,8")
QPS = _list_of("--qps", _rate_or_none, "an arrival rate (requests per second > 0)", "0.5,1,2,4")
TREE_BUDGETS = _list_of("--tree-budgets", lambda t: _int_or_none(t, 1), "a number of tree nodes (an integer >= 1)", "4,8,16,32")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    p.add_argument("--draft", action="append", metavar="[NAME=]DIR", help="folder of a draft model sharing the target's vocabulary; repeat for several (named NAME, else after the folder)")
    p.add_argument("--prompt-lookup", action="store_true", help="use prompt lookup (n-gram) drafting")
    p.add_argument("--max-ngram", type=_positive_int("--max-ngram"), default=3, help="prompt lookup: longest n-gram to match")
    p.add_argument("--medusa", help="folder of Medusa heads for this target (draftsmith, original Medusa or vLLM layout)")
    p.add_argument("--medusa-tree", help="also decode with a Medusa tree: auto (built from the heads' measured accuracies) or a JSON list of paths, e.g. [[0],[1],[0,0]]")
    p.add_argument("--tree-nodes", type=_positive_int("--tree-nodes"), default=16, help="node budget of --medusa-tree auto")
    p.add_argument("--eagle", help="folder of an EAGLE-1/EAGLE-3 head for this target (draftsmith, vLLM speculators or SGLang layout)")
    p.add_argument("--eagle-tree", help="also decode with an EAGLE-2 dynamic tree: DEPTH,TOP_K,TOTAL_TOKENS, e.g. 4,4,16")
    p.add_argument("--lossy", choices=["typical"], help="Medusa's typical acceptance (LOSSY: output differs from the target's; reported as such)")
    p.add_argument("--typical-epsilon", type=float, default=0.09, help="typical acceptance: posterior threshold epsilon")
    p.add_argument("--typical-delta", type=float, default=0.3, help="typical acceptance: entropy factor delta")
    p.add_argument("--num-draft-tokens", "-k", type=_positive_int("--num-draft-tokens (K)"), default=4, help="K: drafts per target call")
    p.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    p.add_argument("--top-k", type=_int_at_least("--top-k", 0, " (0 = off)"), default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0, True, "in (0, 1]"), default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description="Train the drafters of speculative decoding and measure them with a lossless decoder.")
    parser.add_argument("--version", action="version", version=f"draftsmith {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("eval", help="acceptance, speedup and KL of drafters against target-only decoding")
    _add_model_args(ev)
    ev.add_argument("--prompts", required=True, help='JSONL: one {"prompt": text} or {"input_ids": [...]} per line')
    ev.add_argument("--limit", type=_positive_int("--limit"), help="use only the first N prompts")
    ev.add_argument("--task-key", default="task", help='field of a prompt row that names its task, for per-task tables (default "task")')
    ev.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    ev.add_argument("--temperature", type=_float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"), default=0.0)
    ev.add_argument("--repeats", type=_positive_int("--repeats"), default=3, help="timed passes (median reported)")
    ev.add_argument("--static-cache", action="store_true", help="decode over preallocated KV caches (the target, draft models and EAGLE heads; with --batch-sizes the batched decoder too)")
    ev.add_argument("--compile", nargs="?", const="default", choices=["default", "max-autotune"], help="also torch.compile the decode and verify steps (implies --static-cache; compile time is reported apart)")
    ev.add_argument("--ignore-eos", action="store_true", help="always decode --max-new-tokens tokens")
    ev.add_argument("--no-distances", action="store_true", help="skip the untimed KL/TV pass")
    ev.add_argument("--out", required=True, help="folder for report.json and report.md (and serving.* with --batch-sizes)")
    sv = ev.add_argument_group("serving scale (serving.json, serving.md, serving.html and figures)")
    sv.add_argument("--batch-sizes", type=BATCH_SIZES, help="also measure batched decoding at these batch sizes, e.g. 1,2,4,8,16,32")
    sv.add_argument("--qps", type=QPS, help="simulate Poisson arrivals at these rates (requests/s) on the largest batch size")
    sv.add_argument("--latency-target", type=_float_in("--latency-target", 0.0, None, True, "> 0 seconds"), help="find the highest load whose request latency percentile stays within SECONDS")
    sv.add_argument("--percentile", type=_float_in("--percentile", 0.0, 100.0, True, "in (0, 100]"), default=90.0, help="the latency percentile of --latency-target (default 90)")
    sv.add_argument("--price-per-hour", type=_float_in("--price-per-hour", 0.0, None, False, ">= 0 dollars per hour"), help="price of the engine per hour: cost per 1k tokens and per answer")
    ev.set_defaults(func=cmd_eval)

    tu = sub.add_parser("tune", help="choose K (Medusa: also the tree size) from measured acceptance and costs; --write records it")
    tu.add_argument("--target", required=True, help="folder of the target (HF format, with its tokenizer)")
    which = tu.add_mutually_exclusive_group(required=True)
    which.add_argument("--draft", help="folder of a draft model sharing the target's vocabulary")
    which.add_argument("--medusa", help="folder of Medusa heads for this target")
    which.add_argument("--eagle", help="folder of an EAGLE-1/EAGLE-3 head for this target")
    tu.add_argument("--prompts", required=True, help='JSONL: one {"prompt": text} or {"input_ids": [...]} per line')
    tu.add_argument("--limit", type=_positive_int("--limit"), help="use only the first N prompts")
    tu.add_argument("--k-max", type=_positive_int("--k-max"), default=8, help="measure acceptance at this K and search K = 0..k-max (Medusa: at most its heads)")
    tu.add_argument("--tree-budgets", type=TREE_BUDGETS, help="Medusa: tree sizes (nodes) to try (default 4,8,16,32)")
    tu.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    tu.add_argument("--temperature", type=_float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"), default=0.0)
    tu.add_argument("--top-k", type=_int_at_least("--top-k", 0, " (0 = off)"), default=0, help="keep the k most likely tokens (0 = off)")
    tu.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0, True, "in (0, 1]"), default=1.0, help="nucleus sampling mass (1 = off)")
    tu.add_argument("--repeats", type=_positive_int("--repeats"), default=3, help="timed passes of the check at the chosen setting (median reported)")
    tu.add_argument("--ignore-eos", action="store_true", help="always decode --max-new-tokens tokens")
    tu.add_argument("--seed", type=int, default=0)
    tu.add_argument("--write", action="store_true", help="record the chosen setting in the drafter folder's config.json")
    tu.add_argument("--out", help="folder for tuning.json and the speedup-vs-setting figures")
    tu.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    tu.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    tu.add_argument("--no-progress", action="store_true", help="no progress bars")
    tu.set_defaults(func=cmd_tune)

    ck = sub.add_parser("check-lossless", help="chi-square test that speculative sampling matches the target")
    _add_model_args(ck)
    ck.add_argument("--temperature", type=_float_in("--temperature", 0.0, None, True, "> 0 (the check needs sampling)"), default=1.0)
    ck.add_argument("--prompt", default="def main():\n    ", help="text prompt (tokenized with the target's tokenizer)")
    ck.add_argument("--samples", type=int, default=2000, help="decodes (>= 100; more = more power)")
    ck.add_argument("--threshold", type=float, default=1e-3, help="fail when a p-value is below this")
    ck.add_argument("--batch-size", type=_positive_int("--batch-size"), default=1, help="decode B copies of the prompt per call (the batched path; every row is one sample)")
    ck.add_argument("--static-cache", action="store_true", help="check the preallocated-cache path")
    ck.add_argument("--compile", nargs="?", const="default", choices=["default", "max-autotune"], help="check the compiled path (implies --static-cache)")
    ck.set_defaults(func=cmd_check_lossless)
    toy = sub.add_parser("make-toy", help="write a toy target/draft pair (random weights) and prompts, for trying the tools")
    toy.add_argument("--out", required=True, help="folder to create (target/, draft/, prompts.jsonl)")
    toy.add_argument("--family", default="llama", help="llama, qwen2, mistral or gpt_neox")
    toy.add_argument("--seed", type=int, default=0)
    toy.add_argument("--force", action="store_true", help="replace an existing folder")
    toy.set_defaults(func=cmd_make_toy)

    demo = sub.add_parser("demo", help="build (once) a small real target and evaluate every drafter method on it")
    demo.add_argument("--quick", action="store_true", help="a smoke run in about a minute (micro target, few short decodes)")
    demo.add_argument("--out", help="output folder (default runs/demo-<preset>)")
    demo.add_argument("--preset", help="demo target preset: cpu (default), gpu, micro (default with --quick)")
    demo.add_argument("--cache-dir", help="where demo targets are cached (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)")
    demo.add_argument("--rebuild", action="store_true", help="rebuild the demo target even when a valid cached one exists")
    demo.add_argument("--prompts", type=_positive_int("--prompts"), help="number of held-out prompts")
    demo.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"))
    demo.add_argument("--num-draft-tokens", "-k", type=_positive_int("--num-draft-tokens (K)"))
    demo.add_argument("--repeats", type=_positive_int("--repeats"), help="timed passes (median reported)")
    demo.add_argument("--temperature", type=_float_in("--temperature", 0.0, None, False, ">= 0 (0 = greedy)"))
    demo.add_argument("--compile", nargs="?", const="default", choices=["default", "max-autotune"], help="decode over a static KV cache with torch.compile'd steps (compile time reported apart)")
    demo.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    demo.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(func=cmd_demo)

    bt = sub.add_parser("build-target", help="build (or reuse) the cached demo target, its small draft and prompts")
    bt.add_argument("--preset", default="cpu", help="cpu (default; <= 15 min on 2 cores), gpu (~105M, one GPU), micro (seconds, tests)")
    bt.add_argument("--cache-dir", help="cache folder (default $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)")
    bt.add_argument("--force", action="store_true", help="rebuild even when a valid cached build exists")
    bt.add_argument("--device", default="auto", help="torch device for training (default: cuda when available)")
    bt.add_argument("--no-progress", action="store_true", help="no progress bars")
    bt.set_defaults(func=cmd_build_target)

    ex = sub.add_parser("export", help="write trained heads in the layout a server loads (Medusa: medusa, vllm; EAGLE-3: vllm, sglang, hf)")
    ex.add_argument("heads", help="folder of trained heads (train/medusa.py writes OUT/heads, train/eagle.py OUT/head)")
    ex.add_argument("--format", required=True, help="Medusa: medusa (FasterDecoding / TGI) or vllm; EAGLE: vllm (speculators), sglang or hf")
    ex.add_argument("--out", required=True, help="folder to write (must not exist or be empty, unless --overwrite)")
    ex.add_argument("--target", help="the target: needed for Medusa heads that share its lm_head (the formats hold a copy)")
    ex.add_argument("--num-speculative-tokens", type=_positive_int("--num-speculative-tokens"), default=3, help="EAGLE: K written into the vLLM/SGLang config")
    ex.add_argument("--overwrite", action="store_true")
    ex.add_argument("--device", default="cpu", help="device for loading (export runs fine on cpu)")
    ex.add_argument("--dtype", default="auto", help="dtype of the written weights (auto: as trained)")
    ex.set_defaults(func=cmd_export)

    pu = sub.add_parser("push", help="upload a trained drafter to the Hugging Face Hub with a generated model card")
    pu.add_argument("run", help="a run folder (the --out of train/medusa.py, train/eagle.py, train/draft.py) or an artifact folder")
    pu.add_argument("--repo-id", required=True, help="NAME or ORG/NAME of the Hub model repository (created when missing)")
    pu.add_argument("--private", action="store_true", help="create the repository private (refused for an existing public one)")
    pu.add_argument("--format", help="pushed layout: Medusa vllm (default), medusa or hf; EAGLE-3 vllm (default), sglang or hf; EAGLE-1 hf; drafts as they are")
    pu.add_argument("--eval-report", help="a `draftsmith eval` report.json for the card (default: RUN/eval/report.json or RUN/report.json)")
    pu.add_argument("--revision", help="branch to push to, created from main when missing (default: main)")
    pu.add_argument("--endpoint", help="Hub URL (default: $HF_ENDPOINT, else https://huggingface.co)")
    pu.add_argument("--base-model", help="the target's Hub id (ORG/NAME) when the run loaded it from a local folder")
    pu.add_argument("--commit-message", help="message of the Hub commit (default: the method and its steps)")
    pu.add_argument("--dry-run", action="store_true", help="write what would be pushed to --out and push nothing")
    pu.add_argument("--out", help="with --dry-run: the folder to write (must not exist or be empty, or hold an earlier dry run)")
    pu.set_defaults(func=cmd_push)

    from draftsmith.scripts.data_cli import add_data_commands

    add_data_commands(sub)
    return parser


def _version() -> str:
    try:
        return metadata.version("draftsmith")
    except metadata.PackageNotFoundError:
        return "unknown"


def _load(args):
    """Target, tokenizer and the requested drafters, with every input checked first."""
    from draftsmith.eval.runtime.drafters import DraftModelDrafter, PromptLookupDrafter
    from draftsmith.heads.models import check_vocab_compatible, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    if not args.draft and not args.prompt_lookup and not args.medusa and not args.eagle:
        raise UsageError("give a drafter: --draft DIR, --medusa DIR, --eagle DIR and/or --prompt-lookup")
    if args.medusa_tree and not args.medusa:
        raise UsageError("--medusa-tree applies to Medusa heads: give --medusa DIR")
    if args.eagle_tree and not args.eagle:
        raise UsageError("--eagle-tree applies to EAGLE heads: give --eagle DIR")
    if args.lossy and not (args.medusa or args.eagle):
        raise UsageError("--lossy applies to Medusa and EAGLE heads: give --medusa DIR or --eagle DIR")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    drafts = draft_names(args.draft)
    tokenizer = load_tokenizer(args.target)
    for folder in drafts.values():
        check_vocab_compatible(args.target, folder, target_tokenizer=tokenizer)
    target = load_causal_lm(args.target, device=device, dtype=dtype, role="target")
    drafters = {}
    for name, folder in drafts.items():
        draft = load_causal_lm(folder, device=device, dtype=dtype, role="draft")
        label = Path(folder).name if len(drafts) == 1 else name  # one --draft keeps its method name "draft"
        drafters[name] = DraftModelDrafter(draft, name=label)
    if args.prompt_lookup:
        drafters["prompt-lookup"] = PromptLookupDrafter(max_ngram=args.max_ngram)
    if args.medusa:
        drafters.update(_medusa_drafters(args, target, device, dtype))
    if args.eagle:
        drafters.update(_eagle_drafters(args, target, device, dtype))
    return target, tokenizer, drafters, device, dtype


RESERVED_NAMES = ("target-only", "prompt-lookup", "medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree")  # other rows' names


def draft_names(values) -> dict[str, str]:
    """{method name: folder} of the --draft flags. `NAME=DIR` names a draft; a bare DIR is
    "draft" when it is the only one, else its folder name, with the parent folder's name in
    front when two folders share a name (demo-target-cpu/draft, distilled-draft/draft)."""
    specs = []
    for value in values or []:
        name, sep, folder = str(value).partition("=")
        if sep and name and folder and not Path(value).expanduser().exists():
            specs.append((name.strip(), str(Path(folder).expanduser())))
        else:
            specs.append((None, str(Path(value).expanduser())))
    if len(specs) == 1 and specs[0][0] is None:
        return {"draft": specs[0][1]}
    bare = [Path(f).expanduser() for n, f in specs if n is None]
    out: dict[str, str] = {}
    for name, folder in specs:
        if name is None:
            path = Path(folder).expanduser()
            shared = sum(p.name == path.name for p in bare) > 1
            name = f"{path.parent.name}/{path.name}" if shared else path.name
        if name in out or name in RESERVED_NAMES:
            raise UsageError(f"--draft: two drafts (or a draft and another method) are both named {name!r}; name them with --draft NAME=DIR")
        out[name] = folder
    return out


def parse_eagle_tree(text: str) -> dict:
    try:
        depth, top_k, total = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--eagle-tree {text!r}: expected DEPTH,TOP_K,TOTAL_TOKENS, e.g. 4,4,16") from None
    if min(depth, top_k, total) < 1:
        raise UsageError(f"--eagle-tree {text!r}: all three must be >= 1")
    return {"depth": depth, "top_k": top_k, "total_tokens": total}


def _eagle_drafters(args, target, device, dtype) -> dict:
    from draftsmith.eval.runtime.eagle import EagleDrafter
    from draftsmith.heads.eagle import EagleError, load_eagle

    try:
        head = load_eagle(args.eagle, target=target, device=device, dtype=dtype)
    except EagleError as err:
        raise UsageError(str(err)) from None
    typical = (args.typical_epsilon, args.typical_delta) if args.lossy == "typical" else None
    drafters = {"eagle-chain": EagleDrafter(head, name="eagle-chain", typical=typical)}
    if args.eagle_tree:
        drafters["eagle-tree"] = EagleDrafter(head, tree=parse_eagle_tree(args.eagle_tree), name="eagle-tree", typical=typical)
    return drafters


def _medusa_drafters(args, target, device, dtype) -> dict:
    import json

    from draftsmith.eval.runtime.drafters import MedusaDrafter
    from draftsmith.eval.runtime.tree import build_medusa_tree
    from draftsmith.heads.medusa import MedusaError, load_medusa

    try:
        heads = load_medusa(args.medusa, target=target, device=device, dtype=dtype)
    except MedusaError as err:
        raise UsageError(str(err)) from None
    layers = target.config.get_text_config().num_hidden_layers
    typical = (args.typical_epsilon, args.typical_delta) if args.lossy == "typical" else None
    drafters = {"medusa-chain": MedusaDrafter(heads, layers, name="medusa-chain", typical=typical)}
    if args.medusa_tree:
        if args.medusa_tree == "auto":
            accuracies = heads.config.head_accuracies
            if not accuracies:
                raise UsageError(f"--medusa-tree auto: {args.medusa} records no head accuracies (train it with train/medusa.py, or give the paths as JSON)")
            tree = build_medusa_tree(accuracies, args.tree_nodes)
        else:
            try:
                tree = [tuple(int(r) for r in path) for path in json.loads(args.medusa_tree)]
            except (ValueError, TypeError) as err:
                raise UsageError(f"--medusa-tree {args.medusa_tree!r}: expected auto or a JSON list of paths like [[0],[1],[0,0]] ({err})") from None
        try:
            drafters["medusa-tree"] = MedusaDrafter(heads, layers, tree=tree, name="medusa-tree", typical=typical)
        except ValueError as err:
            raise UsageError(f"--medusa-tree: {err}") from None
    return drafters


def _eos(target, tokenizer):
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return eos if eos is not None else target.generation_config.eos_token_id


def _sweep_settings(args):
    """The serving-scale settings of `eval`, or None without --batch-sizes."""
    from draftsmith.eval.sweep import SweepSettings

    if args.batch_sizes is None:
        given = [flag for flag, value in (("--qps", args.qps), ("--latency-target", args.latency_target),
                                          ("--price-per-hour", args.price_per_hour)) if value is not None]  # fmt: skip
        if given:
            raise UsageError(f"{', '.join(given)} need --batch-sizes: the serving analysis runs on step costs measured per batch size (e.g. --batch-sizes 1,2,4,8)")
        return None
    try:
        return SweepSettings(
            batch_sizes=tuple(args.batch_sizes), qps=tuple(args.qps or ()), latency_target_s=args.latency_target,
            percentile=args.percentile, price_per_hour=args.price_per_hour,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None


def cmd_eval(args) -> int:
    from draftsmith.eval.evaluator import EvalSettings, describe_target, evaluate, load_prompt_file
    from draftsmith.eval.report import header, position_table, summary_table, write_report

    try:
        settings = EvalSettings(
            num_draft_tokens=args.num_draft_tokens,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repeats=args.repeats,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            measure_distances=not args.no_distances,
            static_cache=args.static_cache or bool(args.compile),
            compile=args.compile or False,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    sweep = _sweep_settings(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    target, tokenizer, drafters, device, dtype = _load(args)
    prompts, tasks = load_prompt_file(args.prompts, tokenizer, limit=args.limit, task_key=args.task_key)
    eos = _eos(target, tokenizer)
    report = evaluate(target, drafters, prompts, settings, eos_token_id=eos, progress=not args.no_progress, tasks=tasks)
    report["target"] = describe_target(args.target, target, device, dtype)
    report["drafts"] = {**draft_names(args.draft), **{k: v for k, v in (("medusa", args.medusa), ("eagle", args.eagle)) if v}}
    report["prompts_file"] = str(args.prompts)
    report["draftsmith_version"] = _version()
    report["torch_version"] = torch.__version__
    report["git_revision"] = _git_revision()
    json_path, md_path = write_report(report, out)
    print(header(report))
    print()
    print(summary_table(report))
    print()
    print(position_table(report))
    print(f"\nwrote {json_path} and {md_path}")
    if sweep is not None:
        _serving(args, sweep, target, drafters, prompts, settings, report, eos)
    return 0


def _serving(args, sweep, target, drafters, prompts, settings, report, eos) -> None:
    """`eval --batch-sizes`: the sweep, the simulations, serving.* and the three-A table."""
    from draftsmith.eval.plots import markdown_table
    from draftsmith.eval.sweep import crossover_sentences, display_rows, load_sentences, run_sweep, write_serving

    serving = run_sweep(target, drafters, prompts, settings, sweep, report=report, eos_token_id=eos, progress=not args.no_progress)
    for key in ("target", "drafts", "prompts_file", "draftsmith_version", "torch_version", "git_revision"):
        serving[key] = report[key]
    paths = write_serving(serving, args.out, report=report)
    print("\nThe three A (Acceptance, Acceleration, Attendance):")
    print(markdown_table(display_rows(serving["three_a"])))
    for sentence in crossover_sentences(serving) + load_sentences(serving):
        print(f"- {sentence}")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")


def _load_tune(args):
    """Target, tokenizer, the one chain drafter to tune, its folder, and (Medusa) its heads."""
    from draftsmith.eval.runtime.drafters import DraftModelDrafter, MedusaDrafter
    from draftsmith.heads.models import check_vocab_compatible, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    if args.tree_budgets and not args.medusa:
        raise UsageError("--tree-budgets applies to Medusa heads: give --medusa DIR")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = load_tokenizer(args.target)
    if args.draft:
        check_vocab_compatible(args.target, args.draft, target_tokenizer=tokenizer)
    target = load_causal_lm(args.target, device=device, dtype=dtype, role="target")
    heads = None
    if args.draft:
        draft = load_causal_lm(args.draft, device=device, dtype=dtype, role="draft")
        drafter = DraftModelDrafter(draft, name="draft")
        folder = args.draft
    elif args.medusa:
        from draftsmith.heads.medusa import MedusaError, load_medusa

        try:
            heads = load_medusa(args.medusa, target=target, device=device, dtype=dtype)
        except MedusaError as err:
            raise UsageError(str(err)) from None
        drafter = MedusaDrafter(heads, target.config.get_text_config().num_hidden_layers, name="medusa-chain")
        folder = args.medusa
    else:
        from draftsmith.eval.runtime.eagle import EagleDrafter
        from draftsmith.heads.eagle import EagleError, load_eagle

        try:
            head = load_eagle(args.eagle, target=target, device=device, dtype=dtype)
        except EagleError as err:
            raise UsageError(str(err)) from None
        drafter = EagleDrafter(head, name="eagle-chain")
        folder = args.eagle
    return target, tokenizer, drafter, folder, heads


def cmd_tune(args) -> int:
    """Measure acceptance at --k-max, the draft cost and v(n); choose with eval/tune.py; check the
    choice with a timed decode; optionally record it (write_setting)."""
    import json

    from draftsmith.eval.runtime.drafters import MedusaDrafter
    from draftsmith.eval.evaluator import EvalSettings, evaluate, load_prompts
    from draftsmith.eval.report import write_atomic
    from draftsmith.eval.sweep import measure_chain
    from draftsmith.eval.tune import compare_prediction, tune_chain, tune_medusa_tree, write_setting

    def settings(k):
        return EvalSettings(
            num_draft_tokens=k, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, repeats=args.repeats, seed=args.seed, ignore_eos=args.ignore_eos, measure_distances=False,
        )  # fmt: skip

    try:
        settings(args.k_max)
    except ValueError as err:
        raise UsageError(str(err)) from None
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    target, tokenizer, drafter, folder, heads = _load_tune(args)
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit)
    eos = _eos(target, tokenizer)
    progress = not args.no_progress
    k_max = args.k_max
    if heads is not None and k_max > heads.config.num_heads:
        print(f"note: {folder} has {heads.config.num_heads} Medusa heads: K is searched up to {heads.config.num_heads}, not {k_max}")
        k_max = heads.config.num_heads
    budgets = args.tree_budgets or [4, 8, 16, 32]
    accuracies = getattr(heads.config, "head_accuracies", None) if heads is not None else None
    if heads is not None and not accuracies:
        print(f"note: {folder} records no head accuracies (train it with train/medusa.py): the tree size is not tuned")

    measured = measure_chain(
        target, drafter, prompts, k_max, settings(k_max), eos_token_id=eos, progress=progress,
        verify_sizes=[b + 1 for b in budgets] if accuracies else (),
    )  # fmt: skip
    try:
        draft_seconds = measured.draft_seconds
    except ValueError as err:  # e.g. every prompt one token long: nothing to draft from
        raise UsageError(f"--prompts {args.prompts}: {err}") from None
    verify = ", ".join(f"v({n}) {1000 * v:.3f}" for n, v in measured.verify_seconds.items())
    print(f"== {drafter.name}: K = {k_max} on {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"{settings(k_max).sampling.describe()}: tau {measured.tau:.2f} (counts the bonus token), alpha per position "
          + " ".join("-" if a is None else f"{a:.2f}" for a in measured.alpha_per_position))  # fmt: skip
    cost = f"{measured.draft_ms_per_step:.3f} ms per step" if measured.per_step else f"{measured.draft_ms_per_token:.3f} ms per drafted token"
    print(f"draft cost {cost}; verify cost (ms, medians, device-synchronised): {verify}")
    tunings = {"chain": tune_chain(measured.alpha_per_position, draft_seconds, measured.verify_seconds)}
    print("\n" + tunings["chain"].table())
    if accuracies:
        tunings["medusa-tree"] = tune_medusa_tree(accuracies, budgets, measured.verify_seconds, draft_seconds=draft_seconds(1))
        print("\n" + tunings["medusa-tree"].table())
    kind = max(tunings, key=lambda k: tunings[k].best.speedup)  # the chain first: a tie keeps it
    tuning = tunings[kind]
    setting = tuning.setting()
    k = setting["num_speculative_tokens"]
    print(f"\nchosen: {kind} {tuning.best.label}, predicted speedup {tuning.best.speedup:.2f}x (tau {tuning.best.tau:.2f})")
    check, speedup = None, None
    if k == 0:
        print("no setting beats target-only decoding on these measured costs: serve without this drafter")
    else:
        chosen = drafter
        if kind == "medusa-tree":
            layers = target.config.get_text_config().num_hidden_layers
            chosen = MedusaDrafter(heads, layers, tree=[tuple(p) for p in setting["tree"]], name="medusa-tree")
        report = evaluate(target, {chosen.name: chosen}, prompts, settings(k), eos_token_id=eos, progress=progress)
        speedup = report["methods"][1]["speedup"]
        check = compare_prediction(tuning.best.speedup, speedup)
        print(f"check at {tuning.best.label} ({args.repeats} timed passes): {check.sentence}")
    if out is not None:
        from draftsmith.eval.plots import plot_speedup_vs_k

        record = {
            "drafter": {"folder": str(folder), "name": drafter.name},
            "target": str(args.target),
            "prompts_file": str(args.prompts),
            "num_prompts": len(prompts),
            "measurement": measured.to_dict(),
            "tunings": {name: {"candidates": t.rows(), "chosen": t.setting(), "model": t.model, "notes": t.notes} for name, t in tunings.items()},
            "chosen": setting,
            "measured_speedup": speedup,
            "measured_over_predicted": None if check is None else check.ratio,
        }
        write_atomic(out / "tuning.json", json.dumps(record, indent=2) + "\n")
        figures = []
        for name, t in tunings.items():
            label, axis = (drafter.name, "k") if name == "chain" else (name, "nodes")
            x = k if name == "chain" else setting.get("num_nodes")
            point = {label: {x: speedup}} if speedup is not None and name == kind else None
            figures.append(plot_speedup_vs_k({label: t}, out / f"speedup_vs_{axis}.png", measured=point))
        print(f"wrote {out / 'tuning.json'} and {', '.join(str(f) for f in figures)}")
    if args.write:
        if k == 0:
            print(f"draftsmith tune: --write: nothing recorded in {folder}/config.json: no K beats target-only decoding", file=sys.stderr)
            return 1
        try:
            path = write_setting(folder, tuning)
        except ValueError as err:
            raise UsageError(f"--write: {err}") from None
        print(f"recorded {json.dumps({key: setting[key] for key in setting if key != 'tree'})} in {path}")
    return 0


def cmd_check_lossless(args) -> int:
    from draftsmith.eval.lossless import check_lossless

    target, tokenizer, drafters, _, _ = _load(args)
    if tokenizer is None:
        raise UsageError(f"--target {args.target!r} has no tokenizer to encode --prompt")
    prompt = torch.tensor(tokenizer(args.prompt).input_ids, dtype=torch.long)
    if prompt.numel() == 0:
        raise UsageError("--prompt tokenizes to nothing")
    failed = False
    for name, drafter in drafters.items():
        path = "compiled" if args.compile else "static cache" if args.static_cache else "default"
        print(f"== {name}: K = {args.num_draft_tokens}, T = {args.temperature:g}, top_k = {args.top_k}, top_p = {args.top_p:g}, "
              f"batch {args.batch_size}, {path} path")  # fmt: skip
        result = check_lossless(
            target,
            drafter,
            prompt,
            num_draft_tokens=args.num_draft_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            samples=args.samples,
            seed=args.seed,
            threshold=args.threshold,
            progress=not args.no_progress,
            batch_size=args.batch_size,
            static_cache=args.static_cache,
            compile=args.compile or False,
        )
        print(result.describe())
        failed |= not result.passed
    return 1 if failed else 0


def _heads_kind(folder) -> str:
    """medusa or eagle, read as `draftsmith push` reads it (any layout draftsmith writes)."""
    import json

    from draftsmith.eval.publish import HubError, artifact_kind

    config = Path(folder) / "config.json"
    if not config.is_file():
        raise UsageError(f"{str(folder)!r} has no config.json: not a folder of trained heads")
    try:
        kind = artifact_kind(json.loads(config.read_text(encoding="utf-8")), where=str(config))
    except HubError as err:
        raise UsageError(str(err)) from None
    if kind == "draft":
        raise UsageError(f"{str(folder)!r} holds a draft model, not heads: export takes Medusa or EAGLE heads (a draft model is served as it is)")
    return kind


def cmd_export(args) -> int:
    from draftsmith.heads.models import load_causal_lm, parse_dtype, resolve_device

    device = resolve_device(args.device)
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype)
    if _heads_kind(args.heads) == "eagle":
        from draftsmith.heads.eagle import EXPORT_FORMATS, EagleError, export_eagle, load_eagle

        if args.format not in EXPORT_FORMATS:
            raise UsageError(f"--format {args.format!r}: EAGLE heads export to {', '.join(EXPORT_FORMATS)}")
        try:
            head = load_eagle(args.heads, device=device, dtype=dtype)
            out = export_eagle(head, args.out, args.format, num_speculative_tokens=args.num_speculative_tokens, overwrite=args.overwrite)
        except EagleError as err:
            raise UsageError(str(err)) from None
        print(f"wrote {args.format} {head.config.version} head (aux layers {list(head.config.aux_layer_ids)}, draft vocabulary {head.config.draft_vocab_size}) to {out}")
        return 0
    from draftsmith.heads.medusa import EXPORT_FORMATS, MedusaError, export_medusa, load_medusa

    if args.format not in EXPORT_FORMATS:
        raise UsageError(f"--format {args.format!r}: Medusa heads export to {', '.join(EXPORT_FORMATS)}")
    target = load_causal_lm(args.target, device=device, dtype=dtype or torch.float32, role="target") if args.target else None
    try:
        heads = load_medusa(args.heads, target=target, device=device, dtype=dtype)
        out = export_medusa(heads, args.out, args.format, overwrite=args.overwrite)
    except MedusaError as err:
        raise UsageError(str(err)) from None
    print(f"wrote {args.format} Medusa heads ({heads.config.num_heads} heads x {heads.config.num_layers} blocks) to {out}")
    return 0


def cmd_push(args) -> int:
    """Stage the run (weights as safetensors, config, card, recipe, run info) and upload it; the
    token comes from HF_TOKEN or `hf auth login` and is never printed."""
    from draftsmith.eval.publish import HubError, check_repo_id, find_eval_report, local_eval_command, push, stage_run

    if args.dry_run and not args.out:
        raise UsageError("--dry-run writes what would be pushed to --out DIR: give --out")
    if args.out and not args.dry_run:
        raise UsageError("--out applies to --dry-run (a push stages in a temporary folder): add --dry-run")
    try:
        check_repo_id(args.repo_id)
        options = {"format": args.format, "eval_report": args.eval_report, "base_model": args.base_model, "revision": args.revision}
        if args.dry_run:
            out = stage_run(args.run, args.out, repo_id=args.repo_id, **options)
            files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
            print(f"staged {len(files)} files for {args.repo_id} in {out}/ (nothing pushed): {', '.join(files)}")
        else:
            url = push(args.run, args.repo_id, private=args.private, endpoint=args.endpoint, commit_message=args.commit_message, **options)
            print(f"pushed {args.run} to {url}")
        if args.eval_report is None and find_eval_report(args.run) is None:
            print(f"not evaluated (the card says so); measure it, then push again:\n  {local_eval_command(args.run)}")
    except HubError as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_make_toy(args) -> int:
    import shutil
    import tempfile

    from draftsmith.heads.toy import FAMILIES, write_toy

    if args.family not in FAMILIES:
        raise UsageError(f"--family {args.family!r}: expected one of {', '.join(FAMILIES)}")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise UsageError(f"--out {str(out)!r} already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination, then rename: an interrupted run leaves no half-written pair.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_toy(tmp, family=args.family, seed=args.seed)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote a toy {args.family} target/draft pair (random weights) and prompts to {out}/")
    print(f"next: draftsmith eval --target {out}/target --draft {out}/draft --prompt-lookup --prompts {out}/prompts.jsonl --out {out}/eval")
    return 0


def cmd_demo(args) -> int:
    from draftsmith.scripts.demo import QUICK, DemoSettings, run_demo, with_overrides
    from draftsmith.scripts.demo_target import DemoTargetError

    try:
        settings = with_overrides(
            QUICK if args.quick else DemoSettings(),
            preset=args.preset,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=args.num_draft_tokens,
            repeats=args.repeats,
            temperature=args.temperature,
            compile=args.compile,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        run_demo(
            settings, out=args.out, cache_dir=args.cache_dir, device=args.device, dtype=args.dtype,
            force_build=args.rebuild, progress=not args.no_progress,
        )  # fmt: skip
    except DemoTargetError as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        print("draftsmith demo: interrupted; nothing half-built was cached (an unfinished target build is removed)", file=sys.stderr)
        return 130
    return 0


def cmd_build_target(args) -> int:
    from draftsmith.scripts.demo_target import run_build

    try:
        return run_build(args)
    except KeyboardInterrupt:
        print("draftsmith build-target: interrupted; the partial build was removed, nothing was cached", file=sys.stderr)
        return 130


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    from draftsmith.eval.evaluator import PromptFileError
    from draftsmith.heads.models import ModelLoadError

    args = build_parser().parse_args(argv)
    if getattr(args, "no_progress", False) or args.command == "make-toy":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (UsageError, PromptFileError, ModelLoadError) as err:
        print(f"draftsmith {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
