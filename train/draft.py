"""Distil a small draft model from the target (DistillSpec-style).

    accelerate launch train/draft.py --recipe recipes/smollm2/draft.yaml
    accelerate launch train/draft.py --recipe recipes/smollm2/draft.yaml loss=tv on_policy_fraction=0.5
    python train/draft.py --recipe recipes/smollm2/draft.yaml            # one process, same loop

A draft's tokens are accepted with probability sum_x min(p, q) = 1 - TV(p, q), so the draft is
trained to match the target's distribution p, not just its argmax:

- `loss`: a divergence of `draftsmith.distill.losses` between the target (p, computed online by
  the frozen target) and the draft (q) at the serving `temperature`: forward_kl, reverse_kl,
  jsd (`beta`), tv, kl_tv (`tv_weight`; TV alone has small gradients far from the optimum);
  or `ce`, hard cross-entropy on the data's tokens (the plain baseline).
- the teacher offline: `teacher_cache: DIR`, a `draftsmith cache-hidden --topk-logits k` folder
  of this data, is read instead of a target forward per step: p on its top k tokens plus one
  bucket for the tail (`distill.losses.topk_divergence`); `teacher_topk: k` truncates the online
  teacher the same way (what such a cache trains, for comparison). Both at temperature 1.
- data, per step (`train/draft_rows.py`): `data_mode: generated` reads the target's own answers
  (`draftsmith generate`, loss on the answer tokens; `train_on: all` on every token but a row's
  first), `data_mode: fixed` reads fixed text (`fixed_data`: JSONL with "text" or "prompt", cut
  into `max_length` windows, loss on every token); with
  `on_policy_fraction` f, a share f of the steps is on-policy instead: the draft samples
  `on_policy_new_tokens` continuations of the rows' prompts and the target scores them.
- the draft: `draft_init: checkpoint` (`draft_path`, an existing small model), `truncate` (the
  target's embeddings, first `draft_layers` layers, norm and lm_head) or `config` (the target's
  family, `draft_layers` x `draft_hidden`); same vocabulary as the target, checked. `lora: true`
  adapts it with LoRA instead of full fine-tuning (merged into the saved draft).
- held out (every 1/`heldout_fraction`-th row): the exact acceptance the decoder will see at
  `temperature`, mean sum(min(p, q)) per trained position, greedy acceptance (argmax agreement)
  and tau simulated for K = `num_draft_tokens` (1 + sum_j prod_{i<j} a_{t+i} along the text,
  counting the bonus token).
- checkpoints every `save_every` steps; `resume: true` continues from the latest one.

The result is `OUT/draft/`, a plain HF model (+ the target's tokenizer) for
`draftsmith eval --draft OUT/draft` or vLLM's `--speculative-model`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.distill.acceptance import simulated_tau
from draftsmith.distill.data import DistillData, write_json_atomic
from draftsmith.distill.losses import cross_entropy, divergence, topk_divergence, topk_teacher
from draftsmith.train.command_line import trainer_main
from draftsmith.train.common import (
    answer_starts,
    check_trains_tokens,
    heldout_walks,
    length_bytes,
    serve_check,
    split_rows,
    to_device,
    walk_taus,
)
from draftsmith.train.draft_rows import Rows, collate, fixed_rows, generated_rows, is_on_policy_step, on_policy_batch
from draftsmith.train.loop import evaluate_now, train_loop
from draftsmith.train.recipe import RecipeError, RunRecipe
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import cleaned_up_on_error
from draftsmith.train.sharding import decoder_layers

LOSSES = ("ce", "forward_kl", "reverse_kl", "jsd", "tv", "kl_tv")
DATA_MODES = ("generated", "fixed")
DRAFT_INITS = ("checkpoint", "truncate", "config")


@dataclass(kw_only=True)
class DraftRecipe(RunRecipe):
    """RunRecipe's keys (target, data, out, lr, batch, schedule, cadence, ...) and the draft's."""

    data: str | None = None  # `draftsmith generate` folder: the target's own answers (fixed data needs none)
    fixed_data: str | None = None  # JSONL of {"text"} / {"prompt"}: fixed tokens (CE baseline)
    data_mode: str = "generated"  # which data the off-policy steps read: generated | fixed
    on_policy_fraction: float = 0.0  # share of steps on the draft's own samples (DistillSpec's mix)
    on_policy_new_tokens: int = 64  # tokens the draft samples per on-policy row
    draft_init: str = "checkpoint"  # checkpoint | truncate | config
    draft_path: str | None = None  # checkpoint: the small model to start from
    draft_layers: int = 2  # truncate / config
    draft_hidden: int | None = None  # config: width (default: the target's)
    loss: str = "forward_kl"  # ce | forward_kl | reverse_kl | jsd | tv | kl_tv
    beta: float = 0.5  # jsd mixture weight
    tv_weight: float = 0.5  # kl_tv: share of TV
    temperature: float = 1.0  # the serving temperature the draft must match (> 0)
    lora: bool = False  # adapt with LoRA (merged at the end) instead of full fine-tuning
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lr: float = 3e-4  # fine-tuning a pretrained draft: lower than pretraining's 1e-3
    max_length: int = 256
    chunk_size: int | None = None  # loss chunking for large vocabularies
    num_draft_tokens: int = 4  # K for the simulated tau
    teacher_cache: str | None = None  # offline teacher: a `cache-hidden --topk-logits k` folder of `data`
    teacher_topk: int = 0  # online teacher truncated to its top k + the tail bucket (0 = the whole vocabulary)

    def __post_init__(self):
        super().__post_init__()
        if self.loss not in LOSSES:
            raise ValueError(f"loss = {self.loss!r}: expected one of {', '.join(LOSSES)}")
        if self.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode = {self.data_mode!r}: expected one of {', '.join(DATA_MODES)}")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"draft_init = {self.draft_init!r}: expected one of {', '.join(DRAFT_INITS)}")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction = {self.on_policy_fraction} must be in [0, 1]")
        if self.draft_init == "checkpoint" and not self.draft_path:
            raise ValueError("draft_init = checkpoint needs draft_path")
        if self.data_mode == "generated" and not self.data:
            raise ValueError("data_mode = generated needs data (a `draftsmith generate` folder)")
        if self.data_mode == "fixed" and not self.fixed_data:
            raise ValueError("data_mode = fixed needs fixed_data (JSONL with text or prompt)")
        if self.temperature <= 0:
            raise ValueError(
                f"temperature = {self.temperature} must be > 0 (match the serving temperature; 1 for greedy serving)"
            )
        if not 0 <= self.beta <= 1 or not 0 <= self.tv_weight <= 1:
            raise ValueError("beta and tv_weight must be in [0, 1]")
        if self.teacher_topk < 0:
            raise ValueError(f"teacher_topk = {self.teacher_topk} must be >= 0 (0 = the whole vocabulary)")
        if self.teacher_cache or self.teacher_topk:
            key = "teacher_cache" if self.teacher_cache else "teacher_topk"
            if self.loss == "ce":
                raise ValueError(f"{key} is a teacher for a divergence; loss = ce reads only the data's tokens")
            if self.temperature != 1.0:
                raise ValueError(
                    f"{key}: a top-k teacher's tail is known at temperature 1 only, got temperature = {self.temperature}"
                )
        if self.teacher_cache and (self.data_mode != "generated" or self.on_policy_fraction > 0):
            raise ValueError(
                "teacher_cache holds the target's logits on the `data` rows: it needs data_mode = generated "
                "and on_policy_fraction = 0 (on-policy rows are scored online)"
            )
        for name in ("num_draft_tokens", "draft_layers", "on_policy_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")


# --------------------------------------------------------------------------- loss and metrics


def trained_positions(batch) -> torch.Tensor:
    """[B, T - 1]: position t predicts token t + 1, trained when that token is under the loss mask."""
    return batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()


def trained_rows(batch) -> torch.Tensor:
    """[B, T] bool over the positions' logits: those trained (the last position predicts no token)."""
    return torch.nn.functional.pad(trained_positions(batch), (0, 1))


