"""Small pieces every training loop shares: the held-out split, the batch order, the schedule.

Functions, not a framework: each loop in train/ reads top to bottom and calls these by name.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from draftsmith.distill.acceptance import simulated_tau, walk_tau


def split_rows(n: int, heldout_fraction: float) -> tuple[list[int], list[int]]:
    """Every round(1/f)-th row is held out: deterministic, spread over the whole data."""
    if heldout_fraction == 0 or n < 2:
        return list(range(n)), []
    every = max(2, round(1 / heldout_fraction))
    return [i for i in range(n) if i % every], [i for i in range(n) if i % every == 0]


def batch_rows(
    train_rows: list[int],
    step: int,
    micro: int,
    batch_size: int,
    grad_accum: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    lengths: bytes | None = None,
) -> list[int]:
    """Rows of micro-batch `micro` of optimizer step `step` on process `rank`.

    A pure function of (seed, step): epochs are seeded permutations of the training rows
    (`epoch_order`: with `lengths`, grouped by length into optimizer steps), so a resumed run reads
    exactly the batches an uninterrupted run would have read, the processes of a multi-process run
    read disjoint rows of each step, and a step holds the same rows whatever its split into
    processes and micro-batches.
    """
    per_step = batch_size * grad_accum * world
    start = step * per_step + micro * batch_size * world + rank * batch_size
    n = len(train_rows)
    rows = []
    for position in range(start, start + batch_size):
        epoch, offset = divmod(position, n)
        rows.append(train_rows[int(epoch_order(n, seed, epoch, per_step, lengths)[offset])])
    return rows


def length_bytes(lengths, max_length: int) -> bytes:
    """`epoch_order`'s `lengths`: each training row's token count, cut to `max_length`, as int32 bytes
    (hashable, so the epoch's order is computed once)."""
    return np.minimum(np.asarray(lengths), max_length).astype(np.int32).tobytes()


LENGTH_WINDOW = 32  # steps sorted together: padding falls to a few percent, steps stay a random mix


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int, per_step: int, lengths: bytes | None = None) -> torch.Tensor:
    """[n]: the order of the training rows in epoch `epoch`, a seeded permutation. With `lengths`
    (int32 bytes, one per training row) it is grouped by length: each window of LENGTH_WINDOW
    optimizer steps (`per_step` rows each) of the permutation is sorted by length, cut into steps,
    and those steps shuffled, so a micro-batch holds rows of similar length (rows are padded to the
    longest: random batches of chat data pad about half their tokens) while every epoch still
    visits each row once."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    if lengths is None:
        return perm
    size = torch.frombuffer(bytearray(lengths), dtype=torch.int32)
    if size.numel() != n:
        raise ValueError(f"lengths has {size.numel()} entries for {n} training rows")
    window = per_step * LENGTH_WINDOW
    parts = []
    for lo in range(0, n, window):
        chunk = perm[lo : lo + window]
        steps = chunk[torch.argsort(size[chunk], stable=True)].split(per_step)
        parts += [steps[i] for i in torch.randperm(len(steps), generator=g).tolist()]
    return torch.cat(parts)


def answer_starts(masks) -> list[int | None]:
    """Each row's first trained (loss-masked) position; None for a row that trains nothing."""
    starts = []
    for mask in masks:
        hits = np.flatnonzero(np.asarray(mask))
        starts.append(int(hits[0]) if hits.size else None)
    return starts


@contextlib.contextmanager
def reading(data):
    """A shard of a `DistillData` that cannot be read (truncated, corrupt) as one DataError
    naming the folder, instead of the Arrow reader's traceback."""
    from draftsmith.distill.data import DataError

    try:
        yield
    except DataError:
        raise
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        raise DataError(f"data {str(data.dir)!r} cannot be read ({type(err).__name__}: {err}); regenerate it") from None


def read_answer_starts(data, rows: list[int]) -> list[int | None]:
    """`answer_starts` of these rows of a `DistillData`. Reads every shard the rows live in, so
    a shard that cannot be read stops the run before it writes anything."""
    with reading(data):
        table = data.dataset.select(rows).with_format("numpy", columns=["loss_mask"])
        return [s for batch in table.iter(batch_size=1024) for s in answer_starts(batch["loss_mask"])]


