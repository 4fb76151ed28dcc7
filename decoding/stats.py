"""What a decode reports: `DecodeStats` (counters and timers of one row or many, merged with `+`),
`Generation` (one sequence) and `BatchResult` (a batch: per-row stats, pooled stats, per-call
timers). tau counts the bonus/correction token (plain decoding has tau = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _per_position(sums: str, counts: str, doc: str) -> property:
    """A read-only per-draft-position list of `DecodeStats`: sums[i] / counts[i], None where counts[i] is 0."""

    def mean(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(getattr(self, sums), getattr(self, counts))]

    return property(mean, doc=doc)


@dataclass
class DecodeStats:
    """Counters of one or more decodes. Merge with `+`.

    `proposed[j]` / `accepted[j]`: drafts proposed / kept at target call j.
    `reached[i]` / `accepted_at[i]`: how often draft position i+1 was verified on the true
    trajectory (every earlier draft accepted) / accepted there.
    Distances (only with `measure_distances=True`), per position, on reached positions:
    sums of KL(p || q), TV(p, q), the target mass outside the draft's vocabulary and the KL on
    that vocabulary (`sampling.split_kl`) of the raw (T=1) distributions and of the exact
    acceptance probability sum_x min(p, q) of the sampling distributions.

    Trees: `proposed[j]` counts nodes, `accepted[j]` the accepted path's length; position i is
    depth i + 1 (reached when the path got to depth i, accepted when it got a node at depth
    i + 1), so alpha_per_position reads P(some candidate at depth i + 1 accepted | reached).
    Distances of a tree: only the expected acceptance at depth 1 (the target mass of the root's
    candidates, or the argmax test at T = 0); no KL/TV. None at all under typical acceptance.

    `lossy`: some call used typical acceptance at T > 0 (the output is then NOT the
    target's distribution). `lossy_kl_sum` adds -log p(x) = KL(delta_x || p) for every token
    the typical rule accepted (0 for tokens sampled from p): an estimate of the divergence.
    """

    num_draft_tokens: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    new_tokens: int = 0
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    compile_seconds: float = 0.0  # warm-up of compiled forwards (target and drafter), not in total_seconds
    kl_sum: list[float] = field(default_factory=list)
    tv_sum: list[float] = field(default_factory=list)
    accept_prob_sum: list[float] = field(default_factory=list)
    distance_count: list[int] = field(default_factory=list)
    kl_count: list[int] = field(default_factory=list)  # positions with draft distributions
    oov_sum: list[float] = field(default_factory=list)  # target mass outside the draft vocabulary
    kl_vocab_sum: list[float] = field(default_factory=list)  # KL on the draft vocabulary (split_kl)
    lossy: bool = False
    lossy_kl_sum: float = 0.0

    def __post_init__(self):
        k = self.num_draft_tokens
        for name in ("reached", "accepted_at", "distance_count", "kl_count"):
            if not getattr(self, name):
                setattr(self, name, [0] * k)
        for name in ("kl_sum", "tv_sum", "accept_prob_sum", "oov_sum", "kl_vocab_sum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * k)

    #: Per-call lists (concatenated by `+`); every other list is per draft position (added).
    _PER_CALL = ("proposed", "accepted")

    def __add__(self, other: DecodeStats) -> DecodeStats:
        k = max(self.num_draft_tokens, other.num_draft_tokens)
        merged = {"num_draft_tokens": k, "lossy": self.lossy or other.lossy}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in merged:
                continue
            if f.name in self._PER_CALL:
                merged[f.name] = a + b
            elif isinstance(a, list):  # per position: pad the shorter to k, then add
                merged[f.name] = [x + y for x, y in zip(a + [0] * (k - len(a)), b + [0] * (k - len(b)))]
            else:
                merged[f.name] = a + b
        return DecodeStats(**merged)

    @property
    def target_calls(self) -> int:
        """Decoding calls of the target (the prefill is not one)."""
        return len(self.proposed)

    @property
    def tau(self) -> float:
        """Mean tokens per target call, counting the bonus/correction token (plain decoding = 1)."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def alpha(self) -> float:
        """Conditional acceptance over all reached positions (Leviathan's alpha, pooled)."""
        return sum(self.accepted_at) / max(1, sum(self.reached))

    alpha_per_position = _per_position(
        "accepted_at", "reached", "alpha_i = P(draft i accepted | drafts 1..i-1 accepted); None if never reached."
    )

    @property
    def lossy_kl_per_token(self) -> float:
        """Estimated KL(emitted || target) per emitted token (0 for lossless decoding)."""
        return self.lossy_kl_sum / max(1, sum(a + 1 for a in self.accepted))

    # Distances per draft position: means over the calls that measured them there (None: no call did).
    kl_per_position = _per_position("kl_sum", "kl_count", "Mean KL(p || q) of the raw distributions.")
    oov_per_position = _per_position("oov_sum", "kl_count", "Mean target mass outside the draft vocabulary.")
    kl_vocab_per_position = _per_position("kl_vocab_sum", "kl_count", "Mean KL on the draft vocabulary (`split_kl`).")
    tv_per_position = _per_position("tv_sum", "kl_count", "Mean TV(p, q) of the raw distributions.")
    expected_alpha_per_position = _per_position(
        "accept_prob_sum",
        "distance_count",
        "Mean of sum_x min(p, q) at reached positions: the theory for alpha_per_position.",
    )


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded)
    stats: DecodeStats


@dataclass
class BatchResult:
    """What `generate_batch` returns; rows are in the order of the prompts.

    `rows[b]` holds row b's counters in `DecodeStats` conventions (proposed/accepted per call
    the row took part in, reached/accepted_at per draft position, new_tokens), and its times:
    `ttft_seconds` (start -> its first new token), `total_seconds` (start -> it finished),
    `target_seconds` / `drafter_seconds` (the calls it waited through), `prefill_seconds`.
    Batch timers: `call_seconds[j]` the verification of call j (target forward + acceptance),
    `drafter_seconds[j]` the drafting before it and the drafter's update after it,
    `call_rows[j]` the rows still decoding at call j. All timers are device-synchronised.
    `compile_seconds`: the warm-up compilation of the static path, before the clock started
    (never part of `total_seconds`).
    """

    tokens: list[list[int]]
    rows: list[DecodeStats]
    stopped: list[str]  # per row: "eos" or "length"
    call_seconds: list[float] = field(default_factory=list)
    drafter_seconds: list[float] = field(default_factory=list)
    call_rows: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    compile_seconds: float = 0.0

    @property
    def target_calls(self) -> int:
        return len(self.call_seconds)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def ttft_seconds(self) -> list[float]:
        return [r.ttft_seconds for r in self.rows]

    @property
    def finish_seconds(self) -> list[float]:
        return [r.total_seconds for r in self.rows]

    @property
    def stats(self) -> DecodeStats:
        """Every row's counters pooled (tau, alpha per position over all rows' calls, as batch-1
        stats of the same rows summed), with the batch's own timers: target/drafter seconds
        are the sums of the per-call lists, ttft the earliest row's."""
        total = DecodeStats()
        for row in self.rows:
            total = total + row
        total.target_seconds = sum(self.call_seconds)
        total.drafter_seconds = sum(self.drafter_seconds)
        total.prefill_seconds = self.prefill_seconds
        total.ttft_seconds = min(self.ttft_seconds, default=0.0)
        total.total_seconds = self.total_seconds
        total.compile_seconds = self.compile_seconds
        return total
