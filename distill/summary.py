"""The summary of a generated dataset: statistics, token counts and the data hash over its shards.

Written once, last, by `finish` (by the main process under `accelerate launch`), so a folder with
summary.json is complete; `describe_summary` is its console form.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.distill import data as store


def finish(out: Path, *, vocab_size: int, num_shards: int, log=print) -> dict:
    """Statistics, token counts and the data hash over all shards; summary.json written last."""
    shards = store.complete_shards(out)
    if len(shards) != num_shards:
        raise store.DataError(f"{str(out)!r}: {len(shards)} of {num_shards} shards are complete")
    parts = [store.load_shard(p) for p in shards]
    shard_stats = [store.read_json(p / store.SHARD_STATS, "shard statistics") for p in shards]
    samples = sum(len(p) for p in parts)
    tokens = sum(int(sum(p["length"])) for p in parts)
    trained = sum(int(sum(p["num_trained"])) for p in parts)
    truncated = sum(sum(1 for r in p["finish_reason"] if r == "length") for p in parts)
    skipped: dict[str, int] = {}
    for s in shard_stats:
        for reason, n in s["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
    generated = sum(s["generated_tokens"] for s in shard_stats)
    sources: dict[str, int] = {}
    for p in parts:
        for name in p["token_source"] if "token_source" in p.column_names else ["local"] * len(p):
            sources[name] = sources.get(name, 0) + 1
    seconds = sum(s["seconds"] for s in shard_stats)
    data_hash = store.hash_rows(parts)
    counts = store.count_trained_tokens(parts, vocab_size)
    store.save_token_counts(out / store.TOKEN_COUNTS, counts, data_hash)
    summary = {
        "data_hash": data_hash,
        "num_shards": num_shards,
        "samples": samples,
        "tokens": tokens,
        "trained_tokens": trained,
        "mean_length": tokens / samples if samples else 0.0,
        "truncated": truncated,
        "truncation_rate": truncated / samples if samples else 0.0,
        "skipped": skipped,
        "skipped_examples": [e for s in shard_stats for e in s["skipped_examples"]][:10],
        "turns_dropped": sum(s["turns_dropped"] for s in shard_stats),
        "generated_tokens": generated,
        "generation_seconds": seconds,
        "generated_tokens_per_second": generated / seconds if seconds else None,
        "distinct_trained_tokens": int((counts > 0).sum()),
        "token_sources": sources,
    }
    store.write_json_atomic(out / store.SUMMARY, summary)
    if samples == 0:
        log(f"warning: no samples were generated ({skipped or 'empty source'})")
    return summary


def describe_summary(summary: dict) -> str:
    skipped = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in summary["skipped"].items()) or "none"
    rate = summary["generated_tokens_per_second"]
    return "\n".join(
        [
            f"samples          {summary['samples']} in {summary['num_shards']} shard(s); skipped: {skipped}",
            f"tokens           {summary['tokens']} ({summary['trained_tokens']} trained = under the loss mask); mean length {summary['mean_length']:.1f}",
            f"truncated        {summary['truncated']} ({100 * summary['truncation_rate']:.1f}%) cut at --max-new-tokens, kept and flagged",
            f"generation       {summary['generated_tokens']} tokens in {summary['generation_seconds']:.1f} s"
            + (f" ({rate:.0f} tokens/s)" if rate else ""),
            f"data hash        {summary['data_hash']}",
        ]
    )
