"""A `draftsmith generate` run: the dataset folder made, resumed and finished around the
generation loop of distill/generate.py.

    draftsmith generate --target DIR --prompts SRC --out DIR [--max-new-tokens 512]
                        [--temperature 0 --top-p 1] [--num-samples 1] [--batch-size 8]
                        [--chat-template auto|none|FILE]

Work is split into shards of `shard_size` samples. A shard is generated with its own seed
(seed * 1_000_003 + shard index), written to a temporary folder and renamed into place, so a
re-run skips complete shards and ends with exactly the data an uninterrupted run makes; it
resumes only with the provenance the folder records (target, tokenizer, template, source,
settings, generator), anything else is an error.
Under `accelerate launch` process r of N makes the shards k = r mod N (by index, whatever is done):
no two write one shard, N make the data hash of one; the main one writes provenance and summary.

Bad input is an error before anything is written: an --out that cannot be written (checked
before the model is loaded), non-finite weights, a source none of whose prompts fits in
max_length. A run that fails before its first shard is complete removes what it made; one
interrupted later keeps its folder to be resumed.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from draftsmith.distill import data as store
from draftsmith.distill.chat import check_template, template_hash
from draftsmith.distill.generate import (
    GenerateSettings,
    NonFiniteLogits,
    check_prompts_fit,
    generate_shard,
    stop_token_ids,
)
from draftsmith.distill.sources import Source
from draftsmith.distill.summary import finish
from draftsmith.heads.artifacts import check_finite_weights, check_writable_folder


def check_out_folder(out) -> None:
    """--out is a new folder, an empty one or a draftsmith data folder (to resume), and can be
    written: checked before any model is loaded (a probe folder is made in it and removed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise store.DataError(f"--out {str(out)!r} exists and is not a folder; choose a folder path")
    is_data = (out / store.SUMMARY).is_file() or (out / store.PROVENANCE).is_file()
    if out.is_dir() and not is_data and any(out.iterdir()):
        raise store.DataError(f"--out {str(out)!r} exists and is not a draftsmith data folder; choose a new folder")
    check_writable_folder(out, "--out", store.DataError)


def provenance(
    model,
    tokenizer,
    target_path,
    source: Source,
    template: str | None,
    template_spec: str,
    settings: GenerateSettings,
    max_length: int,
    stop_ids: list[int],
    dtype,
) -> dict:
    from draftsmith.heads.models import describe_model, tokenizer_fingerprint

    return {
        "kind": "draftsmith self-distillation data",
        "format_version": 1,
        "target": describe_model(target_path, model) | {"dtype": str(dtype).removeprefix("torch.")},
        "tokenizer_hash": tokenizer_fingerprint(tokenizer),
        "chat_template": {"spec": template_spec, "used": template is not None, "hash": template_hash(template)},
        "source": {
            "name": source.name,
            "format": source.format,
            "records": len(source.records),
            "fingerprint": source.fingerprint,
        },
        "settings": asdict(settings) | {"max_length": max_length},
        "stop_token_ids": stop_ids,
    }


# Keys that must agree for a re-run to resume into an existing folder.
_RESUME_KEYS = ("target", "tokenizer_hash", "chat_template", "source", "settings", "stop_token_ids", "generator")


def _check_resumable(out: Path, prov: dict) -> None:
    old = store.read_json(out / store.PROVENANCE, "existing provenance")
    differ = [k for k in _RESUME_KEYS if old.get(k) != prov.get(k)]
    if differ:
        raise store.DataError(
            f"--out {str(out)!r} holds data made with other {', '.join(differ)}; "
            "resume only with the same arguments, or choose a new --out"
        )


def generate_dataset(
    model,
    tokenizer,
    source: Source,
    out_dir,
    settings: GenerateSettings,
    *,
    template: str | None,
    template_spec: str = "auto",
    target_path: str = "",
    dtype=None,
    progress: bool = True,
    log=print,
    backend=None,
    state=None,
) -> dict:
    """Generate (or finish) the dataset in `out_dir`; returns the summary (None but in the main process
    of `state`, an accelerate PartialState). With `backend` (an `EndpointBackend`) a server answers."""
    out = Path(out_dir)
    rank, processes = (state.process_index, state.num_processes) if state is not None else (0, 1)
    if rank == 0:  # its probe folder would look like foreign content to a second checker
        check_out_folder(out)
    text_config = model.config.get_text_config()
    max_length = settings.max_length or getattr(text_config, "max_position_embeddings", None) or 4096
    if source.format == "input_ids":
        raise store.DataError(
            f"{source.name!r} holds pre-tokenised input_ids: generation needs text prompts or conversations "
            '(rows with "prompt", "messages", "conversations" or "turns")'
        )
    if template is None and source.format != "prompt":
        raise store.DataError(
            f"{source.name!r} holds {source.format} conversations but no chat template is in use "
            "(the tokenizer has none, or --chat-template none): pass --chat-template FILE"
        )
    if template is not None:
        first = source.records[0]
        check_template(
            tokenizer,
            template,
            list(first.messages) if first.messages is not None else [{"role": "user", "content": first.prompt}],
        )
    check_prompts_fit(source, tokenizer, template, max_length, explicit=settings.max_length is not None)
    try:
        check_finite_weights(model, target_path, "--target", store.DataError)
    except store.DataError as err:
        raise store.DataError(f"{err}; nothing was written") from None
    stop_ids = stop_token_ids(model, tokenizer, template)
    prov = provenance(
        model,
        tokenizer,
        target_path,
        source,
        template,
        template_spec,
        settings,
        max_length,
        stop_ids,
        dtype or model.dtype,
    )
    if backend is not None:
        prov |= backend.provenance()
    if (out / store.SUMMARY).is_file() or (out / store.PROVENANCE).is_file():
        _check_resumable(out, prov)
    fresh = not (out / store.PROVENANCE).is_file()  # this call starts the folder
    made = _first_missing(out)
    if rank == 0:  # one process cleans and starts the folder while the others wait
        (out / store.SHARDS).mkdir(parents=True, exist_ok=True)
        store.remove_stale_temporaries(out / store.SHARDS)
        store.remove_stale_temporaries(out)
        if fresh:
            store.write_json_atomic(out / store.PROVENANCE, prov)
    if processes > 1:
        state.wait_for_everyone()

    items = [(record, s) for record in source.records for s in range(settings.num_samples)]
    num_shards = (len(items) + settings.shard_size - 1) // settings.shard_size
    done = {p.name for p in store.complete_shards(out)}
    todo = [k for k in range(rank, num_shards, processes) if store.shard_name(k) not in done]
    if done and rank == 0:
        log(f"resuming: {len(done)} of {num_shards} shards already complete")
    bar = None
    if progress and todo and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=sum(len(items[k * settings.shard_size : (k + 1) * settings.shard_size]) for k in todo),
            desc="generate",
            unit="turn",
        )
    k = None
    try:
        for k in todo:
            chunk = items[k * settings.shard_size : (k + 1) * settings.shard_size]
            torch.manual_seed(settings.seed * 1_000_003 + k)  # each shard its own stream: resumable
            start = time.perf_counter()
            rows, stats = generate_shard(
                model,
                tokenizer,
                chunk,
                template,
                settings,
                max_length=max_length,
                stop_ids=stop_ids,
                progress=bar,
                backend=backend,
            )
            stats["seconds"] = _synchronized_elapsed(model.device, start)
            stats["device"] = str(model.device) if backend is None else backend.describe()
            stats["process"] = rank
            store.write_shard(rows, stats, out / store.SHARDS / store.shard_name(k))
    except Exception as err:
        # A first run that fails before any shard is complete leaves nothing (there is nothing
        # to resume); an interrupted one (KeyboardInterrupt) keeps its folder to be resumed.
        removed = fresh and rank == 0 and not store.complete_shards(out)
        if removed:
            _remove_started(out, made)
        if isinstance(err, NonFiniteLogits):
            kept = (
                "nothing was written"
                if removed
                else (f"the complete shards are kept in {str(out)!r} (other settings need a new --out)")
            )
            raise NonFiniteLogits(
                f"--target {target_path!r}: {err} while generating {store.shard_name(k)}: {_overflow_hint(model)}; {kept}"
            ) from None
        raise
    finally:
        if bar is not None:
            bar.close()
    if rank != 0:
        return None  # the main process writes the summary once every shard is on disk
    while processes > 1 and len(store.complete_shards(out)) < num_shards:  # polled: no collective to time out
        time.sleep(1.0)
    return finish(out, vocab_size=model.get_output_embeddings().weight.shape[0], num_shards=num_shards, log=log)


def _overflow_hint(model) -> str:
    dtype = model.dtype
    if dtype == torch.float16:
        return "float16 overflows past 65504: try --dtype bfloat16 or float32"
    if dtype == torch.float32:
        return "its weights are finite, so the forward itself breaks even in float32: check the target's checkpoint"
    return (
        f"its weights are finite, so the forward overflows in {str(dtype).removeprefix('torch.')}: try --dtype float32"
    )


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what mkdir(parents=True) makes)."""
    made = None
    while not path.exists():
        made, path = path, path.parent
    return made


def _remove_started(out: Path, made: Path | None) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
    else:  # --out existed, empty: leave it empty
        shutil.rmtree(out / store.SHARDS, ignore_errors=True)
        (out / store.PROVENANCE).unlink(missing_ok=True)


def _synchronized_elapsed(device, start: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
