"""On-policy post-training of a trained head (Draft-OPD, arXiv 2605.29343): decode with it, replay its calls.

    python -m draftsmith.train.onpolicy --recipe recipes/smollm2/onpolicy.yaml
    python -m draftsmith.train.onpolicy --recipe recipes/smollm2/onpolicy.yaml rounds=2 temperature=1.0
    accelerate launch train/onpolicy.py --recipe recipes/smollm2/onpolicy.yaml   # one process, same loop

Any trained head of a kind whose registry entry has a `replay` (`KINDS`; the kind is read from the
folder) is post-trained in rounds; round r:
1. rollout: draftsmith's own decoder (`generate_batch`) decodes `prompts_per_round` training prompts of
   `data` with the head saved by round r - 1 (round 1: `head`), loaded as `draftsmith eval` loads it,
   through a recorder (`decoding/recorder.py`) that keeps every call's anchor, drafts, accepted count
   and correction; the rows (prompt + emitted tokens) are the lossless decoder's output, so samples of
   the target;
2. replay: `steps_per_round` AdamW steps on those rows: the method's own loss at the recorded calls and
   Draft-OPD's terms on their accepted and rejected drafts (`train/draft_opd.py`; the maths, in
   docs/onpolicy.md);
3. the head saved to OUT/round-r in its method's own layout (`draftsmith eval --drafter KIND=OUT/round-r`),
   then decoded on held-out prompts of `data` (its held-out split, `heldout_fraction`) at `eval_temperature`
   (unset: the rollouts' `temperature`).
OUT/report.json (and the printed table) hold each round's held-out decoded tau, round 0 being the
starting head: tokens per target call of chain decoding at K = `num_draft_tokens`, the bonus
token counted, over the calls that could draft all K (`train.common.decoded_tau`, the serve check's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.heads.registry import METHODS
from draftsmith.train.draft_opd import Episode, OPDWeights, replay_batch, replay_losses
from draftsmith.train.recipe import RecipeError, RunRecipe, _check_value, recipe_dict
from draftsmith.train.run import data_target_note
from draftsmith.train.run_folder import check_out_writable, refuse_earlier_run

KINDS = tuple(kind for kind, method in METHODS.items() if method.replay)  # the methods whose calls can be replayed
REPORT = "report.json"


@dataclass(kw_only=True)
class OnPolicyRecipe:
    """Every key of an on-policy run; unknown keys are errors (`train.recipe.load_recipe`)."""

    target: str  # HF folder (or hub id) of the target the head drafts for
    head: str  # a trained head folder, in any layout its method loads (draftsmith, speculators, ...)
    data: str  # a `draftsmith generate` folder of this target: its prompts are the rollouts'
    out: str  # OUT/round-<r>/ heads, report.json, metrics.jsonl, recipe.json
    kind: str | None = None  # the head's method; None: read from its config.json (heads/registry.py)
    rounds: int = 3  # rollout -> replay rounds
    steps_per_round: int = 50  # replay optimizer steps per round
    prompts_per_round: int = 64  # training prompts each rollout decodes (fresh ones each round while they last)
    max_new_tokens: int = 128  # tokens decoded per prompt, rollouts and held-out evaluation alike
    num_draft_tokens: int | None = None  # K; None: a block head's drafts per block, else its registry default_k
    temperature: float = 0.0  # the rollouts' sampling (0: greedy)
    eval_temperature: float | None = None  # the held-out decode's (None: the rollouts': a head post-trained on
    # sampled rollouts is measured where it is meant to serve); sampled: the same seeded streams each round
    rollout_batch_size: int = 16  # prompts decoded together
    batch_size: int = 8  # rollout rows per replay step (every call of a row is replayed)
    lr: float = 1e-4  # constant; post-training nudges a trained head (not tuned here)
    grad_clip: float = 1.0  # clip the gradient norm (0: no clipping)
    replay_weight: float = 1.0  # the method's own loss at the recorded calls (0: the Draft-OPD terms alone)
    accepted_weight: float = 1.0  # Bernoulli forward KL on accepted drafts
    rejected_weight: float = 1.0  # k3 estimate of KL(q || p) on rejected drafts
    rejected_decay: float = 0.5  # a rejected draft at offset o past the last accepted one weighs decay^(o - 1)
    method_recipe: dict = field(default_factory=dict)  # keys of the head's trainer recipe its loss reads,
    # e.g. {loss: tv, decay_gamma: 2}, over those the head's run folder recorded (its recipe.json; none
    # there: that trainer's defaults); the head's shape comes from the head
    heldout_fraction: float = 0.05  # the data's held-out split as the trainers take it (every 1/f-th row)
    eval_prompts: int = 16  # held-out prompts decoded per round
    allow_target_mismatch: bool = False  # a head or data of another target: only for a fine-tune of it
    seed: int = 0
    device: str = "auto"  # auto: CUDA when available
    dtype: str = "auto"  # the target's (and the decoded head's): auto = bf16 on CUDA, fp32 on CPU

    @property
    def held_out_temperature(self) -> float:
        return self.temperature if self.eval_temperature is None else self.eval_temperature

    def __post_init__(self):
        for f in dataclasses.fields(self):  # nan <= 0 is False: a nan would pass every check below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} = {value} must be a finite number")
        for name in ("rounds", "steps_per_round", "prompts_per_round", "rollout_batch_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.eval_prompts < 1:
            raise ValueError(f"eval_prompts = {self.eval_prompts} must be >= 1 (the report is held-out tau per round)")
        if self.max_new_tokens < 2:
            raise ValueError(
                f"max_new_tokens = {self.max_new_tokens} must be >= 2 (a call drafts before the last token)"
            )
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens = {self.num_draft_tokens} must be >= 1 (or unset: the head's)")
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"kind = {self.kind!r}: on-policy post-training supports {', '.join(KINDS)}")
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ValueError(
                f"eval_temperature = {self.eval_temperature} must be >= 0 (0: greedy; unset: temperature's)"
            )
        if self.temperature < 0 or self.lr <= 0 or self.grad_clip < 0:
            raise ValueError(
                f"need temperature >= 0, lr > 0, grad_clip >= 0; got {self.temperature}, {self.lr}, {self.grad_clip}"
            )
        weights = {name: getattr(self, name) for name in ("replay_weight", "accepted_weight", "rejected_weight")}
        if min(weights.values()) < 0 or not any(weights.values()):
            raise ValueError(f"{weights}: each weight must be >= 0 and one of them > 0")
        if not 0 <= self.rejected_decay <= 1:
            raise ValueError(f"rejected_decay = {self.rejected_decay} must be in [0, 1] (0: the rejected draft alone)")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"heldout_fraction = {self.heldout_fraction} must be in (0, 1): the report decodes held-out prompts"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device = {self.device!r}: expected auto, cpu or cuda")

    @property
    def weights(self) -> OPDWeights:
        return OPDWeights(self.replay_weight, self.accepted_weight, self.rejected_weight, self.rejected_decay)


# ---------------------------------------------------------------------- what the run starts from
def head_method(recipe: OnPolicyRecipe):
    """The registry entry of `recipe.head`: its config.json's, checked against `kind` when the recipe
    names one, and refused (one line naming the kinds there are) unless its calls can be replayed."""
    from draftsmith.heads.registry import get_method, method_of_folder

    folder = Path(recipe.head)
    if not (folder / "config.json").is_file():
        raise RecipeError(f"head = {recipe.head!r}: no config.json there (give a trained head folder)")
    found = method_of_folder(folder)
    if recipe.kind is not None and found is not None and found.kind != recipe.kind:
        raise RecipeError(f"head = {recipe.head!r} holds a {found.title} (kind {found.kind}), but kind = {recipe.kind}")
    method = found if found is not None else get_method(recipe.kind) if recipe.kind else None
    if method is None or method.kind not in KINDS:
        what = f"a {method.title} (kind {method.kind})" if method else "no drafter layout draftsmith knows"
        raise RecipeError(f"head = {recipe.head!r} holds {what}: on-policy post-training supports {', '.join(KINDS)}")
    return method


#: A trainer recipe's keys that name the run's inputs, not its loss: never carried over from a recorded run.
INPUT_KEYS = ("hidden_cache", "vocab_map")


def recorded_method_recipe(head_folder) -> tuple[dict, str | None]:
    """(the trainer recipe the head was trained with, the file it comes from): the `recipe.json` of its run
    folder (the head's parent: a trainer's own, or an on-policy run's `method_recipe_resolved`), else
    ({}, None)."""
    path = Path(head_folder).parent / "recipe.json"
    if not path.is_file():
        return {}, None
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"{str(path)!r} (the head's run recipe) is not readable JSON: {err}") from None
    if not isinstance(recorded, dict):
        raise RecipeError(f"{str(path)!r} (the head's run recipe) holds {type(recorded).__name__}, expected a mapping")
    return recorded.get("method_recipe_resolved", recorded), str(path)


def method_recipe(recipe: OnPolicyRecipe, method, head=None):
    """The head's trainer recipe its loss reads: the loss keys its run folder recorded (else that trainer's
    defaults), `recipe.method_recipe` over them, and (with the loaded `head`) the keys its config fixes
    (its replay's `shape_keys`, e.g. block_size)."""
    cls = method.part("recipe")
    # the keys every trainer shares (lr, max_steps, ...) are the run's, never its loss's: refused, not ignored
    shared = {f.name for f in dataclasses.fields(RunRecipe)}
    given, own = dict(recipe.method_recipe), {f.name for f in dataclasses.fields(cls)} - shared
    recorded = {k: v for k, v in recorded_method_recipe(recipe.head)[0].items() if k in own and k not in INPUT_KEYS}
    unknown = sorted(set(given) - own)
    if unknown:
        raise RecipeError(
            f"method_recipe: unknown key(s) {', '.join(unknown)} for {method.kind} ({cls.__name__}'s own keys: "
            f"{', '.join(sorted(own))})"
        )
    keys = method.part("replay").shape_keys if head is not None else ()
    shape = {key: getattr(head.config, key) for key in keys}
    for key, value in shape.items():
        if key in given and given[key] != value:
            raise RecipeError(f"method_recipe: {key} = {given[key]!r}, but the head's is {value!r}: remove it")
    values = {"target": recipe.target, "data": recipe.data, "out": recipe.out, **recorded, **given, **shape}
    try:
        return cls(**{name: _check_value(cls, name, value, "method_recipe") for name, value in values.items()})
    except ValueError as err:  # RecipeError of a type, or the method recipe's own check of a value
        raise RecipeError(str(err) if str(err).startswith("method_recipe") else f"method_recipe: {err}") from None


def repeated_rows_note(recipe: OnPolicyRecipe, provenance: dict) -> str | None:
    """A note when the rollouts can only repeat the data: greedy rollouts, no longer than the answers of
    data generated greedily, are those answers (the decoder is lossless), up to bf16 near-ties."""
    settings = provenance.get("settings") or {}
    if recipe.temperature or settings.get("temperature") != 0:
        return None
    if recipe.max_new_tokens > settings.get("max_new_tokens", 0):
        return None
    return (
        f"note: the data are the target's greedy answers (up to {settings['max_new_tokens']} tokens) and the "
        f"rollouts are greedy (up to {recipe.max_new_tokens}): the rows replayed are the head's own training rows, "
        "and only which drafts were accepted or rejected is new; temperature > 0 rolls out rows it has not seen"
    )


# ---------------------------------------------------------------------- rollouts and evaluation
def rollout(target, drafter, prompts: list[list[int]], recipe: OnPolicyRecipe, k: int, seed: int) -> list[Episode]:
    """Each prompt decoded by the decoder with `drafter`, every call recorded (`RecordingDrafter`)."""
    from draftsmith.decoding import SamplingConfig, generate_batch
    from draftsmith.decoding.recorder import RecordingDrafter
    from draftsmith.eval.drafter_specs import eos_token_id

    device, recorder = target.get_output_embeddings().weight.device, RecordingDrafter(drafter)
    sampling, episodes = SamplingConfig(temperature=recipe.temperature), []
    for lo in range(0, len(prompts), recipe.rollout_batch_size):
        chunk = prompts[lo : lo + recipe.rollout_batch_size]
        result = generate_batch(
            target,
            [torch.tensor(p, dtype=torch.long, device=device) for p in chunk],
            recorder,
            num_draft_tokens=k,
            max_new_tokens=recipe.max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id(target, None),
            seed=(seed * 1_000_003 + lo) % 2**32,  # each chunk its own streams (row b: `row_seed`)
        )
        episodes += [Episode(p, t, c) for p, t, c in zip(chunk, result.tokens, recorder.calls(result))]
    return episodes


def rollout_summary(episodes: list[Episode], k: int) -> dict:
    """Counts of a rollout and its tau: tokens per call at the rollout's temperature, bonus counted, over
    the calls that drafted all K (as the held-out tau)."""
    calls = [c for e in episodes for c in e.calls]
    full = [c.accepted + 1 for c in calls if len(c.drafts) == k] or [c.accepted + 1 for c in calls]
    return {
        "prompts": len(episodes),
        "tokens": sum(len(e.tokens) for e in episodes),
        "calls": len(calls),
        "accepted_drafts": sum(c.accepted for c in calls),
        "rejected_calls": sum(c.rejected for c in calls),
        "tau": sum(full) / max(1, len(full)),
    }


def heldout_tau(target, drafter, prompts, k: int, recipe: OnPolicyRecipe) -> dict:
    from draftsmith.train.common import decoded_tau

    tau, calls, se = decoded_tau(
        target, drafter, prompts, k, recipe.max_new_tokens, recipe.held_out_temperature, recipe.seed
    )
    return {"tau_decoded": tau, "tau_standard_error": se, "target_calls": calls}


def round_rows(train_rows: list[int], recipe: OnPolicyRecipe, r: int) -> list[int]:
    """The training rows of round r's rollout: the next `prompts_per_round` of one seeded order (wrapping
    once every row was used), so rounds decode fresh prompts while there are any."""
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(recipe.seed)).tolist()
    n, start = min(recipe.prompts_per_round, len(train_rows)), (r - 1) * recipe.prompts_per_round
    return [train_rows[order[(start + i) % len(order)]] for i in range(n)]


