"""How much to speculate: the K (chain) or tree size that maximises expected tokens per second,
chosen from measured acceptance and measured costs, and recorded into the drafter's config.

    import json
    from draftsmith.eval.tune import compare_prediction, tune_chain, write_setting
    row = next(r for r in json.load(open("runs/eval/report.json"))["methods"] if r["method"] == "draft")
    tuning = tune_chain(row, draft_seconds=0.0021,          # seconds per drafted token
                        verify_seconds={1: 0.0150, 2: 0.0151, 4: 0.0153, 8: 0.0190})  # v(n): n tokens verified
    print(tuning.table())
    write_setting("runs/draft/draft", tuning)                # config.json records the choice
    print(compare_prediction(tuning.best.speedup, measured_speedup=1.9).sentence)

The models (tau counts the bonus token everywhere: target-only decoding = 1):
- chain of K drafts, per-position conditional acceptance alpha_j (the decoder's alpha_per_position):
      tau(K)     = 1 + sum_{i<=K} prod_{j<=i} alpha_j
      time(K)    = draft(K) + v(K + 1)          K drafts, then one forward over [last, x_1..x_K]
      speedup(K) = (tau(K) / time(K)) / (1 / v(1))
  alpha_j does not depend on the drafts after position j, so alphas measured at K_max predict
  every K <= K_max exactly (in expectation); nothing is known past K_max.
- Medusa tree of N nodes from the rank-wise head accuracies (decoding/medusa_tree.py): the best
  tree of N nodes, tau(N) = 1 + its expected accepted length, time(N) = draft(N) + v(N + 1); draft is the
  heads' cost per step (one forward of all heads, whatever the tree).
- a tree decoded per setting (a method whose registry entry lists `tune_trees`: a dynamic tree,
  grown by the draft's confidence): its acceptance depends on that confidence, which no per-position
  table captures, so tau is MEASURED per setting (the decoder's tau there) and only the verify cost
  is modelled, over N = the draft nodes one step verifies (the drafter's proposal size):
      time = draft_seconds (measured, the whole tree's drafting) + v(N + 1)
  (the verify forward holds the last committed token and the N nodes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from draftsmith.decoding.medusa_tree import build_medusa_tree, expected_accept_length
from draftsmith.distill.acceptance import simulated_tau
from draftsmith.eval.report import write_atomic
from draftsmith.eval.serving import CostCurve, as_cost_curve


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class Candidate:
    """One setting with its predicted (or measured) tau, its costs and its predicted speedup."""

    label: str
    setting: dict  # what write_setting records for it
    tau: float  # tokens per step, counting the bonus token
    draft_seconds: float
    verify_seconds: float
    speedup: float  # tokens/s over target-only tokens/s, both from the same cost curves

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tau / self.seconds


#: Per Tuning kind, the setting key its candidates vary and the axis label of its figure (eval/plots.py).
TUNING_AXIS = {
    "chain": ("num_speculative_tokens", "K (drafts per step)"),
    "medusa-tree": ("num_nodes", "N (tree nodes)"),
    "tree": ("num_nodes", "N (draft nodes)"),
}


@dataclass
class Tuning:
    """Every candidate of one search and the chosen one (highest predicted speedup; a tie goes
    to the smaller setting, listed first: less drafting for the same speed)."""

    kind: str  # "chain", "medusa-tree" (sized from accuracies) or "tree" (decoded per setting)
    candidates: list[Candidate]
    baseline_step_seconds: float  # v(1): one target-only step
    model: str  # the formulas used, one line
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return max(self.candidates, key=lambda c: c.speedup)  # max keeps the first of equals

    def setting(self) -> dict:
        """The chosen setting with its prediction, as `write_setting` records it."""
        best = self.best
        return {**best.setting, "kind": self.kind, "predicted_tau": best.tau, "predicted_speedup": best.speedup}

    def rows(self) -> list[dict]:
        """One JSON-ready dict per candidate (for reports and plots)."""
        return [
            {
                "setting": c.label,
                "tau": c.tau,
                "draft_ms": 1000 * c.draft_seconds,
                "verify_ms": 1000 * c.verify_seconds,
                "tokens_per_s": c.tokens_per_s,
                "speedup": c.speedup,
                "chosen": c is self.best,
            }
            for c in self.candidates
        ]

    def table(self) -> str:
        """Markdown: every candidate, the chosen one marked, the model and the notes below."""
        lines = ["| setting | tau | draft ms | verify ms | tokens/s | speedup |", "|---|---|---|---|---|---|"]
        best = self.best
        for c in self.candidates:
            mark = " (chosen)" if c is best else ""
            lines.append(
                f"| {c.label}{mark} | {c.tau:.2f} | {1000 * c.draft_seconds:.3f} | {1000 * c.verify_seconds:.3f} | "
                f"{c.tokens_per_s:.1f} | {c.speedup:.2f}x |"
            )
        lines += ["", f"model: {self.model} (tau counts the bonus token)"]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _verify_curve(verify_seconds):
    """v(n) with v(1) measured: the target-only step is the baseline of every speedup."""
    if isinstance(verify_seconds, Mapping) and 1 not in verify_seconds:
        raise ValueError(
            f"verify_seconds has points at {sorted(verify_seconds)} but not at n = 1; the cost of verifying "
            "one token (a target-only step) is the baseline of the speedup: measure it"
        )
    if isinstance(verify_seconds, CostCurve) and verify_seconds.xs[0] != 1:
        raise ValueError(f"verify_seconds starts at n = {verify_seconds.xs[0]:g}; it needs a measured point at n = 1")
    return as_cost_curve(verify_seconds, "verify_seconds")


def _per_step_draft_curve(draft_seconds, what: str):
    """A cost per step: a number of seconds, {size: seconds} or a function of the size."""
    return as_cost_curve(draft_seconds, what, allow_zero=True)


# ---------------------------------------------------------------------- chain
def tune_chain(alpha_per_position, draft_seconds, verify_seconds, *, k_max: int | None = None) -> Tuning:
    """The K in 0..k_max with the highest predicted tokens per second (K = 0: do not speculate).

    alpha_per_position: alpha_1..alpha_Kmax (the decoder's `alpha_per_position`), or a
      report.json method row holding it (a tree row is refused: its alphas are per depth).
      A None (position never reached) ends the usable positions.
    draft_seconds: seconds per drafted token (draft(K) = K x this), or the total drafting time
      per K as measured points {K: seconds} or a function of K.
    verify_seconds: v(n), seconds of one target forward over n tokens: measured points
      {n: seconds} (interpolated; n = 1 required), or a function of n.
    """
    notes: list[str] = []
    if isinstance(alpha_per_position, Mapping):
        row = alpha_per_position
        if row.get("tree"):
            raise ValueError(
                f"report row {row.get('method')!r} is a tree drafter: its alpha_per_position is per tree depth, "
                "not a chain; use tune_medusa_tree or tune_measured_trees"
            )
        if not row.get("alpha_per_position"):
            raise ValueError(f"report row {row.get('method')!r} has no alpha_per_position (target-only?)")
        alpha_per_position = row["alpha_per_position"]
    if isinstance(alpha_per_position, (str, bytes)) or not isinstance(alpha_per_position, Sequence):
        raise TypeError(f"alpha_per_position = {alpha_per_position!r}; expected a list of probabilities")
    alphas: list[float] = []
    for i, a in enumerate(alpha_per_position):
        if a is None:
            notes.append(f"position {i + 1} was never reached in the measurement: K is searched up to {i}")
            break
        if not _is_number(a) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_per_position[{i}] = {a!r}; expected a probability in [0, 1] (None: not reached)")
        alphas.append(float(a))
    if not alphas:
        raise ValueError(f"alpha_per_position = {list(alpha_per_position)!r}: no measured position to tune from")
    if k_max is None:
        k_max = len(alphas)
    elif not _is_count(k_max) or k_max > len(alphas):
        raise ValueError(f"k_max = {k_max!r}; expected an int in 1..{len(alphas)} (the measured positions)")

    if _is_number(draft_seconds):
        if draft_seconds < 0:
            raise ValueError(f"draft_seconds = {draft_seconds!r}; expected seconds per drafted token >= 0")
        per_token = float(draft_seconds)

        def draft(k):
            return k * per_token

        draft_text = f"draft(K) = K x {1000 * per_token:.3g} ms"
    else:
        draft = _per_step_draft_curve(draft_seconds, "draft_seconds (per K)")
        draft_text = "draft(K) measured per K"
    verify = _verify_curve(verify_seconds)
    v1 = verify(1)

    candidates = []
    for k in range(k_max + 1):
        tau = simulated_tau(alphas, k)
        d = draft(k) if k else 0.0
        v = verify(k + 1)
        candidates.append(Candidate(f"K={k}", {"num_speculative_tokens": k}, tau, d, v, (tau / (d + v)) * v1))
    tuning = Tuning(
        "chain",
        candidates,
        v1,
        f"tau(K) = 1 + sum_(i<=K) prod_(j<=i) alpha_j; time(K) = draft(K) + v(K+1); {draft_text}; speedup = tau/time x v(1)",
        notes,
    )
    if tuning.best.setting["num_speculative_tokens"] == 0:
        tuning.notes.append("no K beats target-only decoding on these costs: serve without speculation")
    return tuning


# ---------------------------------------------------------------------- Medusa tree
def tune_medusa_tree(
    head_accuracies: list[list[float]], node_budgets: Sequence[int], verify_seconds, draft_seconds=0.0
) -> Tuning:
    """The node budget whose best Medusa tree has the highest predicted tokens per second.

    head_accuracies[d][r]: measured probability that head d's rank-r token is right (the
      heads' config records it as `head_accuracies`).
    node_budgets: the tree sizes to try (ints >= 1).
    verify_seconds: v(n) as in `tune_chain`; a tree of N nodes is verified with N + 1 tokens.
    draft_seconds: the heads' cost per step (one forward of every head): seconds, or a
      function / measured points of the node count.
    """
    if isinstance(node_budgets, (str, bytes)) or not isinstance(node_budgets, Sequence) or not node_budgets:
        raise ValueError(f"node_budgets = {node_budgets!r}; expected a non-empty list of tree sizes")
    for n in node_budgets:
        if not _is_count(n):
            raise ValueError(f"node budget {n!r}; expected a number of tree nodes, an int >= 1")
    draft = _per_step_draft_curve(draft_seconds, "draft_seconds (Medusa heads per step)")
    verify = _verify_curve(verify_seconds)
    v1 = verify(1)
    candidates, notes, seen = [], [], set()
    for budget in sorted(set(node_budgets)):
        tree = build_medusa_tree(head_accuracies, budget)  # validates the table
        nodes = len(tree)
        if nodes in seen:
            notes.append(f"budget {budget} > the {nodes} nodes the measured heads and ranks allow: skipped")
            continue
        seen.add(nodes)
        tau = 1.0 + expected_accept_length(tree, head_accuracies)
        d, v = draft(nodes), verify(nodes + 1)
        setting = {
            "num_speculative_tokens": max(len(p) for p in tree),
            "num_nodes": nodes,
            "tree": [list(p) for p in tree],
        }
        candidates.append(Candidate(f"N={nodes}", setting, tau, d, v, (tau / (d + v)) * v1))
    return Tuning(
        "medusa-tree",
        candidates,
        v1,
        "tau(N) = 1 + expected accepted length of the best N-node tree (independent heads); "
        "time(N) = draft + v(N+1); speedup = tau/time x v(1)",
        notes,
    )


# ---------------------------------------------------------------------- trees decoded per setting
TREE_POINT_KEYS = ("label", "setting", "num_nodes", "tau", "draft_seconds")


def tune_measured_trees(points: Sequence[Mapping], verify_seconds) -> Tuning:
    """The tree with the highest predicted tokens per second among measured points, each
    {"label": how the table names it, "setting": what write_setting records (its
    "num_speculative_tokens" is the depth the tree reaches, drafts plus one), "num_nodes": the draft
    nodes one step verifies, "tau" (measured, counting the bonus token), "draft_seconds" (measured
    drafting time per step)}. Model: module docstring."""
    if isinstance(points, Mapping) or not isinstance(points, Sequence) or not points:
        raise ValueError(f"points = {points!r}; expected a non-empty list of measured settings")
    verify = _verify_curve(verify_seconds)
    v1 = verify(1)
    candidates = []
    for i, point in enumerate(points):
        if not isinstance(point, Mapping):
            raise TypeError(f"points[{i}] = {point!r}; expected a mapping with {', '.join(TREE_POINT_KEYS)}")
        missing = [k for k in TREE_POINT_KEYS if k not in point]
        if missing:
            raise ValueError(f"points[{i}] lacks {', '.join(missing)}; expected {', '.join(TREE_POINT_KEYS)}")
        setting, nodes = point["setting"], point["num_nodes"]
        k = setting.get("num_speculative_tokens") if isinstance(setting, Mapping) else None
        if not _is_count(k):
            raise ValueError(f"points[{i}].setting = {setting!r}; expected a mapping with num_speculative_tokens >= 1")
        if not _is_count(nodes):
            raise ValueError(f"points[{i}].num_nodes = {nodes!r}; expected an int >= 1")
        tau, d = point["tau"], point["draft_seconds"]
        if not _is_number(tau) or not 1.0 <= tau <= k + 1:
            raise ValueError(f"points[{i}].tau = {tau!r}; expected the measured tau in [1, K + 1 = {k + 1}]")
        if not _is_number(d) or d < 0:
            raise ValueError(f"points[{i}].draft_seconds = {d!r}; expected seconds >= 0")
        v = verify(nodes + 1)
        setting = {**setting, "num_nodes": nodes}
        candidates.append(Candidate(str(point["label"]), setting, float(tau), float(d), v, (tau / (d + v)) * v1))
    return Tuning(
        "tree",
        candidates,
        v1,
        "tau measured per setting; time = draft_seconds (measured) + v(N + 1); speedup = tau/time x v(1)",
    )


# ---------------------------------------------------------------------- prediction vs measurement
AGREEMENT = 0.10  # within 10%: about the spread of repeated speedup measurements on a shared machine


class PredictionCheck(NamedTuple):
    ratio: float  # measured / predicted
    sentence: str


def compare_prediction(predicted_speedup: float, measured_speedup: float) -> PredictionCheck:
    """How much of the predicted speedup the measurement realised: ratio = measured / predicted."""
    for name, value in (("predicted_speedup", predicted_speedup), ("measured_speedup", measured_speedup)):
        if not _is_number(value) or value <= 0:
            raise ValueError(f"{name} = {value!r}; expected a speedup > 0")
    ratio = measured_speedup / predicted_speedup
    head = f"measured {measured_speedup:.2f}x vs predicted {predicted_speedup:.2f}x ({ratio:.0%} of the prediction)"
    if abs(ratio - 1.0) <= AGREEMENT:
        return PredictionCheck(ratio, f"{head}: the cost model holds within {AGREEMENT:.0%}.")
    if ratio < 1.0:
        return PredictionCheck(
            ratio,
            f"{head}: the model misses {1 - ratio:.0%}; that is overhead it leaves out (sampling, cache "
            "bookkeeping, host synchronisation) or costs measured under different conditions.",
        )
    return PredictionCheck(
        ratio,
        f"{head}: the measurement beats the model by {ratio - 1:.0%}; the cost curves overstate the real "
        "costs (measured on a busier machine?) or the acceptance was measured on harder prompts.",
    )


# ---------------------------------------------------------------------- recording the choice
SETTING_KEYS = (
    "num_speculative_tokens",
    "num_nodes",
    "tree",
    "depth",
    "top_k",
    "total_tokens",
    "kind",
    "predicted_tau",
    "predicted_speedup",
)
SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _check_setting(setting) -> dict:
    if isinstance(setting, Tuning):
        setting = setting.setting()
    if not isinstance(setting, Mapping):
        raise TypeError(f"setting = {setting!r}; expected a Tuning or a mapping with num_speculative_tokens")
    unknown = sorted(set(setting) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f"setting has unknown keys {unknown}; expected some of {', '.join(SETTING_KEYS)}")
    k = setting.get("num_speculative_tokens")
    if k == 0:
        raise ValueError(
            "num_speculative_tokens = 0: the tuner found that no speculation beats target-only decoding; "
            "serve without the drafter instead (there is no setting to record)"
        )
    if not _is_count(k):
        raise ValueError(f"setting num_speculative_tokens = {k!r}; expected an int >= 1")
    for key, minimum in (("num_nodes", 1), ("depth", 0), ("top_k", 1), ("total_tokens", 1)):
        if key in setting and not _is_count(setting[key], minimum):
            raise ValueError(f"setting {key} = {setting[key]!r}; expected an int >= {minimum}")
    for key in ("predicted_tau", "predicted_speedup"):
        if key in setting and (not _is_number(setting[key]) or setting[key] <= 0):
            raise ValueError(f"setting {key} = {setting[key]!r}; expected a number > 0")
    out = dict(setting)
    if "tree" in setting:
        tree = setting["tree"]
        if isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence) or not tree:
            raise ValueError(f"setting tree = {tree!r}; expected a non-empty list of paths (lists of ranks)")
        paths = []
        for path in tree:
            if (
                isinstance(path, (str, bytes))
                or not isinstance(path, Sequence)
                or not path
                or not all(_is_count(r, 0) for r in path)
            ):
                raise ValueError(f"setting tree holds {path!r}; expected a path: a non-empty list of ranks >= 0")
            paths.append([int(r) for r in path])
        depth = max(len(p) for p in paths)
        if depth > k:
            raise ValueError(f"setting tree is {depth} deep but num_speculative_tokens = {k}; expected depth <= K")
        out["tree"] = paths
    return out


def write_setting(artifact_dir, setting) -> Path:
    """Record the chosen setting in `artifact_dir/config.json`, atomically; returns the file.

    Always: config["draftsmith"]["speculation"] = the setting (nested under draftsmith's own key,
    where servers do not look and vLLM's Medusa config does not rename keys).
    A vLLM speculators export: also speculators_config.proposal_methods[0].speculative_tokens,
    which vLLM reads as the draft length. An SGLang export: also its informational
    top-level num_speculative_tokens (SGLang itself takes --speculative-num-steps).
    `setting`: a Tuning (its chosen candidate) or a mapping of SETTING_KEYS.
    """
    setting = _check_setting(setting)
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ValueError(f"artifact folder {str(folder)!r} does not exist or is not a directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"artifact folder {str(folder)!r} has no config.json; expected a drafter folder written by draftsmith "
            "(save or export) to record the speculation setting in"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(config_file)!r} holds {type(config).__name__}; expected a JSON object")
    own = config.setdefault("draftsmith", {})
    if not isinstance(own, dict):
        raise ValueError(
            f"{str(config_file)!r}: key 'draftsmith' is {own!r}; expected an object (draftsmith's provenance)"
        )
    k = setting["num_speculative_tokens"]
    if "speculators_config" in config:
        methods = (
            (config["speculators_config"] or {}).get("proposal_methods")
            if isinstance(config["speculators_config"], dict)
            else None
        )
        if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
            raise ValueError(
                f"{str(config_file)!r}: speculators_config.proposal_methods is {methods!r}; expected a non-empty "
                "list of proposal methods (a vLLM speculators export)"
            )
        methods[0]["speculative_tokens"] = k
    elif SGLANG_EAGLE3_ARCHITECTURE in (config.get("architectures") or []):
        config["num_speculative_tokens"] = k
    own["speculation"] = setting
    write_atomic(config_file, json.dumps(config, indent=2) + "\n")
    return config_file


__all__ = [
    "Candidate",
    "PredictionCheck",
    "Tuning",
    "compare_prediction",
    "tune_chain",
    "tune_measured_trees",
    "tune_medusa_tree",
    "write_setting",
]
