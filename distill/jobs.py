"""The data jobs of the `draftsmith` command, end to end: what comes from the target.

    run_generate(GenerateJob(target="t", prompts="p.jsonl", out="data", settings=GenerateSettings()))
    print(inspect_sample("data", index=0, color=False))
    make_vocab_map("data", draft_vocab_size=1024)
    run_cache_hidden(CacheHiddenJob(target="t", data="data", layers="2,mid,-3", out="cache"))

Bad input raises the concern's own error (SourceError, ChatTemplateError, DataError, CacheError,
VocabMapError, ModelLoadError), each naming the file, flag or value and what was expected.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.distill.endpoint import EndpointSettings
from draftsmith.distill.generate import GenerateSettings


@dataclass(frozen=True)
class GenerateJob:
    target: str  # folder of the target (HF format, with its tokenizer)
    prompts: str  # JSONL/JSON/parquet/CSV file, a `datasets` folder, or a hub dataset name
    out: str  # output folder (a re-run with the same job resumes it)
    settings: GenerateSettings
    split: str = "train"
    limit: int | None = None
    chat_template: str = "auto"  # auto (the tokenizer's, if any), none (raw prompts), or a Jinja file
    device: str = "auto"
    dtype: str = "auto"
    progress: bool = True
    endpoint: EndpointSettings | None = None  # a serving engine answers; the target gives tokenizer and fingerprint


def run_generate(job: GenerateJob) -> dict | None:
    """Self-distillation data: the target answers the prompts itself. Returns the summary (None
    in the processes other than the main one under `accelerate launch`: they split the shards)."""
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.distill.data import DataError
    from draftsmith.distill.generate import stop_token_ids
    from draftsmith.distill.generate_run import check_out_folder, generate_dataset
    from draftsmith.distill.sources import load_source
    from draftsmith.distill.summary import describe_summary
    from draftsmith.heads.models import ModelLoadError, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    device = resolve_device(job.device)
    state = launched_state(cpu=device.type == "cpu")
    if state is None or state.is_main_process:  # one checker: another's probe folder looks like foreign content
        check_out_folder(job.out)  # before anything slow: a run must not die at its first write
    if state is not None and job.endpoint is not None:
        raise DataError(
            f"--endpoint under {state.num_processes} processes: the client spreads requests itself; launch one"
        )
    if state is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", state.local_process_index)  # one GPU per process
    dtype = resolve_dtype(job.dtype, device)
    check_target(job.target)
    tokenizer = load_tokenizer(job.target)
    if tokenizer is None:
        raise ModelLoadError(f"--target {job.target!r} has no tokenizer: generation needs one to read the prompts")
    source = load_source(job.prompts, split=job.split, limit=job.limit)
    template = resolve_chat_template(job.chat_template, tokenizer)
    client = backend = None
    if job.endpoint is not None:  # before the model load: a down endpoint or another model fails at once
        from draftsmith.distill.endpoint import EndpointBackend, EndpointClient

        client = EndpointClient(job.endpoint)
    try:
        model = load_causal_lm(job.target, device=device, dtype=dtype, role="target")
        if client is not None:
            stops = stop_token_ids(model, tokenizer, template)
            backend = EndpointBackend(client, tokenizer, template, job.settings, stops)
        summary = generate_dataset(
            model,
            tokenizer,
            source,
            job.out,
            job.settings,
            template=template,
            template_spec=job.chat_template,
            target_path=job.target,
            dtype=dtype,
            progress=job.progress,
            backend=backend,
            state=state,
        )
    finally:
        if client is not None:
            (backend or client).close()
    if summary is None:  # another process than the main one: its shards are written
        return None
    print(describe_summary(summary))
    print(f"\nwrote {job.out}/ ; look at a sample with: draftsmith inspect-data {job.out}")
    return summary


def launched_state(cpu: bool):
    """accelerate's PartialState when `accelerate launch` started several processes (torchrun's
    WORLD_SIZE > 1), else None: one process needs no process group. `cpu`: over gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=cpu)


