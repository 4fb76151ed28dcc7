"""The measuring jobs of the `draftsmith` command, end to end: load, measure, print, write.

    run_eval(EvalJob(specs, EvalSettings(num_draft_tokens=4), prompts="p.jsonl", out="runs/eval"))
    run_tune(TuneJob(target="t", prompts="p.jsonl", settings=EvalSettings(num_draft_tokens=8), draft="d"))
    passed = run_check_lossless(LosslessJob(specs, prompt="def main():\\n    "))

`draftsmith eval` (acceptance, speedup and KL against target-only decoding, and with a
SweepSettings the serving-scale sweep), `draftsmith tune` (K, and for a kind with sized trees
the tree size, from measured acceptance and costs) and `draftsmith check-lossless` (a chi-square test that
speculative sampling matches the target). Bad input raises SpecError (or the loaders' errors).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import torch

from draftsmith.decoding.loop import DEFAULT_NUM_DRAFT_TOKENS
from draftsmith.eval.drafter_specs import DrafterSpecs, SpecError, eos_token_id, load_chain_drafter, load_drafters
from draftsmith.eval.evaluator import EvalSettings
from draftsmith.eval.lossless import MIN_SAMPLES
from draftsmith.heads.artifacts import check_writable_folder
from draftsmith.heads.registry import METHODS, RowOptions, get_method


def package_version() -> str:
    try:
        return metadata.version("draftsmith")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


REPORT_FILES = ("report.json", "report.md", "serving.json", "serving.md", "serving.html")  # what `eval` writes


def _out_folder(out, files: tuple[str, ...] = (), overwrite: bool = True) -> Path | None:
    """The --out folder, checked before anything is loaded: it (or the nearest folder above it that
    exists) takes a file, and, without `overwrite`, holds none of `files` (an earlier run's
    results). Nothing is created: a later error leaves the file system as it was."""
    out = Path(out) if out else None
    if out is None:
        return None
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {str(out)!r} exists and is not a folder")
    earlier = [name for name in files if (out / name).exists()]
    if earlier and not overwrite:
        raise SpecError(
            f"--out {str(out)!r} already holds {', '.join(earlier)} from an earlier run: "
            "choose a new folder or pass --overwrite to replace them"
        )
    return check_writable_folder(out, "--out", SpecError)


def check_prompt_lengths(prompts, new_tokens: int, limits: dict[str, int | None], where: str) -> None:
    """SpecError when a prompt plus `new_tokens` reaches past a model's positions: `limits` maps
    each model ("the target 'DIR'") to its max_position_embeddings (None: no limit)."""
    longest = max(range(len(prompts)), key=lambda i: prompts[i].numel())
    need = prompts[longest].numel() + new_tokens
    for what, limit in limits.items():
        if limit is not None and need > limit:
            raise SpecError(
                f"{where}: prompt {longest + 1} has {prompts[longest].numel()} tokens; with {new_tokens} new tokens "
                f"it needs {need} positions, more than {what} has (max_position_embeddings={limit}): shorten the "
                "prompt, or lower --max-new-tokens"
            )


def _position_limits(specs: DrafterSpecs, target, drafters) -> dict[str, int | None]:
    from draftsmith.decoding.target import max_positions

    limits = {f"the target {specs.target!r}": max_positions(target.config)}
    limits.update({f"the drafter {name!r}": d.max_positions() for name, d in drafters.items()})
    return limits


# --------------------------------------------------------------------------- eval


@dataclass(frozen=True)
class EvalJob:
    specs: DrafterSpecs
    settings: EvalSettings
    prompts: str  # a prompt source: file, saved dataset or hub name, any format of distill/sources.py
    out: str  # folder for report.json and report.md (and serving.* with a sweep)
    limit: int | None = None  # only the first N prompt rows
    task_key: str | None = None  # field of a prompt row that names its task (None: "task", else "category")
    chat_template: str = "auto"  # renders conversations: auto (the tokenizer's), none, or a Jinja file
    plain_prompts: str = "raw"  # plain "prompt" rows: raw text (as before), or "chat" (one templated user turn)
    sweep: object = None  # eval.sweep.SweepSettings: also the serving-scale sweep
    progress: bool = True
    overwrite: bool = False  # replace an earlier run's report in `out` (else refused)


def run_eval(job: EvalJob) -> dict:
    """Evaluate every drafter of `job.specs`; print the tables; write the report (and serving.*)."""
    from draftsmith.eval.evaluator import describe_target, evaluate
    from draftsmith.eval.report import header, position_table, summary_table, task_table, write_report

    out = _out_folder(job.out, REPORT_FILES, overwrite=job.overwrite)
    target, tokenizer, drafters, device, dtype = load_drafters(job.specs)
    limits = _position_limits(job.specs, target, drafters)
    asked = _ask_prompts(job, target, tokenizer, limits)
    prompts, eos = asked.turns.prompts, asked.stop_ids
    report = evaluate(
        target,
        drafters,
        prompts,
        job.settings,
        eos_token_id=eos,
        progress=job.progress,
        tasks=asked.turns.tasks,
        turns=asked.turns.turns,
    )
    specs = job.specs
    report["target"] = describe_target(specs.target, target, device, dtype)
    given = specs.resolved()
    report["drafts"] = {d.name: d.folder for d in given}  # {name: folder} of every --drafter
    report["drafter_kinds"] = {d.name: d.kind for d in given}
    report["prompts_file"] = str(job.prompts)
    report["prompts_source"] = asked.provenance()
    report["draftsmith_version"] = package_version()
    report["torch_version"] = torch.__version__
    report["git_revision"] = git_revision()
    json_path, md_path = write_report(report, out)
    print(header(report))
    print()
    print(summary_table(report))
    print()
    print(position_table(report))
    if any("tasks" in row for row in report["methods"]):
        print()
        print(task_table(report))
    print(f"\nwrote {json_path} and {md_path}")
    if job.sweep is not None:
        _serving(job, target, drafters, prompts, report, eos)
    return report


def _serving(job: EvalJob, target, drafters, prompts, report, eos) -> None:
    """The sweep, the simulations, serving.* and the three-A table."""
    from draftsmith.eval.plots import markdown_table
    from draftsmith.eval.sweep import crossover_sentences, display_rows, load_sentences, run_sweep, write_serving

    serving = run_sweep(
        target, drafters, prompts, job.settings, job.sweep, report=report, eos_token_id=eos, progress=job.progress
    )
    for key in ("target", "drafts", "prompts_file", "draftsmith_version", "torch_version", "git_revision"):
        serving[key] = report[key]
    paths = write_serving(serving, job.out, report=report)
    print("\nThe three A (Acceptance, Acceleration, Attendance):")
    print(markdown_table(display_rows(serving["three_a"])))
    for sentence in crossover_sentences(serving) + load_sentences(serving):
        print(f"- {sentence}")
    print(f"\nwrote {', '.join(str(p) for p in paths)}")


@dataclass
class AskedPrompts:
    """The prompts of a job, every turn asked (`evaluator.prompt_turns`), and how they were made."""

    spec: str  # what --prompts named
    source: object  # sources.Source
    prompter: object  # prompts.Prompter
    chat_template: str  # the --chat-template spec
    turns: object  # evaluator.PromptTurns
    stop_ids: object  # what ends a decode: EOS, and the template's end-of-turn token when it renders

    def example(self) -> str:
        """The first prompt (and the first of a later turn), as the target reads it."""
        tokenizer, t = self.prompter.tokenizer, self.turns
        picks = [0] + [i for i, turn in enumerate(t.turns) if turn > 1][:1]
        lines = []
        for i in picks:
            text = tokenizer.decode(t.prompts[i].tolist()) if tokenizer is not None else t.prompts[i].tolist()
            lines.append(f"prompt {i + 1} (row {t.rows[i]}, turn {t.turns[i]}) as the target reads it: {text!r}")
        return "\n".join(lines)

    def provenance(self) -> dict:
        from draftsmith.distill.chat import template_hash

        p = self.prompter
        return {
            "format": self.source.format,
            "rows": len(self.source.records),
            "fingerprint": self.source.fingerprint,
            "prompts": len(self.turns.prompts),
            "turns": max(self.turns.turns),
            "plain_prompts": p.plain,
            "chat_template": {
                "spec": self.chat_template,
                "hash": template_hash(p.template),
                "used": any(p.messages(r) is not None for r in self.source.records),
            },
        }


def _ask_prompts(job, target, tokenizer, limits: dict) -> AskedPrompts:
    """Read a job's prompt source (`job.prompts`, distill/sources.py), tokenise it
    (distill/prompts.py), check that the first turns fit the models' positions (`limits`), ask the
    later turns, check them too, and print the first prompt as the models see it."""
    from draftsmith.decoding.loop import eos_set
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.distill.generate import end_of_turn_token
    from draftsmith.distill.prompts import Prompter
    from draftsmith.distill.sources import load_source
    from draftsmith.eval.evaluator import prompt_turns

    spec, settings = job.prompts, job.settings
    source = load_source(spec, limit=job.limit, task_key=getattr(job, "task_key", None))
    template = resolve_chat_template(job.chat_template, tokenizer) if tokenizer is not None else None
    prompter = Prompter(tokenizer, template, job.plain_prompts)
    stops = eos_token_id(target, tokenizer)
    if template is not None and any(prompter.messages(r) is not None for r in source.records):
        end = end_of_turn_token(tokenizer, template)  # e.g. <|im_end|>: an answer ends there
        stops = sorted(eos_set(stops) | ({end} if end is not None else set())) or None
    where = f"--prompts {spec}"
    first = [torch.tensor(prompter.ids(r), dtype=torch.long) for r in source.records]
    check_prompt_lengths(first, settings.max_new_tokens, limits, where)
    turns = prompt_turns(target, source.records, prompter, settings, stop_token_ids=stops, progress=job.progress)
    check_prompt_lengths(turns.prompts, settings.max_new_tokens, limits, where)
    asked = AskedPrompts(spec, source, prompter, job.chat_template, turns, stops)
    print(asked.example())
    return asked


# --------------------------------------------------------------------------- tune


@dataclass(frozen=True)
class TuneJob:
    target: str
    prompts: str
    settings: EvalSettings  # at num_draft_tokens = k_max; the check decodes at the chosen K
    drafter: str = ""  # KIND[:NAME]=DIR of the one drafter to tune (heads/registry.py kinds)
    limit: int | None = None
    chat_template: str = "auto"  # renders conversations: auto (the tokenizer's), none, or a Jinja file
    plain_prompts: str = "raw"  # plain "prompt" rows: raw text, or "chat" (one templated user turn)
    tree_budgets: tuple[int, ...] | None = (
        None  # tree node budgets to try (kinds with sized trees); None = 4, 8, 16, 32
    )
    trees: tuple[str, ...] | None = None  # tree specs to decode (kinds with measured trees); None = the method's
    write: bool = False  # record the chosen setting in the drafter folder's config.json
    out: str | None = None  # folder for tuning.json and the speedup-vs-setting figures
    device: str = "auto"
    dtype: str = "auto"
    progress: bool = True
    allow_target_mismatch: bool = False  # heads trained on another target: only for a fine-tune of it

    @property
    def k_max(self) -> int:
        return self.settings.num_draft_tokens


def run_tune(job: TuneJob) -> dict:
    """Measure acceptance at K = k_max, the draft cost and v(n); choose with eval/tune.py; check the
    choice with a timed decode; with `write`, record it (write_setting). Returns {"setting": the
    chosen setting, "recorded": the config.json written, or None}."""
    from draftsmith.decoding.target import max_positions
    from draftsmith.eval.sweep import measure_chain
    from draftsmith.eval.tune import tune_chain, tune_measured_trees, tune_medusa_tree

    out = _out_folder(job.out)
    target, tokenizer, drafter, folder, kind = load_chain_drafter(
        job.target, job.drafter, device=job.device, dtype=job.dtype, allow_target_mismatch=job.allow_target_mismatch
    )
    asked = _ask_prompts(job, target, tokenizer, {f"the target {job.target!r}": max_positions(target.config)})
    prompts, eos = asked.turns.prompts, asked.stop_ids
    k_max = job.k_max
    if max(drafter.proposal_sizes(k_max)) < k_max:  # heads that draft a fixed number of positions
        most = max(drafter.proposal_sizes(k_max))
        print(f"note: {folder} drafts at most {most} tokens per call: K is searched up to {most}, not {k_max}")
        k_max = most
    budgets = list(job.tree_budgets or [4, 8, 16, 32])
    method = get_method(kind)
    heads = drafter.heads if method.sized_trees else None
    accuracies = getattr(heads.config, "head_accuracies", None) if heads is not None else None  # sized trees
    if job.tree_budgets and heads is None:
        raise SpecError(f"--tree-budgets applies to heads whose trees are built from measured accuracies, not {kind}")
    if heads is not None and not accuracies:
        print(
            f"note: {folder} records no head accuracies (train it with `draftsmith train {kind}`): the tree size is not tuned"
        )
    if job.trees and not method.tune_trees:
        decoded = ", ".join(m.title for m in METHODS.values() if m.tune_trees)
        raise SpecError(f"--trees applies to heads whose trees are decoded per setting ({decoded}), not {kind}")
    trees = _tree_rows(method, drafter, target, job.trees or method.tune_trees)

    settings = replace(job.settings, num_draft_tokens=k_max)
    measured = measure_chain(
        target,
        drafter,
        prompts,
        k_max,
        settings,
        eos_token_id=eos,
        progress=job.progress,
        verify_sizes=[b + 1 for b in budgets]
        if accuracies
        else [max(row.proposal_sizes(row.max_depth)) + 1 for row in trees.values()],
    )
    try:
        draft_seconds = measured.draft_seconds
    except ValueError as err:  # e.g. every prompt one token long: nothing to draft from
        raise SpecError(f"--prompts {job.prompts}: {err}") from None
    verify = ", ".join(f"v({n}) {1000 * v:.3f}" for n, v in measured.verify_seconds.items())
    print(
        f"== {drafter.name}: K = {k_max} on {len(prompts)} prompts, {settings.max_new_tokens} new tokens, "
        f"{settings.sampling.describe()}: tau {measured.tau:.2f} (counts the bonus token), alpha per position "
        + " ".join("-" if a is None else f"{a:.2f}" for a in measured.alpha_per_position)
    )
    if measured.per_step:
        cost = f"{measured.draft_ms_per_step:.3f} ms per step"
    else:
        cost = f"{measured.draft_ms_per_token:.3f} ms per drafted token"
    print(f"draft cost {cost}; verify cost (ms, medians, device-synchronised): {verify}")
    tunings = {"chain": tune_chain(measured.alpha_per_position, draft_seconds, measured.verify_seconds)}
    print("\n" + tunings["chain"].table())
    if accuracies:
        tree = f"{kind}-tree"
        tunings[tree] = tune_medusa_tree(accuracies, budgets, measured.verify_seconds, draft_seconds=draft_seconds(1))
        print("\n" + tunings[tree].table())
    if trees:
        points = _measure_trees(job, target, trees, prompts, eos)
        tunings[f"{kind}-tree"] = tune_measured_trees(points, measured.verify_seconds)
        print("\n" + tunings[f"{kind}-tree"].table())
    choice = max(tunings, key=lambda k: tunings[k].best.speedup)  # the chain first: a tie keeps it
    tuning = tunings[choice]
    setting = tuning.setting()
    best = tuning.best
    print(f"\nchosen: {choice} {best.label}, predicted speedup {best.speedup:.2f}x (tau {best.tau:.2f})")
    check, speedup = _check_choice(job, target, drafter, method, prompts, eos, tuning, setting, trees)
    if out is not None:
        _write_tuning(job, out, drafter, folder, measured, tunings, choice, setting, speedup, check, len(prompts))
    recorded = None
    if job.write and setting["num_speculative_tokens"] > 0:
        from draftsmith.eval.tune import write_setting

        try:
            recorded = write_setting(folder, tuning)
        except ValueError as err:
            raise SpecError(f"--write: {err}") from None
        print(f"recorded {json.dumps({key: setting[key] for key in setting if key != 'tree'})} in {recorded}")
    return {"setting": setting, "folder": str(folder), "recorded": recorded}


def _tree_rows(method, drafter, target, specs) -> dict:
    """{spec: the tree row of the chain drafter's head} for each of `specs` (method.tree_spec's form);
    a row's `tree` holds its options, its `max_depth` the depth it reaches (drafts plus one)."""
    rows = {}
    for spec in specs:
        try:
            rows[spec] = method.rows(drafter.head, target, method.kind, RowOptions(tree=spec))[f"{method.kind}-tree"]
        except ValueError as err:
            raise SpecError(f"--trees: {err}") from None
    return rows


