"""The three A on a real engine: a load test of a running OpenAI-compatible server (vLLM, SGLang,
TGI, `transformers serve`), reported in the columns of the simulated serving sweep.

    draftsmith eval --endpoint http://localhost:8000 --target T --prompts P.jsonl --out runs/engine \\
        --concurrency 1,2,4,8 --requests 32 --level-seconds 120 --latency-target 5 \\
        [--drafter KIND=DIR]                 # also draftsmith's own acceptance of the served head
        [--compare-serving runs/serving/serving.json]   # the simulated sweep beside it

How it measures (closed loop): at each concurrency level c, c clients each send one streamed
/v1/completions request, and the next as soon as theirs is answered, cycling the prompts, until
`requests` answers (at least c) or until `level_seconds` have passed (no new request after
that; the ones in flight finish). One untimed request warms the server up first. Per request:
TTFT = send -> first streamed text, latency = send -> last event, output tokens = the server's
usage count (streamed text events where it gives none). Per level: latency and TTFT p50/p90/p99,
tokens/s and req/s = everything answered / (first send -> last answer).
Capacity at the latency target: the measured level with the most req/s whose latency
percentile is within the target (levels are measured points, not a search).

Speculative decoding on the server: its Prometheus `/metrics` is read before and after the
load (`prometheus.py`); vLLM's counters give the served mean acceptance length and acceptance
per position, set beside draftsmith's batch-1 measurement of a head on the same prompts when a
drafter (`--drafter KIND=DIR`) is given. The counters count all the server's traffic in that
window. A server without them is said so in one line; the load part is reported alone.

Simulated beside it (`--compare-serving`): each method of a sweep's serving.json, rebuilt as a
`StepProfile`, runs the same closed loop in the simulator: the requests all queue at t = 0
with max batch c, and latency counts from admission (a closed-loop client sends when a slot
frees). Files: OUT/engine.json, OUT/engine.md, OUT/engine.html (written atomically).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.distill.endpoint import EndpointClient, EndpointError, EndpointSettings
from draftsmith.eval.serving.profile import StepProfile, _check_batch, _is_number
from draftsmith.eval.serving.prometheus import parse_exposition, served_acceptance, spec_decode_counters
from draftsmith.eval.serving.simulator import Request, simulate
from draftsmith.eval.stats import percentile

ENGINE_FILES = ("engine.json", "engine.md", "engine.html")
LEVELS = (1, 2, 4, 8)  # concurrency levels: up to a typical small server batch
WARMUP_TOKENS = 8  # the untimed first request: loads kernels and caches on the server


@dataclass(frozen=True)
class LoadSettings:
    concurrency: tuple[int, ...] = LEVELS
    requests: int = 32  # answers per level (at least the level): p90 rests on ~3 of 32
    level_seconds: float = 120.0  # no new request after this long in a level: bounds a slow server
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False  # sent as vLLM's `ignore_eos` (fixed-length answers); others may ignore it
    latency_target_s: float | None = None  # None: no capacity at a target
    percentile: float = 90.0
    seed: int = 0

    def __post_init__(self):
        levels = list(self.concurrency)
        if not levels:
            raise ValueError("--concurrency is empty; expected levels, e.g. 1,2,4,8")
        for c in levels:
            _check_batch(c, "concurrency")
        if len(set(levels)) != len(levels):
            raise ValueError(f"--concurrency {levels} repeats a level; give each once")
        object.__setattr__(self, "concurrency", tuple(sorted(levels)))
        if not isinstance(self.requests, int) or self.requests < 1:
            raise ValueError(f"--requests {self.requests!r}; expected an int >= 1")
        if not _is_number(self.level_seconds) or self.level_seconds <= 0:
            raise ValueError(f"--level-seconds {self.level_seconds!r}; expected seconds > 0")
        if self.latency_target_s is not None and (not _is_number(self.latency_target_s) or self.latency_target_s <= 0):
            raise ValueError(f"--latency-target {self.latency_target_s!r}; expected seconds > 0")
        if not _is_number(self.percentile) or not 0 < self.percentile <= 100:
            raise ValueError(f"--percentile {self.percentile!r}; expected a number in (0, 100]")


# ---------------------------------------------------------------------- one request, one level
@dataclass(frozen=True)
class Answered:
    sent_s: float  # time.perf_counter() stamps
    first_token_s: float
    finish_s: float
    output_tokens: int
    tokens_from: str  # "usage" (the server's count) or "events" (streamed text events)


def _request(client: EndpointClient, prompt, settings: LoadSettings, seed: int, max_tokens: int) -> Answered:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": settings.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    sent = time.perf_counter()
    out = client.post("/v1/completions", body, retry=False)
    finish = time.perf_counter()
    chunks, times = out.get("chunks", [out]), out.get("chunk_times", [finish])
    texts = [i for i, c in enumerate(chunks) if any(ch.get("text") for ch in c.get("choices") or [])]
    for c in chunks:
        if c.get("error"):
            raise EndpointError(f"the endpoint failed mid-answer: {str(c['error'])[:200]}")
    first = times[texts[0]] if texts else finish
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    if usage and usage.get("completion_tokens") is not None:
        return Answered(sent, first, finish, int(usage["completion_tokens"]), "usage")
    return Answered(sent, first, finish, len(texts), "events")


@dataclass
class Level:
    concurrency: int
    answered: list[Answered] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stopped_by: str = "requests"  # or "time": --level-seconds ran out first

    def summary(self, percentiles: Sequence[float] = ()) -> dict:
        """The level's aggregates, JSON-ready: latency and TTFT at p50, p90, p99 and `percentiles`."""
        a = self.answered
        span = max(r.finish_s for r in a) - min(r.sent_s for r in a)
        tokens = sum(r.output_tokens for r in a)
        out = {
            "concurrency": self.concurrency,
            "requests": len(a),
            "errors": len(self.errors),
            "stopped_by": self.stopped_by,
            "output_tokens": tokens,
            "seconds": span,
            "tokens_per_s": tokens / span,
            "requests_per_s": len(a) / span,
            "tokens_from": sorted({r.tokens_from for r in a}),
        }
        _add_percentiles(out, [r.finish_s - r.sent_s for r in a], [r.first_token_s - r.sent_s for r in a], percentiles)
        return out