def check_trains_tokens(starts: list[int | None], max_length: int, first: int, where: str) -> None:
    """RecipeError unless some training row keeps a trained token once cut to `max_length`;
    `first` is the first position the method predicts (1 for next-token, 2 for heads that
    predict token t+2): a run with no trained token would report loss 0 and save untrained
    weights."""
    from draftsmith.train.recipe import RecipeError

    trained = [max(s, first) for s in starts if s is not None]
    if not trained:
        raise RecipeError(f"{where}: no training row has a trained (answer) token; regenerate the data")
    earliest = min(trained)
    if earliest >= max_length:
        raise RecipeError(
            f"max_length = {max_length} cuts every training row of {where} before its first trained token "
            f"(the earliest is at position {earliest}): nothing would be trained; set max_length above {earliest}"
        )


def to_device(batch: dict, device) -> dict:
    """A collated batch's tensors on `device`; other entries (the row indices) as they are."""
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def sync(device) -> None:
    """Timers read after the device has finished (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup_cosine(warmup_steps: int, max_steps: int):
    """LambdaLR factor: linear warm-up, then cosine decay to 10% of the peak (the usual
    fine-tuning schedule; the floor keeps late steps useful)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def collate_rows(data, rows: list[int], max_length: int, pad_id: int, every_token: bool = False) -> dict:
    """Rows of a `DistillData` as right-padded tensors: input_ids, attention_mask, loss_mask
    (cut to `max_length`; `every_token`: every token but a row's first, the prompt's too), plus the
    row indices (offline caches look states up by row)."""
    items = [data[i] for i in rows]
    width = min(max_length, max(len(it["input_ids"]) for it in items))
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(items), width), dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.bool)
    for r, it in enumerate(items):
        n = min(width, len(it["input_ids"]))
        ids[r, :n] = torch.tensor(it["input_ids"][:n])
        attention[r, :n] = 1
        if every_token:
            mask[r, 1:n] = True
        else:
            mask[r, :n] = torch.tensor(it["loss_mask"][:n], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask, "rows": rows}


def draft_vocab_map(recipe, data, vocab_size: int):
    """The recipe's reduced draft vocabulary: `recipe.vocab_map` loaded (checked against this data
    and target), else counted on the data for `recipe.draft_vocab_size` (at most the target's
    `vocab_size`); None = the full vocabulary."""
    from draftsmith.distill.vocab import build_vocab_map, load_vocab_map
    from draftsmith.train.recipe import RecipeError

    if recipe.draft_vocab_size is not None and recipe.draft_vocab_size > vocab_size:
        raise RecipeError(
            f"draft_vocab_size = {recipe.draft_vocab_size} is larger than the target's vocabulary "
            f"({vocab_size} tokens): give at most {vocab_size}, or leave it unset for the full vocabulary"
        )
    if recipe.vocab_map:
        try:
            return load_vocab_map(recipe.vocab_map, expected_data_hash=data.data_hash, target_vocab_size=vocab_size)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    if recipe.draft_vocab_size:
        return build_vocab_map(data.token_counts(), recipe.draft_vocab_size, data.data_hash)
    return None


def heldout_batches(data, rows: list[int], batch_size: int, max_length: int, pad_id: int, device):
    """(offset, collated batch on `device`) of the held-out rows, `batch_size` at a time."""
    for start in range(0, len(rows), batch_size):
        yield start, to_device(collate_rows(data, rows[start : start + batch_size], max_length, pad_id), device)


def training_rows(recipe, data, first: int) -> tuple[list[int], list[int]]:
    """(training rows, held-out rows) of the recipe's data, checked to train something: at least one
    training row, and `max_length` reaching a trained token at position >= `first` (the first a
    draft of this method can be trained on)."""
    from draftsmith.train.recipe import RecipeError

    train_rows, heldout_rows = split_rows(len(data), recipe.heldout_fraction)
    if not train_rows:
        raise RecipeError(f"{recipe.data} has no training rows")
    starts = read_answer_starts(data, train_rows)  # reads every shard the rows live in
    if recipe.train_on == "all":  # every token after a row's first
        starts = [1] * len(starts)
    check_trains_tokens(starts, recipe.max_length, first, f"data {recipe.data!r}")
    return train_rows, heldout_rows