def _measure_trees(job: TuneJob, target, trees: dict, prompts, eos) -> list[dict]:
    """Each tree of `trees` (`_tree_rows`) decoded on the prompts beside target-only, in one
    evaluation: its tau (counting the bonus token) and its drafting seconds per step, as
    eval.tune.tune_measured_trees takes them (labelled by its spec)."""
    from draftsmith.eval.evaluator import evaluate

    named = {f"tree {spec}": row for spec, row in trees.items()}
    k = {name: row.max_depth for name, row in named.items()}
    report = evaluate(target, named, prompts, job.settings, eos_token_id=eos, progress=job.progress, num_draft_tokens=k)
    rows = {row["method"]: row for row in report["methods"]}
    points = []
    for name, row in named.items():
        measured = rows[name]
        step = measured["drafter_seconds"] / max(1, measured["target_calls"])
        setting = {"num_speculative_tokens": row.max_depth, **row.tree}
        nodes = max(row.proposal_sizes(row.max_depth))
        points.append(
            {"label": name, "setting": setting, "num_nodes": nodes, "tau": measured["tau"], "draft_seconds": step}
        )
        print(
            f"{name}: tau {measured['tau']:.2f} (counts the bonus token), drafting {1000 * step:.3f} ms per step, "
            f"measured speedup {measured['speedup']:.2f}x"
        )
    return points