def _add_percentiles(out: dict, latencies, ttfts, extra: Sequence[float]) -> None:
    qs = sorted({50, 90, 99, *extra})
    out.update({f"latency_s_p{q:g}": percentile(latencies, q) for q in qs})
    out.update({f"ttft_s_p{q:g}": percentile(ttfts, q) for q in qs})


def measure_level(
    client: EndpointClient, prompts: Sequence, concurrency: int, settings: LoadSettings, offset: int = 0
) -> Level:
    """`concurrency` closed-loop clients (module docstring) over the prompts, from prompt `offset` on."""
    level, lock = Level(concurrency), threading.Lock()
    wanted = max(settings.requests, concurrency)
    issued = [0]
    start = time.perf_counter()

    def client_loop():
        while True:
            with lock:
                if issued[0] >= wanted:
                    return
                if time.perf_counter() - start >= settings.level_seconds:
                    level.stopped_by = "time"
                    return
                i = issued[0]
                issued[0] += 1
            prompt = prompts[(offset + i) % len(prompts)]
            try:
                answer = _request(client, prompt, settings, settings.seed + offset + i, settings.max_new_tokens)
            except EndpointError as err:
                with lock:
                    level.errors.append(str(err))
                continue
            with lock:
                level.answered.append(answer)

    workers = [threading.Thread(target=client_loop, daemon=True) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if not level.answered:
        why = level.errors[-1] if level.errors else f"nothing answered in --level-seconds {settings.level_seconds:g}"
        raise EndpointError(f"load test at concurrency {concurrency}: no request answered; last: {why}")
    return level


def run_load(client: EndpointClient, prompts: Sequence, settings: LoadSettings, progress: bool = True) -> list[dict]:
    """One untimed warm-up request, then every concurrency level in turn: their summaries."""
    _request(client, prompts[0], settings, settings.seed, min(WARMUP_TOKENS, settings.max_new_tokens))
    rows, offset = [], 0
    for c in settings.concurrency:
        level = measure_level(client, prompts, c, settings, offset)
        offset += len(level.answered) + len(level.errors)
        rows.append(level.summary([settings.percentile]))
        if progress:
            r = rows[-1]
            print(
                f"concurrency {c}: {r['requests']} answers, {r['tokens_per_s']:.4g} tokens/s, "
                f"latency p50 {r['latency_s_p50']:.3g} s"
            )
    return rows


def capacity_at_target(rows: Sequence[Mapping], latency_target_s: float, q: float, method: str) -> dict:
    """The measured level with the most req/s whose latency percentile is within the target."""
    p, key = f"p{q:g}", f"latency_s_p{q:g}"
    ok = [r for r in rows if r[key] <= latency_target_s]
    if not ok:
        first = rows[0]
        return {
            "concurrency": None,
            "requests_per_s": None,
            "tokens_per_s": None,
            "reason": (
                f"{method}: unreachable: even at concurrency {first['concurrency']} the {p} latency is "
                f"{first[key]:.4g} s, above the {latency_target_s:.4g} s target"
            ),
        }
    best = max(ok, key=lambda r: r["requests_per_s"])
    higher = [r for r in rows if r["concurrency"] > best["concurrency"] and r[key] > latency_target_s]
    limit = (
        f"; at concurrency {higher[0]['concurrency']} the {p} latency is {higher[0][key]:.4g} s"
        if higher
        else "; every measured level meets it"
    )
    reason = (
        f"{method}: sustains {best['requests_per_s']:.3g} req/s ({best['tokens_per_s']:.4g} tokens/s) at "
        f"concurrency {best['concurrency']} with {p} latency {best[key]:.4g} s <= {latency_target_s:.4g} s" + limit
    )
    return {
        "concurrency": best["concurrency"],
        "requests_per_s": best["requests_per_s"],
        "tokens_per_s": best["tokens_per_s"],
        "reason": reason,
    }


# ---------------------------------------------------------------------- the simulated closed loop
def simulated_closed_loop(
    serving: Mapping, levels: Sequence[int], requests: int, percentiles: Sequence[float] = ()
) -> dict[str, list[dict]]:
    """Each batched method of a sweep's serving.json in the simulator, at each concurrency level:
    `max(requests, c)` requests queued at t = 0 with max batch c; latency and TTFT from admission."""
    prompt_lengths, output_lengths = serving["prompt_lengths"], serving["output_lengths"]
    out = {}
    for name, e in serving["methods"].items():
        if not e.get("batched"):
            continue
        profile = StepProfile(
            name,
            {int(r): t for r, t in e["step_seconds"].items()},
            {int(n): p for n, p in e["tokens_per_step"].items()},
            prefill_seconds_per_token=e["prefill_seconds_per_token"],
            prefill_seconds_per_request=e["prefill_seconds_per_request"],
        )
        rows = []
        for c in levels:
            n = max(requests, c)
            queued = [
                Request(0.0, prompt_lengths[i % len(prompt_lengths)], output_lengths[i % len(output_lengths)])
                for i in range(n)
            ]
            run = simulate(profile, queued, c)
            served = run.requests
            span = max(r.finish_s for r in served)
            tokens = run.output_tokens
            row = {
                "concurrency": c,
                "requests": n,
                "errors": 0,
                "output_tokens": tokens,
                "seconds": span,
                "tokens_per_s": tokens / span,
                "requests_per_s": n / span,
            }
            _add_percentiles(
                row,
                [r.finish_s - r.admitted_s for r in served],
                [r.first_token_s - r.admitted_s for r in served],
                percentiles,
            )
            rows.append(row)
        out[name] = rows
    return out


def read_serving(path) -> dict:
    """A sweep's serving.json, checked for what the simulation needs."""
    from draftsmith.eval.drafter_specs import SpecError

    path = Path(path)
    try:
        serving = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecError(f"--compare-serving {str(path)!r}: not a readable serving.json ({err})") from None
    for key in ("methods", "prompt_lengths", "output_lengths"):
        if not isinstance(serving, dict) or key not in serving:
            raise SpecError(
                f"--compare-serving {str(path)!r} has no {key!r}: expected the serving.json of "
                "`draftsmith eval --batch-sizes`"
            )
    return serving


# ---------------------------------------------------------------------- speculation counters
def read_counters(client: EndpointClient):
    """(summed SpecDecodeCounters or None, one line saying what /metrics held) over the endpoints."""
    found, notes = [], []
    for url in client.settings.urls:
        status, text = client.get_text(url, "/metrics")
        if status >= 400:
            notes.append(f"{url}/metrics answered HTTP {status}")
            continue
        counters = spec_decode_counters(parse_exposition(text, f"{url}/metrics"))
        if counters is None:
            notes.append(f"{url}/metrics has no vllm:spec_decode_* counters")
        else:
            found.append(counters)
    if not found:
        return None, "; ".join(notes)
    total = found[0]
    for c in found[1:]:
        total = type(c)(
            total.drafts + c.drafts,
            total.draft_tokens + c.draft_tokens,
            total.accepted_tokens + c.accepted_tokens,
            {
                k: total.accepted_per_position.get(k, 0.0) + c.accepted_per_position.get(k, 0.0)
                for k in set(total.accepted_per_position) | set(c.accepted_per_position)
            },
        )
    return total, "; ".join(notes)


def acceptance_rows(served: Mapping | None, report: Mapping | None, model: str) -> list[dict]:
    """The served acceptance beside draftsmith's batch-1 rows: tau and alpha_i, both conditional
    (alpha_i: draft i accepted given drafts 1..i-1 were) and both counting the bonus token."""
    from draftsmith.eval.report import method_name

    rows = []
    if served:
        row = {
            "source": f"served: {model} (/metrics)",
            "tau": served["mean_acceptance_length"],
            "acc. rate": served["acceptance_rate"],
            "drafts": served["drafts"],
        }
        rows.append(row | {f"alpha_{i + 1}": a for i, a in enumerate(served["alpha_per_position"])})
    for r in (report or {}).get("methods", []):
        if r.get("alpha_per_position"):
            row = {
                "source": f"draftsmith: {method_name(r)} (batch 1)",
                "tau": r["tau"],
                "acc. rate": r.get("acceptance_rate"),
                "drafts": r.get("target_calls"),
            }
            rows.append(row | {f"alpha_{i + 1}": a for i, a in enumerate(r["alpha_per_position"])})
    return rows


# ---------------------------------------------------------------------- the report
def load_table(name: str, rows: Sequence[Mapping]) -> list[dict]:
    """Rows in the columns of the sweep's tables (method, tokens/s, req/s, latency p50 s, p90 s,
    p99 s, TTFT p50 s), the batch size replaced by the concurrency level."""
    return [
        {
            "method": name,
            "concurrency": r["concurrency"],
            "requests": r["requests"],
            "tokens/s": r["tokens_per_s"],
            "req/s": r["requests_per_s"],
            "latency p50 s": r["latency_s_p50"],
            "p90 s": r["latency_s_p90"],
            "p99 s": r["latency_s_p99"],
            "TTFT p50 s": r["ttft_s_p50"],
            "TTFT p90 s": r["ttft_s_p90"],
            "errors": r["errors"],
        }
        for r in rows
    ]


def sections(engine: Mapping, report: Mapping | None = None):
    """The engine report's sections, in reading order."""
    from draftsmith.eval.plots import Section

    s, model = engine["settings"], engine["served_model"]
    p = f"p{s['percentile']:g}"
    intro = (
        f"Server: {', '.join(engine['endpoints'])}, model {model!r}. Closed loop: at concurrency c, c clients each "
        f"send the next streamed /v1/completions request when theirs is answered; up to {s['requests']} answers "
        f"(at least c) or {s['level_seconds']:g} s per level, {engine['num_prompts']} prompts cycled, up to "
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']:g}, prompts sent as "
        f"{engine['prompts_sent_as']}. "
        "TTFT: send to the first streamed text; latency: send to the last event; tokens/s and req/s: every answer "
        "of the level over first send to last answer. Output tokens from the server's usage counts where given."
    )
    text = [intro]
    if engine.get("capacity"):
        text.append(engine["capacity"]["reason"])
    rows = load_table(f"served: {model}", engine["levels"])
    for name, sim in (engine.get("simulated") or {}).items():
        rows += load_table(f"simulated: {name}", sim)
    if engine.get("simulated"):
        text.append(
            f"simulated: the methods of {engine['compare_serving']} (measured step costs, tokens per step and "
            "admission cost) in the continuous-batching simulator, the same closed loop: the requests queue at t = 0 "
            "with max batch c, latency and TTFT from admission."
        )
    out = [Section("Served load: TTFT, latency and throughput per concurrency", "\n\n".join(text), rows=rows)]
    if engine.get("capacity_simulated"):
        lines = [c["reason"] for c in engine["capacity_simulated"].values()]
        out.append(Section(f"Capacity at {p} <= {s['latency_target_s']:g} s, simulated", "\n\n".join(lines)))
    spec = engine["speculation"]
    text = spec["note"]
    rows = acceptance_rows(spec.get("served"), report, model)
    out.append(Section("Speculative decoding: served acceptance beside draftsmith's", text, rows=rows or None))
    return out


def write_engine(engine: dict, out_dir, report: Mapping | None = None) -> list[Path]:
    """engine.json, engine.md and engine.html into out_dir (each written atomically)."""
    from draftsmith.eval.plots import write_serving_report
    from draftsmith.eval.report import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "engine.json"
    md, page = write_serving_report(
        out_dir, *sections(engine, report), title="draftsmith serving engine load test", name="engine"
    )
    write_atomic(json_path, json.dumps(engine, indent=2, allow_nan=True) + "\n")
    return [json_path, md, page]


# ---------------------------------------------------------------------- the job
@dataclass(frozen=True)
class EngineJob:
    endpoint: EndpointSettings
    load: LoadSettings
    target: str  # the tokenizer of the prompts (and, with `local`, the model draftsmith evaluates)
    prompts: str  # JSONL, as `draftsmith eval` reads it
    out: str
    limit: int | None = None
    local: object = None  # eval.jobs.EvalJob: the batch-1 evaluation of the served head on the same prompts
    compare_serving: str | None = None  # serving.json of a simulated sweep of the same target
    progress: bool = True
    overwrite: bool = False


def run_engine(job: EngineJob) -> dict:
    """Check the folder and the endpoint, evaluate the head locally (with `job.local`), run the
    load with the counters read around it, write and print the report."""
    from draftsmith.eval.evaluator import load_prompt_file
    from draftsmith.eval.jobs import _out_folder, run_eval
    from draftsmith.eval.plots import markdown_table
    from draftsmith.heads.models import load_tokenizer

    _out_folder(job.out, ENGINE_FILES, overwrite=job.overwrite)
    serving = read_serving(job.compare_serving) if job.compare_serving else None
    client = EndpointClient(job.endpoint)  # a down endpoint fails here, before any model loads
    try:
        tokenizer = load_tokenizer(job.target)
        ids, _ = load_prompt_file(job.prompts, tokenizer, limit=job.limit)
        ids = [p.tolist() for p in ids]
        # The exact tokens where the server takes ids (vLLM, SGLang), else their text.
        takes_ids = client.accepts("/v1/completions", {"prompt": ids[0], "max_tokens": 1}) is not None
        if not takes_ids and tokenizer is None:
            raise EndpointError(
                f"endpoint {client.settings.urls[0]} takes text prompts only, and --target "
                f"{job.target} has no tokenizer to write them"
            )
        prompts = ids if takes_ids else [tokenizer.decode(p, skip_special_tokens=True) for p in ids]
        probe = {"prompt": prompts[0], "max_tokens": 1, "ignore_eos": True}
        if job.load.ignore_eos and client.accepts("/v1/completions", probe) is None:
            raise EndpointError(
                f"endpoint {client.settings.urls[0]} refuses `ignore_eos` (--ignore-eos): its answers "
                "end where the model stops; drop --ignore-eos"
            )
        report = run_eval(job.local) if job.local is not None else None
        before, note = read_counters(client)
        levels = run_load(client, prompts, job.load, job.progress)
        after, _ = read_counters(client) if before is not None else (None, None)
    finally:
        client.close()
    s = job.load
    engine = {
        "endpoints": list(job.endpoint.urls),
        "served_model": client.model,
        "settings": asdict(s),
        "prompts_file": str(job.prompts),
        "num_prompts": len(prompts),
        "prompts_sent_as": "ids" if takes_ids else "text",
        "levels": levels,
    }
    method = f"served: {client.model}"
    if s.latency_target_s is not None:
        engine["capacity"] = capacity_at_target(levels, s.latency_target_s, s.percentile, method)
    if serving is not None:
        engine["compare_serving"] = str(job.compare_serving)
        engine["simulated"] = simulated_closed_loop(serving, s.concurrency, s.requests, [s.percentile])
        if s.latency_target_s is not None:
            engine["capacity_simulated"] = {
                n: capacity_at_target(rows, s.latency_target_s, s.percentile, f"simulated: {n}")
                for n, rows in engine["simulated"].items()
            }
    if before is None:
        spec = {"served": None, "note": f"The server exposes no speculative-decoding counters ({note}): load only."}
    else:
        served = served_acceptance(after - before)
        spec = {
            "served": served,
            "note": (
                f"Served: vLLM's counters over the load test ({served['drafts']:.0f} drafts, all the server's traffic in "
                f"that window): tau = 1 + accepted / drafts = {served['mean_acceptance_length']:.3g}, alpha_i = accepted "
                "at position i / accepted at position i - 1. draftsmith rows: its own batch-1 decode of the head on the "
                "same prompts (at its K, which may differ from the server's)."
            ),
        }
    engine["speculation"] = spec
    paths = write_engine(engine, job.out, report)
    print()
    print(markdown_table(sections(engine, report)[0].rows))
    for line in ([engine["capacity"]["reason"]] if "capacity" in engine else []) + [spec["note"]]:
        print(f"- {line}")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return engine
