"""Distil a small draft model from the target (DistillSpec-style).

    accelerate launch train/draft.py --recipe recipes/demo/draft.yaml
    accelerate launch train/draft.py --recipe recipes/demo/draft.yaml loss=tv on_policy_fraction=0.5
    python train/draft.py --recipe recipes/demo/draft.yaml            # one process, same loop

A draft's tokens are accepted with probability sum_x min(p, q) = 1 - TV(p, q), so the draft is
trained to match the target's distribution p, not just its argmax:

- `loss`: a divergence of `draftsmith.distill.losses` between the target (p, computed online by
  the frozen target) and the draft (q) at the serving `temperature`: forward_kl, reverse_kl,
  jsd (`beta`), tv, kl_tv (`tv_weight`; TV alone has small gradients far from the optimum);
  or `ce`, hard cross-entropy on the data's tokens (the plain baseline).
- data, per step: `data_mode: generated` reads the target's own answers (`draftsmith generate`,
  loss on the answer tokens), `data_mode: fixed` reads fixed text (`fixed_data`: JSONL with
  "text" or "prompt", cut into `max_length` windows, loss on every token); with
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

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.distill.data import DistillData, write_json_atomic
from draftsmith.distill.losses import cross_entropy, divergence
from draftsmith.train.common import batch_rows, split_rows, sync, warmup_cosine
from draftsmith.train.recipe import RecipeError
from draftsmith.train.run import RunRecipe, TrainingRun, command_line, is_main_process, user_errors

LOSSES = ("ce", "forward_kl", "reverse_kl", "jsd", "tv", "kl_tv")
DATA_MODES = ("generated", "fixed")
DRAFT_INITS = ("checkpoint", "truncate", "config")


@dataclass
class DraftRecipe(RunRecipe):
    target: str  # HF folder (or hub id) of the target
    out: str  # draft, checkpoints and metrics go here
    data: str | None = None  # `draftsmith generate` folder: the target's own answers
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
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 300  # budget in steps: comparisons between recipes stay fair
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 256
    grad_clip: float = 1.0
    chunk_size: int | None = None  # loss chunking for large vocabularies
    heldout_fraction: float = 0.05
    eval_every: int = 100
    num_draft_tokens: int = 4  # K for the simulated tau

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
            raise ValueError(f"temperature = {self.temperature} must be > 0 (match the serving temperature; 1 for greedy serving)")
        if not 0 <= self.beta <= 1 or not 0 <= self.tv_weight <= 1:
            raise ValueError("beta and tv_weight must be in [0, 1]")
        for name in ("max_steps", "batch_size", "grad_accum", "max_length", "eval_every", "num_draft_tokens", "draft_layers", "on_policy_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction = {self.heldout_fraction} must be in [0, 1)")


# --------------------------------------------------------------------------- data


class Rows:
    """Token rows and loss masks (1 = the draft learns to predict this token)."""

    def __init__(self, ids: list[list[int]], masks: list[list[int]], prompt_lengths: list[int], origin: str):
        self.ids, self.masks, self.prompt_lengths, self.origin = ids, masks, prompt_lengths, origin

    def __len__(self):
        return len(self.ids)


def generated_rows(data: DistillData) -> Rows:
    ds = data.dataset
    return Rows([list(r) for r in ds["input_ids"]], [list(m) for m in ds["loss_mask"]], list(ds["prompt_length"]), f"generated:{data.data_hash[:12]}")


def fixed_rows(path: str, tokenizer, max_length: int) -> Rows:
    """Fixed text cut into windows of `max_length` tokens; every token trained but the first."""
    from draftsmith.distill.sources import load_source

    source = load_source(path)
    if source.format != "prompt":
        raise RecipeError(f"fixed_data {path!r} holds {source.format} conversations; give text rows ({{\"text\": ...}})")
    ids, masks = [], []
    for record in source.records:
        tokens = tokenizer(record.prompt).input_ids
        for start in range(0, max(1, len(tokens) - 1), max_length):
            window = tokens[start : start + max_length]
            if len(window) >= 2:
                ids.append(window)
                masks.append([0] + [1] * (len(window) - 1))
    if not ids:
        raise RecipeError(f"fixed_data {path!r} has no text of 2 or more tokens")
    return Rows(ids, masks, [min(32, len(w) // 2) for w in ids], f"fixed:{source.fingerprint[:12]}")


def collate(rows: Rows, index: list[int], max_length: int, pad_id: int) -> dict:
    width = min(max_length, max(len(rows.ids[i]) for i in index))
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(index), width), dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.bool)
    for r, i in enumerate(index):
        n = min(width, len(rows.ids[i]))
        ids[r, :n] = torch.tensor(rows.ids[i][:n])
        attention[r, :n] = 1
        mask[r, :n] = torch.tensor(rows.masks[i][:n], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask}


@torch.no_grad()
def on_policy_batch(draft, rows: Rows, index: list[int], recipe: DraftRecipe, pad_id: int, eos_ids, device) -> dict:
    """The draft continues each row's prompt by sampling at the serving temperature; the loss
    then covers exactly the tokens the draft produced (what it will propose when serving)."""
    from transformers import GenerationConfig

    prompts = [rows.ids[i][: max(1, min(rows.prompt_lengths[i], recipe.max_length - recipe.on_policy_new_tokens))] for i in index]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding for generation
        ids[r, width - len(p) :] = torch.tensor(p)
        attention[r, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=recipe.on_policy_new_tokens, do_sample=True, temperature=recipe.temperature, top_k=None, top_p=None,
        eos_token_id=eos_ids or None, pad_token_id=pad_id,
    )  # fmt: skip
    was_training = draft.training
    draft.eval()
    out = draft.generate(input_ids=ids.to(device), attention_mask=attention.to(device), generation_config=config).cpu()
    draft.train(was_training)
    new = out[:, width:]
    samples = []
    for r, p in enumerate(prompts):
        answer = new[r].tolist()
        stop = next((j for j, t in enumerate(answer) if t in set(eos_ids)), None)
        samples.append(p + answer[: stop + 1 if stop is not None else len(answer)])
    batch_rows_ = Rows(samples, [[0] * len(p) + [1] * (len(s) - len(p)) for p, s in zip(prompts, samples)], [len(p) for p in prompts], "on-policy")
    return collate(batch_rows_, list(range(len(samples))), recipe.max_length, pad_id) | {"generated_tokens": sum(len(s) - len(p) for p, s in zip(prompts, samples))}


def is_on_policy_step(step: int, fraction: float) -> bool:
    """Spread the on-policy steps evenly: step s is on-policy when floor((s+1) f) > floor(s f)."""
    return math.floor((step + 1) * fraction + 1e-9) > math.floor(step * fraction + 1e-9)


# --------------------------------------------------------------------------- loss and metrics


def draft_loss(draft_logits, target_logits, batch, recipe: DraftRecipe) -> torch.Tensor:
    """Position t predicts token t+1, trained when that token is under the loss mask."""
    mask = batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()
    if recipe.loss == "ce":
        return cross_entropy(draft_logits[:, :-1], batch["input_ids"][:, 1:], mask, chunk_size=recipe.chunk_size)
    return divergence(
        recipe.loss, draft_logits[:, :-1], target_logits[:, :-1], mask, temperature=recipe.temperature,
        beta=recipe.beta, tv_weight=recipe.tv_weight, chunk_size=recipe.chunk_size,
    )  # fmt: skip


def simulated_tau(accept: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, float]:
    """tau for K drafts from per-position acceptance a_t along each row (teacher-forced):
    E[accepted] at t = sum_{j=1..K} prod_{i<j} a_{t+i}; tau = 1 + its mean (bonus counted)."""
    B, T = accept.shape
    a = torch.where(valid, accept, torch.zeros_like(accept))
    total = torch.zeros(B, T, dtype=torch.float64)
    run = torch.ones(B, T, dtype=torch.float64)
    for j in range(k):
        shifted = torch.zeros(B, T, dtype=torch.float64)
        shifted[:, : T - j] = a[:, j:].double()
        run = run * shifted
        total += run
    return float(total[valid].sum()), float(valid.sum())


@torch.no_grad()
def evaluate_draft(draft, target, rows: Rows, index: list[int], recipe: DraftRecipe, pad_id: int, device) -> dict:
    sums = {"accept": 0.0, "greedy": 0.0, "tau": 0.0, "tau_greedy": 0.0, "n": 0.0}
    for start in range(0, len(index), recipe.batch_size):
        batch = {k: v.to(device) for k, v in collate(rows, index[start : start + recipe.batch_size], recipe.max_length, pad_id).items()}
        p_logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        q_logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        valid = (batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()).cpu()
        p = torch.softmax(p_logits / recipe.temperature, -1)
        q = torch.softmax(q_logits / recipe.temperature, -1)
        accept = torch.minimum(p, q).sum(-1).cpu()  # exactly the decoder's acceptance probability
        greedy = (p_logits.argmax(-1) == q_logits.argmax(-1)).float().cpu()
        sums["accept"] += float(accept[valid].sum())
        sums["greedy"] += float(greedy[valid].sum())
        t, n = simulated_tau(accept, valid, recipe.num_draft_tokens)
        tg, _ = simulated_tau(greedy, valid, recipe.num_draft_tokens)
        sums["tau"] += t
        sums["tau_greedy"] += tg
        sums["n"] += n
    n = max(1.0, sums["n"])
    return {
        "acceptance": sums["accept"] / n,  # mean sum(min(p, q)) at the recipe's temperature
        "acceptance_greedy": sums["greedy"] / n,
        "tau_simulated": 1 + sums["tau"] / n,
        "tau_simulated_greedy": 1 + sums["tau_greedy"] / n,
        "positions": sums["n"],
    }


# --------------------------------------------------------------------------- the loop


def build_draft(recipe: DraftRecipe, target, tokenizer, device):
    from draftsmith.heads.draft import check_same_vocabulary, draft_by_truncation, draft_from_config, load_draft

    if recipe.draft_init == "checkpoint":
        draft = load_draft(recipe.draft_path, target, target_tokenizer=tokenizer, device=device, dtype=torch.float32)
    elif recipe.draft_init == "truncate":
        draft = draft_by_truncation(target, recipe.draft_layers)
    else:
        draft = draft_from_config(target, num_layers=recipe.draft_layers, hidden_size=recipe.draft_hidden, seed=recipe.seed)
    check_same_vocabulary(target, draft)
    return draft.to(device=device, dtype=torch.float32)  # master weights in fp32


def train(recipe: DraftRecipe, *, progress: bool = True) -> dict:
    from draftsmith.heads.draft import describe_draft
    from draftsmith.heads.models import load_tokenizer

    run = TrainingRun(recipe, "draft")
    device = run.device
    out = Path(recipe.out)
    tokenizer = load_tokenizer(recipe.target, trust_remote_code=recipe.trust_remote_code)
    if tokenizer is None:
        raise RecipeError(f"target {recipe.target!r} has no tokenizer")
    target = run.load_target()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = sorted({t for t in (tokenizer.eos_token_id,) if t is not None})

    rows = generated_rows(DistillData(recipe.data)) if recipe.data_mode == "generated" else fixed_rows(recipe.fixed_data, tokenizer, recipe.max_length)
    # Held out from the target's answers when there are some: that is what decoding will see.
    eval_rows = generated_rows(DistillData(recipe.data)) if recipe.data else rows
    # With generated data, rows and eval_rows are the same rows split the same way: the
    # held-out rows are never trained on.
    train_index, _ = split_rows(len(rows), recipe.heldout_fraction)
    _, heldout_index = split_rows(len(eval_rows), recipe.heldout_fraction)
    if not train_index:
        raise RecipeError("no training rows left after the held-out split")

    draft = build_draft(recipe, target, tokenizer, device)
    draft_info = describe_draft(draft, target)
    if recipe.lora:
        from peft import LoraConfig, get_peft_model

        try:
            draft = get_peft_model(draft, LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, target_modules=list(recipe.lora_target_modules)))
        except ValueError as err:
            raise RecipeError(f"lora_target_modules {recipe.lora_target_modules}: {err}") from None
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=recipe.weight_decay)


    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(recipe.warmup_steps, recipe.max_steps))
    model, optimizer = run.prepare(draft, optimizer, scheduler)
    draft = run.accelerator.unwrap_model(model)
    step = run.start()

    evaluate = lambda: evaluate_draft(draft, target, eval_rows, heldout_index, recipe, pad_id, device) if heldout_index else None  # noqa: E731
    initial_path = out / "initial_eval.json"
    if step == 0:
        model.eval()
        with run.gathered(model):
            initial = evaluate()
        model.train()
        if initial:
            run.log(step, {"eval": initial})
            run.print(f"initial draft: acceptance {initial['acceptance']:.4f} (T = {recipe.temperature:g}), greedy {initial['acceptance_greedy']:.4f}")
            if run.is_main:
                write_json_atomic(initial_path, initial)
    else:  # resumed: the starting point was measured by the first run (re-measuring would move the RNG)
        initial = json.loads(initial_path.read_text()) if initial_path.is_file() else None

    bar = run.progress(step, f"draft ({recipe.loss})", progress)
    counts = {"on_policy_steps": 0, "on_policy_tokens": 0, "off_policy_steps": 0}
    tokens, seconds = 0, 0.0
    window_tokens, window_seconds = 0, 0.0
    last_eval = initial
    while step < recipe.max_steps:
        sync(device)
        t0 = time.perf_counter()
        logged = {}
        on_policy = is_on_policy_step(step, recipe.on_policy_fraction)
        for micro in range(recipe.grad_accum):
            index = batch_rows(train_index, step, micro, recipe.batch_size, recipe.grad_accum, recipe.seed, **run.batch_rows_kwargs())
            if on_policy:
                batch = on_policy_batch(draft, rows, index, recipe, pad_id, eos_ids, device)
                counts["on_policy_tokens"] += batch.pop("generated_tokens")
            else:
                batch = collate(rows, index, recipe.max_length, pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            with run.accelerator.accumulate(model):
                with torch.no_grad():
                    target_logits = None if recipe.loss == "ce" else target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
                loss = draft_loss(logits, target_logits, batch, recipe)
                loss = loss * run.token_shares([(batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()).sum()])[0]
                logged["loss"] = run.mean(loss)  # all processes stop together on nan/inf
                norm = run.backward_and_step(model, optimizer, scheduler, loss, recipe.grad_clip)
                if norm is not None:
                    logged["grad_norm"] = norm
            n = int(batch["attention_mask"].sum()) * run.accelerator.num_processes
            tokens, window_tokens = tokens + n, window_tokens + n
        counts["on_policy_steps" if on_policy else "off_policy_steps"] += 1
        sync(device)
        seconds += time.perf_counter() - t0
        window_seconds += time.perf_counter() - t0
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{logged['loss']:.4f}")
        if step % recipe.log_every == 0 or step == recipe.max_steps:
            run.log(step, {"on_policy": on_policy, "lr": scheduler.get_last_lr()[0], "tokens_per_second": window_tokens / max(window_seconds, 1e-9), **logged})
            window_tokens, window_seconds = 0, 0.0
        if heldout_index and (step % recipe.eval_every == 0 or step == recipe.max_steps):
            model.eval()
            with run.gathered(model):
                last_eval = evaluate()
            model.train()
            run.log(step, {"eval": last_eval})
            run.print(
                f"step {step}: acceptance {last_eval['acceptance']:.4f} (T = {recipe.temperature:g}), greedy "
                f"{last_eval['acceptance_greedy']:.4f}, simulated tau (K = {recipe.num_draft_tokens}) {last_eval['tau_simulated']:.3f}"
            )
        run.checkpoint(step)
    if bar is not None:
        bar.close()

    summary = {
        "steps": step,
        "loss": recipe.loss,
        "data": rows.origin,
        "initial": initial,
        "eval": last_eval,
        "train_tokens_per_second": tokens / seconds if seconds else None,
        "draft": draft_info,
        **counts,
        "device": str(device),
        "processes": run.accelerator.num_processes,
        "distributed": str(run.accelerator.distributed_type),
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
            write_json_atomic(out / "training_summary.json", summary)
    run.finish()
    return summary


def main(argv=None) -> int:
    try:
        recipe, progress = command_line(DraftRecipe, "Distil a small draft model from the target (DistillSpec-style).", "recipes/<family>/draft.yaml", argv)
        summary = train(recipe, progress=progress)
    except user_errors() as err:
        print(f"train/draft.py: error: {err}", file=sys.stderr)
        return 2
    if not is_main_process():
        return 0
    ev, init = summary["eval"] or {}, summary["initial"] or {}
    if ev and init:
        print(f"held-out acceptance {init['acceptance']:.4f} -> {ev['acceptance']:.4f} (x{ev['acceptance'] / max(1e-9, init['acceptance']):.3f})")
    print(f"draft written to {Path(recipe.out) / 'draft'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