def _check_choice(job: TuneJob, target, drafter, method, prompts, eos, tuning, setting, trees):
    """A timed decode at the chosen setting: (how it compares with the prediction, its speedup);
    `trees`: the rows `_measure_trees` decoded, by spec."""
    from draftsmith.eval.evaluator import evaluate
    from draftsmith.eval.tune import compare_prediction

    k = setting["num_speculative_tokens"]
    if k == 0:
        print("no setting beats target-only decoding on these measured costs: serve without this drafter")
        return None, None
    chosen = drafter
    if setting.get("tree"):
        rows = method.rows(drafter.heads, target, method.kind, RowOptions(tree=json.dumps(setting["tree"])))
        chosen = rows[f"{method.kind}-tree"]
    elif tuning.kind == "tree":  # a tree decoded per setting (eval.tune.tune_measured_trees)
        chosen = {f"tree {spec}": row for spec, row in trees.items()}[tuning.best.label]
    settings = replace(job.settings, num_draft_tokens=k)
    report = evaluate(target, {chosen.name: chosen}, prompts, settings, eos_token_id=eos, progress=job.progress)
    speedup = report["methods"][1]["speedup"]
    check = compare_prediction(tuning.best.speedup, speedup)
    print(f"check at {tuning.best.label} ({job.settings.repeats} timed passes): {check.sentence}")
    return check, speedup


