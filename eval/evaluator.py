"""The evaluator: target-only and speculative decoding on the same prompts, side by side.

One evaluation =
  1. a warm-up decode per method (excluded from everything);
  2. an analysis pass per drafter with `measure_distances=True` (untimed): per-position
     expected acceptance sum_x min(p, q), KL(p || q) and TV(p, q) on the decoded trajectories,
     and, for drafts over a reduced vocabulary (where KL(p || q) is inf), the target mass outside
     the draft vocabulary and the KL of p restricted to that vocabulary (`sampling.split_kl`);
  3. `repeats` timed passes; within a pass every prompt is decoded by every method in turn
     (interleaved, so machine-load noise hits all methods alike).
Speedup is the ratio of tokens/s to target-only within each pass, then the median over passes.
tau counts the bonus token: target-only decoding scores exactly 1.00.
Two acceptance figures: `acceptance_rate` = accepted drafts / proposed drafts (the share of
drafted tokens kept), and `alpha` = accepted / reached, Leviathan's conditional per-position
acceptance P(draft i accepted | drafts 1..i-1 accepted), pooled over positions. The drafts
proposed after the first rejection of a call are never reached: alpha >= acceptance_rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.decoding import DecodeStats, Drafter, generate
from draftsmith.decoding.compiler import COMPILE_MODES
from draftsmith.decoding.linears import in_force
from draftsmith.decoding.loop import DEFAULT_NUM_DRAFT_TOKENS
from draftsmith.decoding.sampling import SamplingConfig
from draftsmith.distill.prompts import Prompter
from draftsmith.distill.sources import NO_TASK, load_source
from draftsmith.eval.identity import compare_greedy
from draftsmith.eval.stats import percentile

BASELINE = "target-only"


def setting(default, help: str, *, at_least=None, above=None, at_most=None, flag=None, short=None, choices=None):
    """A field of a typed settings class with what its command-line flag needs: the help, the
    bounds a value is checked against (`at_least`, `above`, `at_most`), and a flag name other
    than `--field-name` (a True default is switched off by its flag, e.g. --no-distances)."""
    bounds = {"at_least": at_least, "above": above, "at_most": at_most}
    metadata = {"help": help, "flag": flag, "short": short, "choices": choices, **bounds}
    return field(default=default, metadata=metadata)


@dataclass
class EvalSettings:
    """How drafters are evaluated; the one place these defaults live (`draftsmith eval`, tune and
    check-lossless derive their flags from these fields)."""

    num_draft_tokens: int = setting(DEFAULT_NUM_DRAFT_TOKENS, "K: drafts per target call", at_least=1, short="-k")
    max_new_tokens: int = setting(128, "new tokens per prompt", at_least=1)
    temperature: float = setting(0.0, "sampling temperature (0 = greedy)", at_least=0.0)
    top_k: int = setting(0, "keep the k most likely tokens (0 = off)", at_least=0)
    top_p: float = setting(1.0, "nucleus sampling mass (1 = off)", above=0.0, at_most=1.0)
    repeats: int = setting(3, "timed passes (median reported)", at_least=1)
    seed: int = setting(0, "sampling seed")
    ignore_eos: bool = setting(False, "always decode --max-new-tokens tokens (a fixed-length benchmark)")
    measure_distances: bool = setting(True, "skip the untimed KL/TV pass", flag="--no-distances")
    static_cache: bool = setting(False, "decode over preallocated KV caches (the target and every drafter's)")
    compile: bool | str = setting(
        False,
        "also torch.compile the decode and verify steps (implies --static-cache; compile time is reported apart)",
        choices=COMPILE_MODES,
    )

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (K) must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        _ = self.sampling  # validates temperature / top_k / top_p

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


def load_prompts(path: str | Path, tokenizer=None, limit: int | None = None, **options) -> list[torch.Tensor]:
    """The first user turn of each row of a prompt source, as token ids (every format of
    `distill/sources.py`, tokenised by `distill/prompts.py`; `options`: those of `load_prompt_file`).
    Later turns need the target's answers: `prompt_turns` asks them."""
    return load_prompt_file(path, tokenizer, limit, **options)[0]


def load_prompt_file(
    path: str | Path,
    tokenizer=None,
    limit: int | None = None,
    task_key: str | None = None,
    template: str | None = None,
    plain: str = "raw",
) -> tuple[list[torch.Tensor], list[str | None]]:
    """`load_prompts` and each row's task (`Record.task`: the string under `task_key`, by default
    "task", else "category"; None when the row has none): (prompts, tasks)."""
    source = load_source(str(path), limit=limit, task_key=task_key)
    prompter = Prompter(tokenizer, template, plain)
    return [_tensor(prompter.ids(r)) for r in source.records], [r.task for r in source.records]


