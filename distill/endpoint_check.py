"""Does a serving engine give the data local generation gives? One run, both ways, compared.

    report = check_endpoint(EndpointCheckJob(target="runs/toy/target", prompts="runs/toy/prompts.jsonl",
                                             out="runs/endpoint-check"))
    print(describe_check(report))

Greedy data is made twice on the same prompts: locally (`--batch-size`, left-padded batches)
and through an endpoint (`--concurrency` requests in flight), by default `transformers serve` on
the target started here (`distill/local_server.py`). Samples are matched by (record, sample)
and sorted into: token-identical; the same answer text but other ids (the server returned text
and its retokenization splits it differently from how the target generated it); a different
answer (the first differing position is kept: numerics of another batch shape or dtype, or a
different stop); missing on one side. Throughput is each run's generated tokens per second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EndpointCheckJob:
    target: str  # local target folder (served as is unless `endpoints` are given)
    prompts: str  # prompt source, as for `draftsmith generate`
    out: str  # folder: local/ and endpoint/ data, report.json
    limit: int = 64  # prompts
    max_new_tokens: int = 64
    batch_size: int = 16  # local generation
    concurrency: int = 8  # requests in flight to the endpoint
    endpoints: tuple[str, ...] = ()  # empty: start `transformers serve` on the target
    continuous_batching: bool = False  # `transformers serve --continuous-batching` (else one request at a time)
    chat_template: str = "auto"
    device: str = "auto"
    dtype: str = "auto"


def check_endpoint(job: EndpointCheckJob) -> dict:
    """Generate locally and through the endpoint, compare; writes and returns the report."""
    from draftsmith.distill.data import DistillData, write_json_atomic
    from draftsmith.distill.endpoint import EndpointSettings
    from draftsmith.distill.generate import GenerateSettings
    from draftsmith.distill.jobs import GenerateJob, run_generate
    from draftsmith.distill.local_server import serve_transformers
    from draftsmith.heads.models import resolve_device, resolve_dtype

    out = Path(job.out)
    settings = GenerateSettings(max_new_tokens=job.max_new_tokens, batch_size=job.batch_size, shard_size=job.limit)
    common = dict(
        target=job.target,
        prompts=job.prompts,
        settings=settings,
        limit=job.limit,
        chat_template=job.chat_template,
        device=job.device,
        dtype=job.dtype,
        progress=False,
    )
    local = run_generate(GenerateJob(out=str(out / "local"), **common))
    stop_ids = DistillData(out / "local").provenance["stop_token_ids"]

    def through(urls):
        endpoint = EndpointSettings(urls=tuple(urls), concurrency=job.concurrency, retries=2)
        return run_generate(GenerateJob(out=str(out / "endpoint"), endpoint=endpoint, **common))

    if job.endpoints:
        remote = through(job.endpoints)
    else:
        device = resolve_device(job.device)
        dtype = str(resolve_dtype(job.dtype, device)).removeprefix("torch.")
        with serve_transformers(
            job.target,
            device=str(device),
            dtype=dtype,
            stop_token_ids=stop_ids,
            continuous_batching=job.continuous_batching,
        ) as server:
            remote = through([server.url])
    report = compare_data(out / "local", out / "endpoint") | {
        "local_tokens_per_second": local["generated_tokens_per_second"],
        "endpoint_tokens_per_second": remote["generated_tokens_per_second"],
        "local_batch_size": job.batch_size,
        "endpoint_concurrency": job.concurrency,
        "server": list(job.endpoints) or "transformers serve" + (" --continuous-batching" * job.continuous_batching),
    }
    write_json_atomic(out / "report.json", report)
    return report


def compare_data(local_dir, endpoint_dir) -> dict:
    """Sort the samples of two data folders (same prompts) by how they differ."""
    from draftsmith.distill.data import DistillData
    from draftsmith.heads.models import load_tokenizer

    local, remote = DistillData(local_dir), DistillData(endpoint_dir)
    tokenizer = load_tokenizer(local.provenance["target"]["path"])
    a = {(r["record_index"], r["sample_index"]): r for r in local.dataset}
    b = {(r["record_index"], r["sample_index"]): r for r in remote.dataset}
    kinds = {"identical": 0, "same_text_other_ids": 0, "different_answer": 0, "missing": 0}
    by_source: dict[str, dict[str, int]] = {}
    examples = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            kinds["missing"] += 1
            continue
        x, y = a[key], b[key]
        if x["input_ids"] == y["input_ids"] and x["loss_mask"] == y["loss_mask"]:
            kind = "identical"
        else:
            p = x["prompt_length"]
            same_text = x["input_ids"][:p] == y["input_ids"][: y["prompt_length"]] and (
                tokenizer.decode(x["input_ids"][p:]) == tokenizer.decode(y["input_ids"][y["prompt_length"] :])
            )
            kind = "same_text_other_ids" if same_text else "different_answer"
            if len(examples) < 5:
                pairs = zip(x["input_ids"], y["input_ids"])
                first = next((i for i, (s, t) in enumerate(pairs) if s != t), min(x["length"], y["length"]))
                examples.append(
                    {
                        "record_index": key[0],
                        "kind": kind,
                        "first_difference_at": first,
                        "prompt_length": p,
                        "finish": [x["finish_reason"], y["finish_reason"]],
                    }
                )
        kinds[kind] += 1
        source = by_source.setdefault(y["token_source"], {})
        source[kind] = source.get(kind, 0) + 1
    total = sum(kinds.values())
    return {
        "samples": total,
        "identical_share": kinds["identical"] / total if total else 0.0,
        "kinds": kinds,
        "by_token_source": by_source,
        "examples": examples,
        "local_data_hash": local.data_hash,
        "endpoint_data_hash": remote.data_hash,
    }


def describe_check(report: dict) -> str:
    k = report["kinds"]
    lines = [
        f"samples             {report['samples']}",
        f"token-identical     {k['identical']} ({100 * report['identical_share']:.1f}%)",
        f"same text, other ids {k['same_text_other_ids']} (the server's text retokenized differently)",
        f"different answer    {k['different_answer']}",
        f"missing on one side {k['missing']}",
        f"by token source     {json.dumps(report['by_token_source'])}",
        f"throughput          local batch {report['local_batch_size']}: "
        f"{report['local_tokens_per_second']:.0f} tokens/s; endpoint ({report['server']}) at concurrency "
        f"{report['endpoint_concurrency']}: {report['endpoint_tokens_per_second']:.0f} tokens/s",
    ]
    return "\n".join(lines)