def _write_tuning(
    job: TuneJob, out: Path, drafter, folder, measured, tunings, kind, setting, speedup, check, num_prompts
) -> None:
    """tuning.json and one speedup-vs-setting figure per tuning."""
    from draftsmith.eval.plots import plot_speedup_vs_k
    from draftsmith.eval.report import dumps_strict, write_atomic
    from draftsmith.eval.tune import TUNING_AXIS

    record = {
        "drafter": {"folder": str(folder), "name": drafter.name},
        "target": str(job.target),
        "prompts_file": str(job.prompts),
        "num_prompts": num_prompts,
        "measurement": measured.to_dict(),
        "tunings": {
            name: {"candidates": t.rows(), "chosen": t.setting(), "model": t.model, "notes": t.notes}
            for name, t in tunings.items()
        },
        "chosen": setting,
        "measured_speedup": speedup,
        "measured_over_predicted": None if check is None else check.ratio,
    }
    write_atomic(out / "tuning.json", dumps_strict(record))
    figures = []
    for name, t in tunings.items():
        label, axis = (drafter.name, "k") if name == "chain" else (name, "nodes")
        x = setting.get(TUNING_AXIS[t.kind][0])
        point = {label: {x: speedup}} if speedup is not None and name == kind else None
        figures.append(plot_speedup_vs_k({label: t}, out / f"speedup_vs_{axis}.png", measured=point))
    print(f"wrote {out / 'tuning.json'} and {', '.join(str(f) for f in figures)}")