@dataclass
class PromptTurns:
    """Every user turn of every row of a source, as prompts, in row order (turn 1, 2, ... of a row)."""

    prompts: list[torch.Tensor]
    tasks: list[str | None]
    turns: list[int]  # 1-based user turn of each prompt
    rows: list[int]  # the source row (Record.index) of each prompt


def prompt_turns(
    target, records, prompter: Prompter, settings: EvalSettings, *, stop_token_ids=None, progress: bool = True
) -> PromptTurns:
    """The prompts of every turn of `records`. Turn j + 1 of a conversation is asked after the
    target's own answer to turn j: its target-only decode at `settings` (sampling, seed,
    max_new_tokens; it ends at a stop token even with ignore_eos, as an answer does), decoded to
    text and rendered back through the chat template, as a chat server re-renders history.
    Decoding is lossless, so this is the answer every drafter's decode gives too (greedy: the same
    tokens; sampled: a draw from the same distribution), and all methods see the same turn j + 1."""
    out = PromptTurns([], [], [], [])
    counts = [prompter.num_turns(r) for r in records]
    bar = tqdm(total=sum(counts) - len(counts), desc="answers", unit="turn", disable=not progress or max(counts) < 2)
    stops = set() if stop_token_ids is None else {int(t) for t in torch.as_tensor(stop_token_ids).flatten().tolist()}
    for record, count in zip(records, counts):
        answers: list[str] = []
        for turn in range(1, count + 1):
            ids = _tensor(prompter.ids(record, answers))
            out.prompts.append(ids)
            out.tasks.append(record.task)
            out.turns.append(turn)
            out.rows.append(record.index)
            if turn == count:
                break
            # Seeds: one per (row, turn), a prime stride apart, so no two answers share a generator.
            tokens = generate(
                target,
                None,
                ids,
                max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                top_k=settings.top_k,
                top_p=settings.top_p,
                seed=settings.seed + 7919 * record.index + turn,
                eos_token_id=stop_token_ids,
            ).tokens
            answers.append(prompter.tokenizer.decode([t for t in tokens if t not in stops], skip_special_tokens=True))
            bar.update()
    bar.close()
    return out


