"""A server's Prometheus `/metrics`: the text exposition format, and vLLM's speculative-decoding
counters read before and after a load test, made into the served acceptance per draft position.

    metrics = parse_exposition(text)           # Metrics: samples and their TYPE lines
    before = spec_decode_counters(metrics)     # None: the server exposes no such counters
    served = served_acceptance(after - before) # per position, and the mean acceptance length

The format (one sample a line): `name{label="value",...} value [timestamp]`; `# HELP` and
`# TYPE` lines describe a family; label values escape `\\`, `\"` and `\n`; values may be
`NaN`, `+Inf`, `-Inf`. A counter family `x` has samples `x_total` (and `x_created`, the time it
was created, which is no count).

vLLM's counters (V1 engine), summed over their labels (engines, models):
  vllm:spec_decode_num_drafts_total          D: verify steps that carried drafts
  vllm:spec_decode_num_draft_tokens_total    T: draft tokens proposed
  vllm:spec_decode_num_accepted_tokens_total A: draft tokens accepted
  vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}  A_k: drafts whose token k
      (0-based) was accepted; acceptance is a prefix, so A_k / D = P(tokens 0..k all accepted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFIX = "vllm:spec_decode_"
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POSITION = (
    f"{PREFIX}num_drafts",
    f"{PREFIX}num_draft_tokens",
    f"{PREFIX}num_accepted_tokens",
    f"{PREFIX}num_accepted_tokens_per_pos",
)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class ExpositionError(ValueError):
    """Text that is not the Prometheus exposition format; the message names the line."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass
class Metrics:
    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter, gauge, histogram, ...

    def find(self, name: str) -> list[Sample]:
        """The samples of counter `name`: `name_total`, else `name` itself (older exporters)."""
        for candidate in (f"{name}_total", name):
            found = [s for s in self.samples if s.name == candidate]
            if found:
                return found
        return []

    def total(self, name: str) -> float | None:
        """The sum of `name` over all its labels; None when the server has no such metric."""
        found = self.find(name)
        return sum(s.value for s in found) if found else None


def parse_exposition(text: str, where: str = "/metrics") -> Metrics:
    """Every sample of a Prometheus text exposition; ExpositionError names a malformed line."""
    metrics = Metrics()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line[1:].split(None, 3)
            if len(parts) >= 3 and parts[0] == "TYPE":
                metrics.types[parts[1]] = parts[2]
            continue  # HELP and free comments
        try:
            metrics.samples.append(_sample(line))
        except ValueError as err:
            raise ExpositionError(f"{where} line {lineno}: {err}: {raw[:120]!r}") from None
    return metrics


def _sample(line: str) -> Sample:
    i = 0
    while i < len(line) and (line[i].isalnum() or line[i] in "_:"):
        i += 1
    name = line[:i]
    if not name or name[0].isdigit():
        raise ValueError("expected a metric name")
    labels: list[tuple[str, str]] = []
    if i < len(line) and line[i] == "{":
        labels, i = _labels(line, i + 1)
    fields = line[i:].split()
    if not 1 <= len(fields) <= 2:
        raise ValueError("expected a value and an optional timestamp after the name")
    try:
        value = float(fields[0])
    except ValueError:
        raise ValueError(f"value {fields[0]!r} is not a number") from None
    return Sample(name, tuple(labels), value)


def _labels(line: str, i: int) -> tuple[list[tuple[str, str]], int]:
    """The `key="value"` pairs from just past `{` to the closing `}`; (pairs, index past `}`)."""
    labels = []
    while True:
        while i < len(line) and line[i] in " ,":
            i += 1
        if i < len(line) and line[i] == "}":
            return labels, i + 1
        j = line.find("=", i)
        if j < 0 or j + 1 >= len(line) or line[j + 1] != '"':
            raise ValueError('expected label="value"')
        key, i, chars = line[i:j].strip(), j + 2, []
        while i < len(line) and line[i] != '"':
            if line[i] == "\\" and i + 1 < len(line):
                chars.append(_ESCAPES.get(line[i + 1], "\\" + line[i + 1]))
                i += 2
            else:
                chars.append(line[i])
                i += 1
        if i >= len(line):
            raise ValueError(f"label {key!r}: unterminated value")
        labels.append((key, "".join(chars)))
        i += 1


# ---------------------------------------------------------------------- speculative decoding
@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: dict[int, float]  # 0-based position -> A_k

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = sorted(set(self.accepted_per_position) | set(before.accepted_per_position))
        delta = SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            {k: self.accepted_per_position.get(k, 0.0) - before.accepted_per_position.get(k, 0.0) for k in positions},
        )
        counts = [delta.drafts, delta.draft_tokens, delta.accepted_tokens, *delta.accepted_per_position.values()]
        if any(c < 0 for c in counts):
            raise ExpositionError(
                "a speculative-decoding counter went down between the two reads of /metrics: the server restarted "
                "during the load test; run it again"
            )
        return delta


def spec_decode_counters(metrics: Metrics) -> SpecDecodeCounters | None:
    """vLLM's speculative-decoding counters, summed over labels; None when the server has none."""
    drafts = metrics.total(DRAFTS)
    if drafts is None:
        return None
    per_position: dict[int, float] = {}
    for s in metrics.find(PER_POSITION):
        position = s.label("position")
        if position is None or not position.isdigit():
            raise ExpositionError(f"{s.name} sample without an integer position label: {dict(s.labels)}")
        per_position[int(position)] = per_position.get(int(position), 0.0) + s.value
    return SpecDecodeCounters(
        drafts, metrics.total(DRAFT_TOKENS) or 0.0, metrics.total(ACCEPTED) or 0.0, dict(sorted(per_position.items()))
    )


def served_acceptance(delta: SpecDecodeCounters) -> dict:
    """What the counters of one load test say, JSON-ready. With D drafts, A accepted of T draft
    tokens and A_k drafts whose token k was accepted:
      mean acceptance length = 1 + A / D   (tokens per verify step, counting the bonus token:
                                            draftsmith's tau; no drafting = 1)
      acceptance rate        = A / T       (draftsmith's acc. rate)
      accepted_per_position  = A_k / D     (the draft got past position k)
      alpha_per_position     = A_k / A_{k-1}, A_{-1} = D  (draftsmith's alpha_i: accepted given
                                            the tokens before it were)"""
    d, per = delta.drafts, delta.accepted_per_position
    out = {
        "drafts": d,
        "draft_tokens": delta.draft_tokens,
        "accepted_tokens": delta.accepted_tokens,
        "num_positions": max(per) + 1 if per else 0,
        "mean_acceptance_length": 1.0 + delta.accepted_tokens / d if d else math.nan,
        "acceptance_rate": delta.accepted_tokens / delta.draft_tokens if delta.draft_tokens else math.nan,
    }
    reached, alphas, shares = d, [], []
    for k in range(max(per) + 1 if per else 0):
        accepted = per.get(k, 0.0)
        shares.append(accepted / d if d else math.nan)
        alphas.append(accepted / reached if reached else math.nan)
        reached = accepted
    out["accepted_per_position"] = shares
    out["alpha_per_position"] = alphas
    return out