@contextlib.contextmanager
def logits_at(model, rows: torch.Tensor):
    """Within the block, `model`'s output layer projects only its hidden states at `rows` [B, T]:
    the model's logits come out [N, V] (N = rows.sum()), with whatever it applies after the
    projection (soft-capping, logit scales) applied to those rows alone; `rows_of` reads them. A
    model that feeds its output layer another shape keeps its logits whole."""

    def at_rows(_, args):
        hidden = args[0]
        if tuple(hidden.shape[:-1]) != tuple(rows.shape):
            return None
        return (hidden[rows.to(hidden.device)], *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(at_rows)
    try:
        yield
    finally:
        handle.remove()


def rows_of(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits [N, V] at `rows` of a forward under `logits_at` (already those rows, or whole)."""
    return logits if logits.dim() == 2 else logits[rows]


def draft_loss(recipe: DraftRecipe, student, *, labels=None, teacher=None, topk=None) -> torch.Tensor:
    """The draft's loss at its trained positions: its logits there, `student` [N, V], against the
    data's next tokens `labels` [N] (`loss: ce`), the teacher's logits [N, V], or the teacher's top k
    (values, ids, tail) [N, k], [N, k], [N] (`teacher_cache`, `teacher_topk`). Mean over the N."""
    student = student.float()
    options = {"chunk_size": recipe.chunk_size}
    if recipe.loss == "ce":
        return cross_entropy(student, labels, **options)
    options.update(beta=recipe.beta, tv_weight=recipe.tv_weight)
    if topk is not None:
        return topk_divergence(recipe.loss, student, *topk, **options)
    return divergence(recipe.loss, student, teacher.float(), temperature=recipe.temperature, **options)


def chain_along_text(accept: torch.Tensor, valid: torch.Tensor, k: int) -> list[torch.Tensor]:
    """alpha_1..alpha_K of a chain of K drafts started at each position t of the rows
    (teacher-forced: draft j proposes token t+j of the text): alpha_j at t = a_{t+j-1}, the
    acceptance at that position, 0 past the end of the row or off the valid positions."""
    B, T = accept.shape
    a = torch.where(valid, accept, torch.zeros_like(accept)).double()
    alphas = []
    for j in range(k):
        shifted = torch.zeros(B, T, dtype=torch.float64)
        shifted[:, : T - j] = a[:, j:]
        alphas.append(shifted)
    return alphas


@torch.no_grad()
def evaluate_draft(draft, target, rows: Rows, index: list[int], recipe: DraftRecipe, pad_id: int, device) -> dict:
    sums = dict.fromkeys(["accept", "greedy", "tau", "tau_greedy", "n"], 0.0)
    walks = {key: torch.zeros(2, 2, dtype=torch.float64) for key in ("", "_greedy")}
    for start in range(0, len(index), recipe.batch_size):
        batch = to_device(collate(rows, index[start : start + recipe.batch_size], recipe.max_length, pad_id), device)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        p_logits = target(**inputs).logits[:, :-1].float()
        q_logits = draft(**inputs).logits[:, :-1].float()
        valid = trained_positions(batch).cpu()
        p = torch.softmax(p_logits / recipe.temperature, -1)
        q = torch.softmax(q_logits / recipe.temperature, -1)
        accept = torch.minimum(p, q).sum(-1).cpu()  # exactly the decoder's acceptance probability
        greedy = (p_logits.argmax(-1) == q_logits.argmax(-1)).float().cpu()
        sums["accept"] += float(accept[valid].sum())
        sums["greedy"] += float(greedy[valid].sum())
        K = recipe.num_draft_tokens
        for key, a in (("", accept), ("_greedy", greedy)):
            alphas = chain_along_text(a, valid, K)
            sums["tau" + key] += float(simulated_tau(alphas)[valid].sum())
            walks[key] += heldout_walks(torch.stack(alphas, -1), valid, start, recipe)  # sampled: the expected walk
        sums["n"] += float(valid.sum())
    n = max(1.0, sums["n"])
    return {
        "acceptance": sums["accept"] / n,  # mean sum(min(p, q)) at the recipe's temperature
        "acceptance_greedy": sums["greedy"] / n,
        # tokens per call along the decoder's walk (the bonus token counted), and the chain's mean over positions
        **walk_taus(walks[""]),
        **walk_taus(walks["_greedy"], "tau_simulated_greedy"),
        "tau_simulated_mean": sums["tau"] / n if sums["n"] else 1.0,
        "tau_simulated_greedy_mean": sums["tau_greedy"] / n if sums["n"] else 1.0,
        "positions": sums["n"],
    }


def cached_teacher(cache, index: list[int], width: int, device) -> tuple[torch.Tensor, ...]:
    """The top-k teacher of the batch's rows (by data row) from a `cache-hidden --topk-logits`
    cache, cut or padded to `width` (padded positions are outside the loss mask)."""
    parts = {"topk_values": [], "topk_ids": [], "topk_tail": []}
    for row in index:
        item = cache[row]
        for key, out in parts.items():
            t = item[key][:width]
            pad = (0, 0, 0, width - t.shape[0]) if t.dim() == 2 else (0, width - t.shape[0])
            out.append(torch.nn.functional.pad(t, pad))
    return tuple(torch.stack(out).to(device) for out in parts.values())


def open_teacher_cache(recipe: DraftRecipe, target, data: DistillData):
    """The recipe's teacher_cache, checked to hold this target's top-k logits of this data."""
    from draftsmith.distill.hidden_cache import HiddenStateCache
    from draftsmith.heads.models import target_fingerprint

    cache = HiddenStateCache(recipe.teacher_cache)
    cache.check(target_fingerprint=target_fingerprint(target), data_hash=data.data_hash)
    k = cache.require_topk()
    if recipe.teacher_topk and recipe.teacher_topk != k:
        raise RecipeError(
            f"teacher_topk = {recipe.teacher_topk} but teacher_cache {recipe.teacher_cache!r} holds the top {k}"
        )
    return cache


# --------------------------------------------------------------------------- the loop


def head_parameters(recipe: DraftRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters of the model `build_draft` makes for `target` (meta is fine;
    the memory estimate, train/sharding.py), built on the meta device the same three ways: every
    parameter trains, a tied lm_head counted once."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if recipe.draft_init == "checkpoint":
        from draftsmith.heads.models import _check_folder

        config = AutoConfig.from_pretrained(_check_folder(recipe.draft_path, "draft"))
        with init_empty_weights():
            draft = AutoModelForCausalLM.from_config(config)
        draft.tie_weights()
        return sum(p.numel() for p in draft.parameters()), 0
    if recipe.draft_init == "truncate":  # the target less its dropped decoder layers
        per_layer = sum(p.numel() for p in decoder_layers(target)[0].parameters())
        dropped = (target.config.get_text_config().num_hidden_layers - recipe.draft_layers) * per_layer
        return sum(p.numel() for p in target.parameters()) - dropped, 0
    from draftsmith.heads.draft import draft_from_config

    # draft_from_config records the target's fingerprint, which the estimate's meta target has no
    # values for: a placeholder while the draft is counted, taken off again
    placeholder = "draftsmith_fingerprint" not in vars(target)
    if placeholder:
        target.draftsmith_fingerprint = "meta"
    try:
        with init_empty_weights():
            draft = draft_from_config(
                target, num_layers=recipe.draft_layers, hidden_size=recipe.draft_hidden, copy_embeddings=False
            )
    finally:
        if placeholder:
            del target.draftsmith_fingerprint
    return sum(p.numel() for p in draft.parameters()), 0


def build_draft(recipe: DraftRecipe, target, tokenizer, device):
    from draftsmith.heads.draft import check_same_vocabulary, draft_by_truncation, draft_from_config, load_draft

    if recipe.draft_init == "checkpoint":
        draft = load_draft(recipe.draft_path, target, target_tokenizer=tokenizer, device=device, dtype=torch.float32)
    elif recipe.draft_init == "truncate":
        draft = draft_by_truncation(target, recipe.draft_layers)
    else:
        draft = draft_from_config(
            target, num_layers=recipe.draft_layers, hidden_size=recipe.draft_hidden, seed=recipe.seed
        )
    check_same_vocabulary(target, draft)
    return draft.to(device=device, dtype=torch.float32)  # master weights in fp32


@cleaned_up_on_error
def train(recipe: DraftRecipe, *, progress: bool = True) -> dict:
    from draftsmith.heads.draft import describe_draft
    from draftsmith.heads.models import load_tokenizer

    run = TrainingRun(recipe, "draft", progress)
    device = run.device
    out = Path(recipe.out)
    tokenizer = load_tokenizer(recipe.target, trust_remote_code=recipe.trust_remote_code)
    if tokenizer is None:
        raise RecipeError(f"target {recipe.target!r} has no tokenizer")
    target = run.load_target()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = sorted({t for t in (tokenizer.eos_token_id,) if t is not None})

    data = DistillData(recipe.data) if recipe.data else None
    if data is not None:
        run.check_data_target(data, target)
    generated = generated_rows(data) if data is not None else None
    cache = open_teacher_cache(recipe, target, data) if recipe.teacher_cache else None
    vocab = target.get_output_embeddings().weight.shape[0]
    if recipe.teacher_topk > vocab:
        raise RecipeError(f"teacher_topk = {recipe.teacher_topk} exceeds the target's vocabulary ({vocab})")
    rows = generated if recipe.data_mode == "generated" else fixed_rows(recipe.fixed_data, tokenizer, recipe.max_length)
    # Held out from the target's answers when there are some: that is what decoding will see.
    eval_rows = generated if generated is not None else rows
    if recipe.train_on == "all":
        rows = rows.every_token()
    # With generated data, rows and eval_rows are the same rows split the same way: the
    # held-out rows are never trained on.
    train_index, _ = split_rows(len(rows), recipe.heldout_fraction)
    _, heldout_index = split_rows(len(eval_rows), recipe.heldout_fraction)
    if not train_index:
        raise RecipeError("no training rows left after the held-out split")
    if recipe.on_policy_fraction < 1:  # on-policy steps train on the draft's own tokens, always some
        where = f"data {recipe.data!r}" if recipe.data_mode == "generated" else f"fixed_data {recipe.fixed_data!r}"
        check_trains_tokens(answer_starts(rows.masks[i] for i in train_index), recipe.max_length, 1, where)

    draft = build_draft(recipe, target, tokenizer, device)
    draft_info = describe_draft(draft, target)
    if recipe.lora:
        from peft import LoraConfig, get_peft_model

        try:
            draft = get_peft_model(
                draft,
                LoraConfig(
                    r=recipe.lora_r, lora_alpha=recipe.lora_alpha, target_modules=list(recipe.lora_target_modules)
                ),
            )
        except ValueError as err:
            raise RecipeError(f"lora_target_modules {recipe.lora_target_modules}: {err}") from None
    optimizer = torch.optim.AdamW(
        [p for p in draft.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    model = run.prepare(draft, optimizer)
    draft = run.accelerator.unwrap_model(model)
    step = run.start()

    def evaluate():
        return evaluate_draft(draft, target, eval_rows, heldout_index, recipe, pad_id, device)

    def describe(ev):
        return (
            f"acceptance {ev['acceptance']:.4f} (T = {recipe.temperature:g}), greedy {ev['acceptance_greedy']:.4f}, "
            f"simulated tau (K = {recipe.num_draft_tokens}) {ev['tau_simulated']:.3f}"
        )

    initial_path = out / "initial_eval.json"
    if step == 0:
        initial = evaluate_now(run, model, evaluate) if heldout_index else None
        if initial:
            run.log(step, {"eval": initial})
            run.print(f"initial draft: {describe(initial)}")
            if run.is_main:
                write_json_atomic(initial_path, initial)
    else:  # resumed: the starting point was measured by the first run (re-measuring would move the RNG)
        initial = json.loads(initial_path.read_text()) if initial_path.is_file() else None

    on_policy_tokens = 0
    lengths = None
    if recipe.group_by_length:
        lengths = length_bytes([len(rows.ids[i]) for i in train_index], recipe.max_length)

    def micro_step(step, micro):
        """One micro-batch (the draft's own samples on on-policy steps) and its loss."""
        nonlocal on_policy_tokens
        index = run.batch_rows(train_index, step, micro, lengths)
        if is_on_policy_step(step, recipe.on_policy_fraction):
            batch = on_policy_batch(draft, rows, index, recipe, pad_id, eos_ids, device)
            on_policy_tokens += batch.pop("generated_tokens")
        else:
            batch = collate(rows, index, recipe.max_length, pad_id)
        batch = to_device(batch, device)
        # No cache: a whole-sequence forward (a model of recurrent layers only cannot build a mask from one)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        kept = trained_rows(batch)  # both models project only these positions' states (`logits_at`)
        labels = teacher = topk = None
        if recipe.loss == "ce":
            labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))[kept]
        elif cache is not None:  # offline: the cached top-k teacher, no target forward
            topk = tuple(t[kept] for t in cached_teacher(cache, index, kept.shape[1], device))
        else:
            with torch.no_grad(), logits_at(target, kept):
                teacher = rows_of(target(**inputs).logits, kept)
            if recipe.teacher_topk:
                topk, teacher = topk_teacher(teacher, recipe.teacher_topk), None
        with logits_at(draft, kept):
            student = rows_of(model(**inputs).logits, kept)
        loss = draft_loss(recipe, student, labels=labels, teacher=teacher, topk=topk)
        trained = trained_positions(batch).sum()
        return loss * run.token_shares([trained])[0], batch, {}

    started = step
    done = train_loop(
        run,
        model,
        micro_step,
        desc=f"draft ({recipe.loss})",
        evaluate=evaluate if heldout_index else None,
        describe=describe,
        last_eval=initial,
        fields=lambda step: {"on_policy": is_on_policy_step(step, recipe.on_policy_fraction)},
    )
    on_policy_steps = sum(is_on_policy_step(s, recipe.on_policy_fraction) for s in range(started, done.step))
    if initial and done.last_eval:
        a, b = initial["acceptance"], done.last_eval["acceptance"]
        run.print(f"held-out acceptance {a:.4f} -> {b:.4f} (x{b / max(1e-9, a):.3f})")

    summary = {
        "steps": done.step,
        "loss": recipe.loss,
        "data": rows.origin,
        "teacher": f"cache:{recipe.teacher_cache}"
        if cache is not None
        else (f"online top-{recipe.teacher_topk}" if recipe.teacher_topk else "online"),
        "initial": initial,
        "eval": done.last_eval,
        "train_tokens_per_second": done.tokens_per_second,
        "draft": draft_info,
        "on_policy_steps": on_policy_steps,
        "on_policy_tokens": on_policy_tokens,
        "off_policy_steps": done.step - started - on_policy_steps,
    }
    with run.gathered(model):
        if run.is_main:
            final = draft.merge_and_unload() if recipe.lora else draft
            tmp = out / ".draft.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            final.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(out / "draft", ignore_errors=True)
            tmp.rename(out / "draft")
    prompts = [eval_rows.ids[i][: eval_rows.prompt_lengths[i]] for i in heldout_index[: recipe.serve_check_prompts]]
    K, greedy = recipe.num_draft_tokens, "tau_simulated_greedy_served"  # the decoder's check is greedy
    summary["serve_check"] = serve_check(run, target, "draft", out / "draft", prompts, K, done.last_eval, greedy)
    return run.finish(summary)


def main(argv=None) -> int:
    return trainer_main("train/draft.py", __doc__, DraftRecipe, train, argv, result="draft")


if __name__ == "__main__":
    sys.exit(main())