def _tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def evaluate(
    target,
    methods: dict[str, Drafter],
    prompts: list[torch.Tensor],
    settings: EvalSettings,
    *,
    eos_token_id=None,
    progress: bool = True,
    tasks: list[str | None] | None = None,
    turns: list[int] | None = None,
    num_draft_tokens: dict[str, int] | None = None,
) -> dict:
    """Run the evaluation and return the report as a JSON-ready dict (see `write_report`).

    `num_draft_tokens` ({method: K}) overrides `settings.num_draft_tokens` for the methods it names:
    drafters at different K (each at its tuned K, say) measured against one target-only pass.

    `tasks` (one per prompt, None = no task; see `load_prompt_file`): when any is given, every
    method row also gets `tasks`, one entry per task with its prompts' pooled counters and its
    own speedup (per-task tokens/s over target-only's on the same prompts, median over passes);
    the entries' new_tokens and target_calls sum to the row's. `turns` (the 1-based user turn of
    each prompt, see `prompt_turns`): when any is past 1, the entries are per (task, turn), and
    each says its "turn"."""
    if BASELINE in methods:
        raise ValueError(f"{BASELINE!r} is the baseline's name; pick another method name")
    for what, given in (("tasks", tasks), ("turns", turns)):
        if given is not None and len(given) != len(prompts):
            raise ValueError(f"{what} has {len(given)} entries for {len(prompts)} prompts; expected one per prompt")
    multi_turn = turns is not None and any(t > 1 for t in turns)
    by_task = multi_turn or (tasks is not None and any(t is not None for t in tasks))
    tasks = tasks if tasks is not None else [None] * len(prompts)
    # A group is (task, turn); turn None for single-turn prompts (their entries carry no "turn").
    task_of = []
    if by_task:
        task_of = [(NO_TASK if t is None else t, turns[i] if multi_turn else None) for i, t in enumerate(tasks)]
    unknown = sorted(set(num_draft_tokens or {}) - set(methods))
    if unknown:
        raise ValueError(f"num_draft_tokens names {unknown}, which are not methods of this evaluation")
    ks = {name: settings.num_draft_tokens for name in methods} | (num_draft_tokens or {})
    eos = None if settings.ignore_eos else eos_token_id
    runs = {BASELINE: None, **methods}

    def decode(name, prompt, seed, measure=False, max_new_tokens=None):
        return generate(
            target,
            runs[name],
            prompt,
            max_new_tokens=max_new_tokens or settings.max_new_tokens,
            num_draft_tokens=ks.get(name, settings.num_draft_tokens),
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
            eos_token_id=eos,
            measure_distances=measure,
            static_cache=settings.static_cache,
            compile=settings.compile,
        )

    # warm-up: allocator, kernels, lazy init; compiled paths warm up at full length (a longer
    # first request would grow the cache and compile again).
    warm_tokens = settings.max_new_tokens if settings.compile else min(16, settings.max_new_tokens)
    compile_seconds = {
        name: decode(name, prompts[0], settings.seed, max_new_tokens=warm_tokens).stats.compile_seconds for name in runs
    }

    total = len(prompts) * (len(runs) * settings.repeats + (len(methods) if settings.measure_distances else 0))
    bar = tqdm(total=total, desc="eval", unit="decode", disable=not progress)
    analysis: dict[str, DecodeStats] = {}
    if settings.measure_distances:
        for name in methods:
            bar.set_postfix_str(f"{name} (distances)")
            for i, prompt in enumerate(prompts):
                stats = decode(name, prompt, settings.seed + i, measure=True).stats
                analysis[name] = analysis[name] + stats if name in analysis else stats
                bar.update()

    pooled: dict[str, DecodeStats] = {}
    per_pass = {name: [] for name in runs}  # (tokens, seconds) per pass
    decodes = {name: [] for name in runs}  # (latency, ttft) per decode
    task_pooled: dict[tuple[str, str], DecodeStats] = {}  # (method, task) -> counters
    task_pass: dict[tuple[str, str], list[float]] = {}  # (method, task) -> tokens/s per pass
    greedy = settings.temperature == 0
    answers = {name: [] for name in runs}  # greedy: each method's tokens of the first pass, per prompt
    for rep in range(settings.repeats):
        totals = {name: [0, 0.0] for name in runs}
        task_totals: dict[tuple[str, str], list] = {}
        for i, prompt in enumerate(prompts):
            for name in runs:
                bar.set_postfix_str(f"pass {rep + 1}/{settings.repeats} {name}")
                result = decode(name, prompt, settings.seed + 1000 * rep + i)
                stats = result.stats
                if greedy and rep == 0:
                    answers[name].append(result.tokens)
                pooled[name] = pooled[name] + stats if name in pooled else stats
                totals[name][0] += stats.new_tokens
                totals[name][1] += stats.total_seconds
                decodes[name].append((stats.total_seconds, stats.ttft_seconds))
                if by_task:
                    key = (name, task_of[i])
                    task_pooled[key] = task_pooled[key] + stats if key in task_pooled else stats
                    task_totals.setdefault(key, [0, 0.0])
                    task_totals[key][0] += stats.new_tokens
                    task_totals[key][1] += stats.total_seconds
                bar.update()
        for name, (tokens, seconds) in totals.items():
            per_pass[name].append(tokens / seconds)
        for key, (tokens, seconds) in task_totals.items():
            task_pass.setdefault(key, []).append(tokens / seconds)
    bar.close()

    base = pooled[BASELINE]
    target_step = base.target_seconds / max(1, base.target_calls)
    rows = []
    for name in runs:
        stats = pooled[name]
        speedups = [tps / base_tps for tps, base_tps in zip(per_pass[name], per_pass[BASELINE])]
        row = {
            "method": name,
            "drafter": type(runs[name]).__name__ if runs[name] is not None else None,
            "tokens_per_second": _median(per_pass[name]),
            "speedup": _median(speedups),
            "speedup_per_pass": speedups,
            "ttft_ms_p50": 1000 * percentile([t for _, t in decodes[name]], 50),
            "latency_s_p50": percentile([lat for lat, _ in decodes[name]], 50),
            "latency_s_p90": percentile([lat for lat, _ in decodes[name]], 90),
            "new_tokens": stats.new_tokens,
            "target_calls": stats.target_calls,
            "tau": stats.tau,
            "lossy": stats.lossy,  # typical acceptance: NOT the target's distribution
            "lossy_kl_per_token": stats.lossy_kl_per_token,
            "compile_seconds": compile_seconds[name]
            + stats.compile_seconds,  # warm-up compilation, never in the timings
        }
        if name != BASELINE and greedy:  # lossless at greedy: the target's own tokens (eval/identity.py)
            row["identical_to_target_only"] = answers[name] == answers[BASELINE]
            row["greedy_identity"] = compare_greedy(target, prompts, answers[name], answers[BASELINE])
        if name != BASELINE:
            row.update(
                _acceptance(stats, analysis.get(name), target_step, tree=getattr(runs[name], "tree", None) is not None)
            )
        if by_task:
            row["tasks"] = [
                _task_entry(
                    group,
                    task_of.count(group),
                    task_pooled[(name, group)],
                    task_pass[(name, group)],
                    task_pass[(BASELINE, group)],
                )
                for group in dict.fromkeys(task_of)
            ]
        rows.append(row)

    return {
        "mode": settings.sampling.describe(),
        "lossless": not any(row["lossy"] for row in rows),
        "tau_counts_bonus_token": True,
        "settings": asdict(settings),
        "num_prompts": len(prompts),
        "methods": rows,
    }