def mask_token(recipe, data, vocab_size: int) -> tuple[int, str]:
    """The mask token of a head that drafts with one (a one-pass head; `choose_mask_token`): the recipe's
    `mask_token_id`, else the target tokenizer's mask token, else an id the data never trains on;
    with where it came from. RecipeError for an id outside the vocabulary."""
    from draftsmith.heads.layers import choose_mask_token
    from draftsmith.heads.models import load_tokenizer
    from draftsmith.train.recipe import RecipeError

    if recipe.mask_token_id is not None and recipe.mask_token_id >= vocab_size:
        raise RecipeError(
            f"mask_token_id = {recipe.mask_token_id} is outside the target's vocabulary 0..{vocab_size - 1}"
        )
    # None when the target has no tokenizer: the data's counts decide
    tokenizer = load_tokenizer(recipe.target, role="target", trust_remote_code=recipe.trust_remote_code)
    used = (data.token_counts() > 0).nonzero().flatten().tolist()  # tokens the data trains on
    return choose_mask_token(
        vocab_size, explicit=recipe.mask_token_id, tokenizer=tokenizer, used=used, error=RecipeError
    )


# ---------------------------------------------------------------------- heads over the target's states
def target_sizes(target) -> tuple[int, int, int]:
    """(decoder layers L, output vocabulary V, pad id (0 when the config names none)) of a target."""
    layers = target.config.get_text_config().num_hidden_layers
    vocab = target.get_output_embeddings().weight.shape[0]
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    return layers, vocab, pad_id


def head_origin(recipe, data, vocab_map) -> dict:
    """The `for_target` keywords a head over the target's states takes from its recipe and data:
    the target states it reads, its draft vocabulary and its provenance (target, data hash)."""
    aux, source = recipe.aux_layers, recipe.target
    return {"aux_layer_ids": aux, "vocab_map": vocab_map, "target_name_or_path": source, "data_hash": data.data_hash}


def prepare_head(run, objective):
    """(model, head) of a trainer of a head over the target's states: AdamW over the trainable
    parameters of `objective.head` (betas 0.9, 0.95, as the methods' published recipes), the
    objective and optimizer prepared by `run` (which keeps the optimizer), and the head unwrapped
    (what evaluation and saving use)."""
    params = [p for p in objective.head.parameters() if p.requires_grad]
    r = run.recipe
    optimizer = torch.optim.AdamW(params, lr=r.lr, weight_decay=r.weight_decay, betas=(0.9, 0.95))
    model = run.prepare(objective, optimizer)
    return model, run.accelerator.unwrap_model(model).head


def describe_top1(per: str):
    """The console line of a head trainer's held-out evaluation: top-1 per `per` (the evaluation's
    `top1_per_<per>`), then the simulated tau."""

    def describe(ev: dict) -> str:
        top1 = [round(a, 3) for a in ev[f"top1_per_{per}"]]
        return f"top-1 per {per} {top1}, simulated tau {ev['tau_simulated']:.3f}"

    return describe


def head_summary(done, head, vocab_map, **method) -> dict:
    """A head trainer's training summary: steps, the `method` fields, the target layers read, the
    last evaluation, the draft vocabulary (its share of the data's tokens) and the throughput."""
    return {
        "steps": done.step,
        **method,
        "aux_layers": list(head.config.aux_layer_ids),
        "eval": done.last_eval,
        "draft_vocab_size": head.config.draft_vocab_size,
        "vocab_coverage": vocab_map.coverage if vocab_map is not None else 1.0,
        "train_tokens_per_second": done.tokens_per_second,
    }


def save_head(run, model, head, save) -> None:
    """`save(head, OUT/head, overwrite=True)` on the main process, with the parameters whole (ZeRO-3)."""
    with run.gathered(model):
        if run.is_main:
            save(head, run.out / "head", overwrite=True)


def finish_head(run, done, model, head, save, target, k: int, data, heldout_rows, vocab_map, **method) -> dict:
    """The end of a head trainer: its summary (`head_summary`, with the `method` fields), the head
    saved (`save_head`), the serve check of OUT/head (kind `run.method`, K = `k` as the held-out
    tau's, over the prompts of the first held-out rows: `heldout_prompts`), the run finished."""
    summary = head_summary(done, head, vocab_map, **method)
    save_head(run, model, head, save)
    prompts = heldout_prompts(data, heldout_rows, run.recipe.serve_check_prompts)
    summary["serve_check"] = serve_check(run, target, run.method, run.out / "head", prompts, k, done.last_eval)
    return run.finish(summary)