# ---------------------------------------------------------------------- the run
def train(recipe: OnPolicyRecipe, *, progress: bool = True) -> dict:
    """The rounds (module docstring); returns the report. Every input is checked before `out` is made, so
    a bad one leaves nothing there; once rounds run, each round's head is written whole (a temporary
    folder, renamed) and report.json is rewritten after it (`complete`: false until the last round), so
    a run stopped in round r keeps rounds 1..r-1 and says so."""
    from draftsmith.distill.data import DistillData, write_json_atomic
    from draftsmith.eval.drafter_specs import Drafter, SpecError, chain_drafter, load_checked
    from draftsmith.heads.models import load_causal_lm, resolve_device, resolve_dtype
    from draftsmith.train.common import heldout_prompts, split_rows
    from draftsmith.train.run import TrainingError, fp32_master

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("on-policy post-training runs in one process (launch it without --num_processes > 1)")
    out = Path(recipe.out)
    check_out_writable(out)
    refuse_earlier_run(out)
    if (out / REPORT).exists():
        raise RecipeError(f"out {str(out)!r} already holds an on-policy run ({REPORT}): choose another out")
    method = head_method(recipe)
    replay = method.part("replay")
    method_recipe(recipe, method)  # its keys checked before anything loads
    device = resolve_device(recipe.device)
    dtype = resolve_dtype(recipe.dtype, device)
    if dtype == torch.float16 and device.type == "cpu":
        raise RecipeError("dtype = float16 on the CPU: use float32 or bfloat16")
    torch.manual_seed(recipe.seed)

    data = DistillData(recipe.data)
    train_rows, heldout_rows = split_rows(len(data), recipe.heldout_fraction)
    if not train_rows or not heldout_rows:
        raise RecipeError(f"data {recipe.data!r} ({len(data)} rows) leaves no training or no held-out row")
    heldout = heldout_prompts(data, heldout_rows, recipe.eval_prompts)
    target = load_causal_lm(recipe.target, device=device, dtype=dtype, role="target").requires_grad_(False)
    for note in (data_target_note(recipe, data, target), repeated_rows_note(recipe, data.provenance)):
        if note:
            print(note, file=sys.stderr)

    def drafter_of(folder):
        try:
            return chain_drafter(
                method.kind, folder, target, device, dtype, allow_target_mismatch=recipe.allow_target_mismatch
            )
        except SpecError as err:
            raise RecipeError(f"head = {str(folder)!r}: {err}") from None

    drafter = drafter_of(recipe.head)  # what `draftsmith eval` decodes: also round 1's rollout drafter
    allowed = recipe.allow_target_mismatch
    head = load_checked(Drafter(method.kind, method.kind, recipe.head), target, device, dtype, allowed)
    fp32_master(head)  # trainable weights and AdamW state in fp32; the frozen target copies keep `dtype`
    losses_recipe = method_recipe(recipe, method, head)
    k = recipe.num_draft_tokens or getattr(head.config, "drafts_per_block", method.default_k)
    most = getattr(head.config, "drafts_per_block", None)
    if most is not None and k > most:
        raise RecipeError(f"num_draft_tokens = {k}: the {method.title} drafts {most} tokens per block")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.95))  # the trainers' betas
    half = dtype in (torch.bfloat16, torch.float16)  # the head's forward under the target dtype's autocast,
    # as its trainer ran it (fp32 targets: none)
    saver = _resolve(replay.save)

    out.mkdir(parents=True, exist_ok=True)
    resolved = recipe_dict(recipe) | {"kind": method.kind, "num_draft_tokens": k}
    source = recorded_method_recipe(recipe.head)[1] or f"{method.part('recipe').__name__}'s defaults"
    resolved |= {"method_recipe_resolved": recipe_dict(losses_recipe), "method_recipe_base": source}
    write_json_atomic(out / "recipe.json", resolved)
    print(f"on-policy post-training of {method.title} {recipe.head!r}: {recipe.rounds} rounds, K = {k}")
    rounds = [{"round": 0, "head": str(recipe.head), **heldout_tau(target, drafter, heldout, k, recipe)}]
    report = {
        "kind": method.kind,
        "start": str(recipe.head),
        "num_draft_tokens": k,
        "rollout_temperature": recipe.temperature,
        "heldout_prompts": len(heldout),
        "new_tokens": recipe.max_new_tokens,
        "eval_temperature": recipe.held_out_temperature,
        "tau": f"held-out tau_decoded: chain decoding by draftsmith's decoder at T = {recipe.held_out_temperature:g} "
        f"({'greedy' if recipe.held_out_temperature == 0 else f'the same seeded streams (seed {recipe.seed}) each round'}), "
        "tokens per target call over the calls that drafted all K, the bonus token counted (plain decoding scores 1.00)",
        "rounds": rounds,
        "complete": False,
    }
    write_json_atomic(out / REPORT, report)
    print(_row(rounds[0]))
    step = 0
    for r in range(1, recipe.rounds + 1):
        rows = round_rows(train_rows, recipe, r)
        prompts = heldout_prompts(data, rows, len(rows))  # the prompts of any rows (here training ones)
        episodes = rollout(target, drafter, prompts, recipe, k, recipe.seed + r)
        parts = []
        head.train()
        bar = _bar(progress, recipe.steps_per_round, f"round {r}")
        for s in range(recipe.steps_per_round):
            pick = torch.randperm(len(episodes), generator=torch.Generator().manual_seed(recipe.seed * 7919 + step))
            chosen = [episodes[i] for i in pick[: recipe.batch_size].tolist()]
            batch = replay_batch(chosen, width=k, offset=replay.offset, pad_id=_pad_id(target), device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=half):
                loss, part = replay_losses(replay, head, target, batch, losses_recipe, recipe.weights)
            if not torch.isfinite(loss):
                raise TrainingError(
                    f"on-policy round {r}, step {s + 1}: the loss became {loss.item()}; the rounds before are in "
                    f"{str(out)!r} ({REPORT}). Lower lr, check grad_clip."
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip) if recipe.grad_clip else None
            optimizer.step()
            step += 1
            part = {"loss": float(loss.detach()), **part, **({"grad_norm": float(norm)} if norm is not None else {})}
            parts.append(part)
            _log(out, {"round": r, "step": step, **part})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{part['loss']:.4f}")
        if bar is not None:
            bar.close()
        head.eval()
        folder = out / f"round-{r}"
        saver(head, folder)
        drafter = drafter_of(folder)  # as `draftsmith eval --drafter KIND=OUT/round-r` loads it
        means = {
            key: sum(p[key] for p in parts) / len(parts)
            for key in ("loss", "method_loss", "accepted_kl", "rejected_k3")
        }
        rounds.append(
            {
                "round": r,
                "head": str(folder),
                **heldout_tau(target, drafter, heldout, k, recipe),
                "rollout": rollout_summary(episodes, k),
                "replay": {"steps": len(parts), **means},
            }
        )
        report["complete"] = r == recipe.rounds
        write_json_atomic(out / REPORT, report)
        print(_row(rounds[-1]))
    print(table(report))
    return report