# --------------------------------------------------------------------------- check-lossless


@dataclass(frozen=True)
class LosslessJob:
    specs: DrafterSpecs
    prompt: str = "def main():\n    "  # tokenized with the target's tokenizer (distill/prompts.py)
    prompts: str | None = None  # instead of `prompt`: a prompt source, whose first row's first turn is checked
    chat_template: str = "auto"  # renders conversations: auto (the tokenizer's), none, or a Jinja file
    plain_prompts: str = "raw"  # a plain prompt: raw text, or "chat" (one templated user turn)
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    temperature: float = 1.0  # the check needs sampling
    top_k: int = 0
    top_p: float = 1.0
    samples: int = 2000  # decodes (>= MIN_SAMPLES; more = more power)
    threshold: float = 1e-3  # fail when a p-value is below this
    seed: int = 0
    progress: bool = True
    batch_size: int = 1  # B copies of the prompt per call: the batched path (every row is one sample)
    static_cache: bool = False  # the preallocated-cache path ...
    compile: bool | str = False  # ... and its compiled steps

    def check(self) -> None:
        """The settings that make the test meaningless, refused before anything is loaded."""
        if not isinstance(self.samples, int) or self.samples < MIN_SAMPLES:
            raise SpecError(
                f"--samples must be an integer >= {MIN_SAMPLES} (fewer make the chi-square test meaningless), "
                f"got {self.samples!r}"
            )
        if not 0.0 < self.threshold < 1.0:
            raise SpecError(
                f"--threshold is the p-value below which the check fails: it must be in (0, 1), e.g. 0.001, "
                f"got {self.threshold:g}"
            )