# ---------------------------------------------------------------------- the serve check
# Training says X, serving says Y: at the end of training the trained drafter is loaded from its
# saved folder by the builders `draftsmith eval` uses and decodes a few held-out prompts, greedy,
# as a chain of the same K the held-out simulated tau used. Both figures count the bonus token.
# - simulated (`tau_simulated_served` of each trainer's evaluation): 1 + the drafts accepted before
#   the first miss, teacher-forced (the context is always the data's tokens), averaged over the
#   calls of the decoder's walk along the real answers of the same prompts, as far as the decoder
#   goes (a call at t emits L(t) tokens, the next one is at t + L(t): `distill.acceptance.walk_tau`,
#   `served_walk`; `tau_simulated` is that walk over every held-out row and token);
# - decoded: tokens per target call of the real decoder along the target's own greedy
#   continuation of the prompt (the drafter reads what it drafted and the states of what was
#   accepted), over the calls that could draft all K (the last calls, cut short by the token
#   budget, are left out).
# With greedy data the continuation is the answer, so the two differ only by what serving adds
# (the drafter's own predictions, the saved format, the prompt, the vocabulary map). The mean
# over every position (`tau_simulated_mean`) is not what the decoder gets: a chain of length L
# is visited about once per L positions, so tokens per call are ~ 1 / mean(1 / L) <= mean(L),
# equal only while acceptance does not change along the text (rows the head knows, rows it does not).
SERVE_CHECK_TOLERANCE = 0.10  # relative; a larger gap is a warning line


def heldout_prompts(data, rows: list[int], n: int) -> list[list[int]]:
    """The prompts (the tokens before each answer) of the first `n` held-out rows of a `DistillData`."""
    with reading(data):
        table = data.dataset.select(rows[:n]).with_format(None, columns=["input_ids", "prompt_length"])
        return [list(r["input_ids"][: max(1, r["prompt_length"])]) for r in table]


def served_walk(chains, starts, first_row: int, recipe) -> tuple[float, float]:
    """`walk_tau` of a held-out batch whose first row is held-out row `first_row`, over what the
    serve check decodes: its rows among the first `serve_check_prompts`, each up to the call whose
    first draft is answer token `serve_check_new_tokens` - 2 (the decoder keeps the calls whose K
    drafts end before the token budget; the walk those whose drafts end inside the answer)."""
    keep = max(0, min(starts.shape[0], recipe.serve_check_prompts - first_row))
    starts = torch.as_tensor(starts[:keep]).bool()
    return walk_tau(chains[:keep], starts & (starts.long().cumsum(1) <= recipe.serve_check_new_tokens - 1))


def heldout_walks(chains, starts, first_row: int, recipe) -> torch.Tensor:
    """[2, 2] float64 (tokens, calls): `walk_tau` of a held-out batch, then its `served_walk`."""
    return torch.tensor([walk_tau(chains, starts), served_walk(chains, starts, first_row, recipe)], dtype=torch.float64)


def walk_taus(walks: torch.Tensor, key: str = "tau_simulated") -> dict:
    """{key: tokens per call over every held-out row, key_served: over the serve check's prompts}
    of summed `heldout_walks` (1.0 without a call), counting the bonus token."""
    every, served = (float(t / c) if c else 1.0 for t, c in walks.tolist())
    return {key: every, f"{key}_served": served}


def one_pass_evaluation(batches, target_states, every, width: int, recipe, per: str, unit: str) -> dict:
    """Held-out evaluation of a one-pass head (its blocks or chains) over `batches`
    (`heldout_batches`): `every(batch, feats, teacher, in_vocab)` (what `target_states(batch)` gives)
    gives the chains at every position the decoder could call at ((chains [B, T, width] hits, starts
    [B, T], hits and trained counts per slot)). Returns the per-slot top-1 (`top1_per_{per}`), the
    greedy, teacher-forced tau along the decoder's walk (`walk_taus`: every held-out row, and the
    serve check's prompts), the mean over every chain (`tau_simulated_mean`) and the chain count
    (`unit`), the bonus token counted."""
    hit_sums = count_sums = torch.zeros(width, dtype=torch.float64)
    tau_sum = tau_n = 0.0
    walks = torch.zeros(2, 2, dtype=torch.float64)
    for start, batch in batches:
        chains, starts, hits, trained = every(batch, *target_states(batch))
        hit_sums, count_sums = hit_sums + hits, count_sums + trained
        walks += heldout_walks(chains, starts, start, recipe)
        tau_sum += float(simulated_tau(chains.double().unbind(-1))[starts].sum())
        tau_n += float(starts.sum())
    return {
        f"top1_per_{per}": (hit_sums / count_sums.clamp(min=1)).tolist(),
        **walk_taus(walks),
        "tau_simulated_mean": tau_sum / tau_n if tau_n else 1.0,
        unit: tau_n,
    }


class DecodedTau(NamedTuple):
    tau: float  # tokens per target call, the bonus token counted
    calls: int  # the calls counted
    standard_error: float  # of tau, over those calls taken as independent (0 for fewer than 2)