def _resolve(ref: str):
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _bar(progress: bool, total: int, desc: str):
    """A progress bar over a round's replay steps (None when the run shows no progress)."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step")


def _pad_id(target) -> int:
    return target.config.pad_token_id if target.config.pad_token_id is not None else 0


def _log(out: Path, record: dict) -> None:
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _row(entry: dict) -> str:
    rollout, replay = entry.get("rollout"), entry.get("replay")
    return (
        f"round {entry['round']}: held-out tau {entry['tau_decoded']:.3f} +- {entry['tau_standard_error']:.3f} "
        f"({entry['target_calls']} calls)"
        + (f", rollout tau {rollout['tau']:.3f} over {rollout['calls']} calls" if rollout else "")
        + (f", replay loss {replay['loss']:.4f}" if replay else "")
    )


def table(report: dict) -> str:
    """The report as a table: one line per round."""
    lines = [f"{'round':>5}  {'held-out tau':>15}  {'calls':>6}  {'rollout tau':>11}  {'replay loss':>11}  head"]
    for e in report["rounds"]:
        rollout = f"{e['rollout']['tau']:.3f}" if "rollout" in e else "-"
        loss = f"{e['replay']['loss']:.4f}" if "replay" in e else "-"
        tau, calls = f"{e['tau_decoded']:.3f} +- {e['tau_standard_error']:.3f}", e["target_calls"]
        lines.append(f"{e['round']:>5}  {tau:>15}  {calls:>6}  {rollout:>11}  {loss:>11}  {e['head']}")
    return "\n".join(lines) + f"\n(tau: {report['tau']}; +-: its standard error over the calls, taken as independent)"


def main(argv=None) -> int:
    """`python -m draftsmith.train.onpolicy --recipe NAME|FILE [key=value ...]`: a user error is one line on
    stderr and exit status 2."""
    import argparse

    from draftsmith.eval.drafter_specs import SpecError
    from draftsmith.train.command_line import user_errors
    from draftsmith.train.recipe import load_recipe, parse_overrides
    from draftsmith.train.recipe_files import find_recipe

    parser = argparse.ArgumentParser(prog="train/onpolicy.py", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--recipe", required=True, metavar="NAME|FILE", help="a recipe YAML, or a shipped NAME")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(OnPolicyRecipe, find_recipe(args.recipe), parse_overrides(args.overrides))
        train(recipe, progress=not args.no_progress)
    except (*user_errors(), SpecError) as err:
        print(f"train/onpolicy.py: error: {err}", file=sys.stderr)
        return 2
    print(f"heads written to {Path(recipe.out)}/round-1..{recipe.rounds}, report to {Path(recipe.out) / REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