def describe_target(path, model, device, dtype) -> dict:
    """The report's `target` entry."""
    return {
        "path": str(path),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "linears": in_force(device, dtype),  # decoding/linears.py: a few rows as W Xᵀ on a CPU in fp32
    }


def _task_entry(group, prompts: int, stats: DecodeStats, tps: list[float], base_tps: list[float]) -> dict:
    """One (task, turn) group's share of a method row: pooled counters over its prompts and every pass."""
    task, turn = group
    return {
        "task": task,
        **({"turn": turn} if turn is not None else {}),
        "prompts": prompts,
        "new_tokens": stats.new_tokens,
        "target_calls": stats.target_calls,
        "tau": stats.tau,
        "acceptance_rate": stats.acceptance_rate if sum(stats.proposed) else None,
        "alpha": stats.alpha if sum(stats.reached) else None,
        "alpha_per_position": stats.alpha_per_position,
        "tokens_per_second": _median(tps),
        "speedup": _median([t / b for t, b in zip(tps, base_tps)]),
    }


def _median(values):
    return percentile(values, 50) if values else math.nan


def _acceptance(stats: DecodeStats, analysis: DecodeStats | None, target_step: float, tree: bool = False) -> dict:
    """Acceptance measured, acceptance predicted, and the cost model that links it to speed.

    For tree drafters `proposed` counts tree nodes, drafted in one drafter call per target call:
    c is then the drafter's cost per call, and the chain predictions (one draft per position)
    do not apply, so they are left out (None)."""
    alpha = stats.alpha
    draft_step = stats.drafter_seconds / max(1, stats.target_calls if tree else sum(stats.proposed))
    c = draft_step / target_step if target_step > 0 else math.nan
    verify = (stats.target_seconds / max(1, stats.target_calls)) / target_step if target_step > 0 else math.nan
    mean_k = sum(stats.proposed) / max(1, stats.target_calls)

    # Leviathan et al.: with i.i.d. acceptance alpha and k drafts in a call,
    #   E[tokens per call] = (1 - alpha^(k+1)) / (1 - alpha)
    #   speedup            = E[tokens per call] / (k c + 1)      (verify assumed to cost 1 step)
    # averaged over the calls actually made (prompt lookup and the last call of a decode
    # propose fewer than K).
    def expected_tokens(k_call: int) -> float:
        return k_call + 1.0 if alpha >= 1.0 else (1 - alpha ** (k_call + 1)) / (1 - alpha)

    tau_theory = sum(expected_tokens(kj) for kj in stats.proposed) / max(1, stats.target_calls)
    out = {
        "acceptance_rate": stats.acceptance_rate,
        "alpha": alpha,
        "alpha_per_position": stats.alpha_per_position,
        "draft_cost_ratio_c": c,
        "verify_cost_ratio": verify,
        "mean_drafts_per_call": mean_k,
        "tree": tree,
        "predicted_tau": None if tree else tau_theory,
        "predicted_speedup": None if tree else tau_theory / (mean_k * c + 1),
        # The same accounting with the measured tau, drafts per call and verify cost: the
        # gap to the measured speedup is the decoder's own overhead.
        "predicted_speedup_measured_costs": stats.tau / ((1 if tree else mean_k) * c + verify),
        "drafter_seconds": stats.drafter_seconds,
        "target_seconds": stats.target_seconds,
    }
    if analysis is not None:
        out.update(
            expected_alpha_per_position=analysis.expected_alpha_per_position,
            measured_alpha_per_position_analysis=analysis.alpha_per_position,
            kl_per_position=analysis.kl_per_position,
            tv_per_position=analysis.tv_per_position,
            kl_mean=_weighted(analysis.kl_sum, analysis.kl_count),
            tv_mean=_weighted(analysis.tv_sum, analysis.kl_count),
            # A reduced-vocabulary draft has kl_mean = inf; these two say why and by how much.
            oov_mass_per_position=analysis.oov_per_position,
            kl_draft_vocab_per_position=analysis.kl_vocab_per_position,
            oov_mass_mean=_weighted(analysis.oov_sum, analysis.kl_count),
            kl_draft_vocab_mean=_weighted(analysis.kl_vocab_sum, analysis.kl_count),
            expected_alpha=_weighted(analysis.accept_prob_sum, analysis.distance_count),
        )
    return out


def _weighted(sums, counts):
    total = sum(counts)
    return sum(sums) / total if total else None