def decoded_tau(
    target, drafter, prompts: list[list[int]], k: int, new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> DecodedTau:
    """Tokens per target call of chain decoding of `prompts` with `drafter` at K = `k` (greedy, or
    sampled at `temperature` from `seed`'s streams), over the calls that drafted as many tokens as any
    call did (see above)."""
    from draftsmith.decoding import SamplingConfig, generate_batch
    from draftsmith.eval.drafter_specs import eos_token_id

    device = target.get_output_embeddings().weight.device
    ids = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
    result = generate_batch(
        target,
        ids,
        drafter,
        num_draft_tokens=k,
        max_new_tokens=new_tokens,
        sampling=SamplingConfig(temperature=temperature),
        eos_token_id=eos_token_id(target, None),
        seed=seed,
    )
    calls = [(p, a) for row in result.rows for p, a in zip(row.proposed, row.accepted)]
    full = max((p for p, _ in calls), default=0)
    kept = torch.tensor([a + 1 for p, a in calls if p == full] or [a + 1 for _, a in calls], dtype=torch.float64)
    if len(kept) == 0:
        return DecodedTau(0.0, 0, 0.0)  # no call: nothing measured
    spread = float(kept.std() / len(kept) ** 0.5) if len(kept) > 1 else 0.0
    return DecodedTau(float(kept.mean()), len(kept), spread)


def serve_check(
    run, target, kind: str, folder, prompts, k: int, evaluation: dict | None, key="tau_simulated_served"
) -> dict:
    """The serve check of a finished run (main process): the line `simulated tau X vs decoded tau
    Y`, a warning line when they differ by more than 10%, and both in the metrics; returns what
    the training summary records. `kind`/`folder`: the saved drafter (`chain_drafter`); `prompts`
    from the held-out split (`heldout_prompts`, `serve_check_prompts` of them); the simulated tau
    is `evaluation[key]` (the last held-out evaluation's walk over those prompts, `served_walk`),
    measured at K = `k`. Skipped (and said
    why) when off, without held-out rows, or on a partitioned target (fsdp2, zero3)."""
    from draftsmith.eval.drafter_specs import SpecError, chain_drafter
    from draftsmith.train.sharding import PARTITIONED

    r, simulated = run.recipe, evaluation[key] if evaluation else None
    if not r.serve_check_prompts or not run.is_main:
        return {}
    skipped = None
    if simulated is None or not prompts:
        skipped = "no held-out rows (heldout_fraction = 0)"
    elif r.target_sharding in PARTITIONED:
        skipped = f"the target is partitioned over the processes (target_sharding = {r.target_sharding})"
    if skipped is None:
        try:
            # the trainer's own target: the heads were made from it (a trainer that fine-tunes the target
            # changes its fingerprint, hence the mismatch allowed)
            drafter = chain_drafter(kind, folder, target, run.device, target.dtype, allow_target_mismatch=True)
            tau, calls, _ = decoded_tau(target, drafter, prompts, k, r.serve_check_new_tokens)
        except (SpecError, ValueError) as err:
            skipped = f"the decoder refused ({err})"
    if skipped is not None:
        run.print(f"serve check skipped: {skipped}")
        return {"skipped": skipped}
    ratio = tau / simulated
    check = {
        "tau_simulated": simulated,
        "tau_decoded": tau,
        "ratio": ratio,
        "num_draft_tokens": k,
        "prompts": len(prompts),
        "new_tokens": r.serve_check_new_tokens,
        "target_calls": calls,
        "agrees": abs(ratio - 1) <= SERVE_CHECK_TOLERANCE,
    }
    run.print(
        f"serve check: simulated tau {simulated:.3f} vs decoded tau {tau:.3f} (x{ratio:.3f}; greedy chain, K = {k}, "
        f"{len(prompts)} held-out prompts, {r.serve_check_new_tokens} new tokens, bonus token counted in both)"
    )
    if not check["agrees"]:
        run.print(
            f"WARNING: decoded tau is {abs(ratio - 1):.0%} {'below' if ratio < 1 else 'above'} the simulated one "
            f"(more than {SERVE_CHECK_TOLERANCE:.0%}). Likely causes: teacher forcing vs own-prediction drift "
            "(served, the drafter reads its own drafts), a chat template / prompt-format mismatch between the "
            "data and serving, or a vocab map mismatch (draft ids mapped to the wrong target ids)"
        )
    run.log(run.step, {"serve_check": check})
    return check