def run_check_lossless(job: LosslessJob) -> bool:
    """The chi-square check for every drafter of `job.specs`; True when all of them pass."""
    from draftsmith.distill.chat import resolve_chat_template
    from draftsmith.distill.prompts import Prompter
    from draftsmith.distill.sources import Record, load_source
    from draftsmith.eval.lossless import check_lossless
    from draftsmith.heads.models import ModelLoadError

    job.check()
    target, tokenizer, drafters, _, _ = load_drafters(job.specs)
    if tokenizer is None and job.prompts is None:
        raise ModelLoadError(f"--target {job.specs.target!r} has no tokenizer to encode --prompt")
    if job.prompts is not None:
        record = load_source(job.prompts).records[0]  # every row read: a bad row is reported, not skipped
    else:
        record = Record(0, job.prompt, None, where="--prompt")
    template = resolve_chat_template(job.chat_template, tokenizer) if tokenizer is not None else None
    prompt = torch.tensor(Prompter(tokenizer, template, job.plain_prompts).ids(record), dtype=torch.long)
    if tokenizer is not None:
        print(f"prompt as the target reads it: {tokenizer.decode(prompt.tolist())!r}")
    limits = _position_limits(job.specs, target, drafters)
    where = f"--prompts {job.prompts}" if job.prompts is not None else "--prompt"
    check_prompt_lengths([prompt], job.num_draft_tokens + 1, limits, where)  # one call: K drafts + the bonus
    passed = True
    for name, drafter in drafters.items():
        path = "compiled" if job.compile else "static cache" if job.static_cache else "default"
        print(
            f"== {name}: K = {job.num_draft_tokens}, T = {job.temperature:g}, top_k = {job.top_k}, "
            f"top_p = {job.top_p:g}, batch {job.batch_size}, {path} path"
        )
        result = check_lossless(
            target,
            drafter,
            prompt,
            num_draft_tokens=job.num_draft_tokens,
            temperature=job.temperature,
            top_k=job.top_k,
            top_p=job.top_p,
            samples=job.samples,
            seed=job.seed,
            threshold=job.threshold,
            progress=job.progress,
            batch_size=job.batch_size,
            static_cache=job.static_cache,
            compile=job.compile,
        )
        print(result.describe())
        passed &= result.passed
    return passed