def check_target(target: str) -> None:
    """--target is a model folder (with config.json) or a hub id that can be loaded from here;
    otherwise say which, instead of a failure further on (e.g. "has no tokenizer")."""
    from transformers import AutoConfig

    from draftsmith.heads.models import ModelLoadError, is_hub_id

    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(
                f"--target {target!r} is a file: expected the target's folder (HF format, with config.json)"
            )
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"--target {target!r} has no config.json: expected a folder written by save_pretrained"
            )
        return
    if not is_hub_id(target):
        raise ModelLoadError(
            f"--target {target!r} does not exist: expected the target's folder (HF format, with config.json)"
        )
    try:
        AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            where = "in the local HF cache (HF_HUB_OFFLINE is set)"
        else:  # gated, private or unreachable: the hub's own first line says which
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            where = f"loadable from the Hugging Face Hub ({reason})"
        raise ModelLoadError(
            f"--target {target!r} does not exist: no such folder, and no hub model of that name {where}; "
            "give the target's folder, or a hub id that is cached or reachable"
        ) from None


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


def inspect_sample(data_dir, index: int = 0, color: bool = False) -> str:
    """One sample of generated data, what is trained set apart, below the data's provenance."""
    from draftsmith.distill.data import DataError, DistillData
    from draftsmith.heads.models import load_tokenizer

    data = DistillData(data_dir)
    if len(data) == 0:
        raise DataError(f"{str(data_dir)!r} holds no samples")
    if not -len(data) <= index < len(data):
        raise DataError(f"--index {index} is out of range: {data_dir} has {len(data)} samples (0..{len(data) - 1})")
    prov, summary = data.provenance, data.summary
    target = prov["target"]
    tokenizer = load_tokenizer(target["path"])
    if tokenizer is None:
        raise DataError(f"the target's tokenizer is not at {target['path']!r} any more: cannot decode the sample")
    row = data[index]
    s = prov["settings"]
    template = prov["chat_template"]
    if color:
        legend = f"{_TRAINED[0]}trained{_TRAINED[1]} / {_CONTEXT[0]}context (not trained){_CONTEXT[1]}"
    else:
        legend = f"{_MARKERS[0]}trained{_MARKERS[1]} / context (not trained)"
    lines = [
        f"data      {data.dir}  ({summary['samples']} samples, {summary['tokens']} tokens, {summary['trained_tokens']} trained, {100 * summary['truncation_rate']:.1f}% truncated)",
        f"hash      {data.data_hash}",
        f"target    {target['name_or_path']} (fingerprint {target['fingerprint'][:12]}, {target['dtype']})",
        f"source    {prov['source']['name']} ({prov['source']['format']}, {prov['source']['records']} records)",
        *[f"endpoint  {g['served_model']} at {', '.join(prov['endpoints'])}" for g in [prov.get("generator")] if g],
        f"template  {template['spec']}"
        + (f" (sha256 {template['hash'][:12]})" if template["used"] else " (not used: raw prompts)"),
        f"sampling  T = {s['temperature']:g}, top_p = {s['top_p']:g}, top_k = {s['top_k']}, seed {s['seed']}, "
        f"max_new_tokens {s['max_new_tokens']}, max_length {s['max_length']}, {s['num_samples']} sample(s) per prompt",
        "",
        f"sample {index % len(data)}: record {row['record_index']}, sample {row['sample_index']}, {row['length']} tokens "
        f"({row['prompt_length']} before the last answer), {row['num_trained']} trained, {row['num_turns']} turn(s) generated, "
        f"finish: {row['finish_reason']}, ids: {row.get('token_source', 'local')}",
        f"legend: {legend}",
        "-" * 72,
        render_sample(tokenizer, list(row["input_ids"]), list(row["loss_mask"]), color),
        "-" * 72,
    ]
    return "\n".join(lines)


def make_vocab_map(data_dir, draft_vocab_size: int, out=None) -> Path:
    """A reduced draft vocabulary (distill/vocab.py) from the data's token frequencies; returns the file."""
    from draftsmith.distill.data import DistillData
    from draftsmith.distill.vocab import build_vocab_map, save_vocab_map

    data = DistillData(data_dir)
    vmap = build_vocab_map(data.token_counts(), draft_vocab_size, data.data_hash)
    out = Path(out) if out else data.dir / f"vocab-map-{draft_vocab_size}.safetensors"
    save_vocab_map(vmap, out)
    print(vmap.describe())
    print(f"wrote {out}")
    return out


@dataclass(frozen=True)
class CacheHiddenJob:
    target: str  # the target that generated the data
    data: str  # folder written by `draftsmith generate`
    layers: str  # comma-separated HF hidden_states ids: i, -k (= L-k), mid (= L//2), last
    out: str  # cache folder (a re-run with the same job resumes it)
    dtype: str = "bf16"  # dtype the states are stored in
    model_dtype: str = "auto"  # dtype of the target's forward
    max_disk: str = "50GB"  # refuse to start when the estimate exceeds this
    topk_logits: int = 0  # also store the target's top-k logits per token (0 = off)
    batch_size: int = 8
    shard_size: int = 256  # samples per safetensors file
    device: str = "auto"
    progress: bool = True


def run_cache_hidden(job: CacheHiddenJob) -> dict:
    """Offline hidden states of the chosen target layers for the data; returns the manifest."""
    from transformers import AutoConfig

    from draftsmith.distill.data import DistillData
    from draftsmith.distill.hidden_cache import cache_hidden_states, human_bytes, parse_size, resolve_layers
    from draftsmith.heads.models import (
        load_causal_lm,
        output_vocab_size,
        parse_dtype,
        resolve_device,
        resolve_dtype,
        target_fingerprint,
    )

    device = resolve_device(job.device)
    store_dtype = parse_dtype(job.dtype)
    model_dtype = resolve_dtype(job.model_dtype, device)
    max_disk = parse_size(job.max_disk)
    data = DistillData(job.data)
    config = AutoConfig.from_pretrained(job.target).get_text_config()
    resolve_layers(job.layers, config.num_hidden_layers)  # before the (slow) model load
    output_vocab_size(job.target, "target")
    model = load_causal_lm(job.target, device=device, dtype=model_dtype, role="target")
    if data.provenance["target"]["fingerprint"] != target_fingerprint(model):
        print(
            f"warning: {job.data} was generated by {data.provenance['target']['name_or_path']}, not by this target "
            "(fingerprints differ); the states are still this target's",
            file=sys.stderr,
        )
    manifest = cache_hidden_states(
        model,
        data,
        job.out,
        layers_spec=job.layers,
        dtype=store_dtype,
        max_disk=max_disk,
        batch_size=job.batch_size,
        topk=job.topk_logits,
        shard_size=job.shard_size,
        target_path=job.target,
        progress=job.progress,
    )
    run = manifest.get("last_run") or {}
    print(
        f"layers {manifest['layers']} ({manifest['layers_spec']}), {manifest['dtype']}, {manifest['samples']} samples, {manifest['tokens']} tokens"
    )
    print(
        f"wrote {human_bytes(manifest['bytes'])} ({manifest['bytes'] / max(1, manifest['tokens']):.0f} B/token on disk) to {job.out}"
    )
    if run.get("tokens_per_second"):
        print(
            f"extraction: {run['tokens']} tokens in {run['seconds']:.1f} s ({run['tokens_per_second']:.0f} tokens/s on {run['device']})"
        )
    if run.get("forward_tokens_per_second"):  # the yardstick of the head trainers' train_tokens_per_second
        print(f"target forward alone: {run['forward_tokens_per_second']:.0f} tokens/s ({run['forward_seconds']:.1f} s)")
    return manifest
