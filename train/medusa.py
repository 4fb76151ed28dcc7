"""Train Medusa heads on a frozen target's own generations.

    accelerate launch train/medusa.py --recipe recipes/smollm2/medusa.yaml
    accelerate launch train/medusa.py --recipe recipes/smollm2/medusa.yaml max_steps=50 loss=forward_kl
    python train/medusa.py --recipe recipes/smollm2/medusa.yaml          # one process, same loop

Medusa head k (0-based) reads the target's last hidden state h_t (after the final norm) and
predicts token t+2+k: the target itself supplies token t+1, the heads the tokens after it.

- Medusa-1 (`mode: medusa1`): the target is frozen. Its hidden states come from a forward
  under no_grad inside the loop (online, the default), or from a `draftsmith cache-hidden`
  cache holding the `last` layer (offline: `hidden_cache: DIR`; it may hold others, so one
  cache of (2, L//2, L-3, last) serves every trainer that reads one alike).
- Medusa-2 (`mode: medusa2`): LoRA adapters on the backbone train jointly with the heads,
  L = L_base + lambda * sum_k w_k L_k, where L_base = KL(original target || adapted target)
  on the next token keeps the backbone's own predictions (the adapters are disabled for the
  teacher pass), lambda warms up linearly, and the heads learn at `head_lr_multiplier` x lr.
- Head losses: `loss: ce` (hard labels = the data's tokens, i.e. the target's own answers) or
  a divergence from `draftsmith.distill.losses` against the target's distribution for the
  same token (its logits at position t+1+k), weighted w_k = head_decay^k.
- Every `eval_every` steps on the held-out rows: per-head top-1/top-5 accuracy, the rank-wise
  accuracy table the tree builder uses, and the simulated chain acceptance length
  tau = 1 + E[consecutive heads whose top-1 is right] (counting the target's own token).
- Checkpoints every `save_every` steps (accelerate state + step); `resume: true` continues
  from the latest one and ends with the same weights as an uninterrupted run (the batch order
  is a function of the seed and the step only).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.distill.acceptance import simulated_tau
from draftsmith.distill.losses import DIVERGENCES, Projected, cross_entropy, divergence
from draftsmith.train.command_line import trainer_main
from draftsmith.train.common import (
    batch_rows,
    collate_rows,
    draft_vocab_map,
    heldout_prompts,
    heldout_walks,
    serve_check,
    sync,
    to_device,
    walk_taus,
)
from draftsmith.train.loop import train_loop
from draftsmith.train.recipe import RecipeError, RunRecipe
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import cleaned_up_on_error
from draftsmith.train.sharding import target_dims
from draftsmith.train.teacher import cached_states, on_draft_vocab, open_hidden_cache, target_forward

LOSSES = ("ce",) + DIVERGENCES


@dataclass(kw_only=True)
class MedusaRecipe(RunRecipe):
    """RunRecipe's keys (target, data, out, lr, batch, schedule, cadence, ...) and Medusa's."""

    mode: str = "medusa1"  # medusa1: frozen target; medusa2: + LoRA on the backbone
    hidden_cache: str | None = None  # offline Medusa-1: a `cache-hidden` folder holding `last` (and any others)
    num_heads: int = 4  # Medusa's default; deeper heads are rarely right (acc ~0.8^k)
    num_layers: int = 1  # residual blocks per head (Medusa: 1)
    share_lm_head: bool = False  # reuse the target's frozen lm_head (for 128k+ vocabularies)
    draft_vocab_size: int | None = None  # heads over the data's most frequent tokens only (None = full)
    vocab_map: str | None = None  # a `draftsmith vocab-map` file of this data instead
    loss: str = "ce"  # ce, or a divergence: forward_kl, reverse_kl, jsd, tv, soft_ce, kl_tv
    temperature: float = 1.0  # of the divergence; match the serving temperature
    head_decay: float = 0.8  # w_k = head_decay^k (Medusa): later heads are less often useful
    lr: float = 1e-3  # Medusa-1 heads train from identity: a high lr is safe
    chunk_size: int | None = None  # token chunks for the loss (memory for large vocabularies)
    eval_topk: int = 10  # ranks kept in the accuracy table (the tree builder's input)
    # Medusa-2 only
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )  # family-specific
    medusa2_lambda: float = 0.2  # weight of the head losses against L_base once warmed up
    lambda_warmup_steps: int = 50  # heads start random-ish: keep them from pulling the backbone early
    head_lr_multiplier: float = 4.0  # heads learn from scratch, the backbone only adapts

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in ("medusa1", "medusa2"):
            raise ValueError(f"mode = {self.mode!r}: expected medusa1 or medusa2")
        if self.loss not in LOSSES:
            raise ValueError(f"loss = {self.loss!r}: expected one of {', '.join(LOSSES)}")
        if self.mode == "medusa2" and self.hidden_cache:
            raise ValueError("hidden_cache (offline) is for medusa1: medusa2 trains the backbone, whose states change")
        for name in ("num_heads", "num_layers", "eval_topk", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.max_length < self.num_heads + 2:
            raise ValueError(f"max_length = {self.max_length} leaves no position for {self.num_heads} heads")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(
                f"draft_vocab_size = {self.draft_vocab_size} must be >= 1 (or unset for the full vocabulary)"
            )
        if self.share_lm_head and (self.draft_vocab_size or self.vocab_map):
            raise ValueError(
                "share_lm_head projects with the target's whole lm_head: drop draft_vocab_size / vocab_map"
            )
        if not 0 < self.head_decay <= 1 or self.temperature <= 0:
            raise ValueError("need 0 < head_decay <= 1, temperature > 0")


def head_parameters(recipe: MedusaRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters of the heads `train` builds for `target` (meta is fine; the
    memory estimate, train/sharding.py): K heads of `num_layers` residual blocks (H x H + bias),
    each with its own lm_head copy (V x H, or Vd x H with `draft_vocab_size`) unless `share_lm_head`
    reuses the target's. Medusa-2's LoRA on the target is not counted (nor a `vocab_map` file's size)."""
    _, H, V = target_dims(target)
    K, V = recipe.num_heads, min(V, recipe.draft_vocab_size or V)
    blocks = K * recipe.num_layers * (H * H + H)
    return blocks + (0 if recipe.share_lm_head else K * V * H), 0


# --------------------------------------------------------------------------- losses


def head_targets(batch: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and mask for head k: position t predicts token t+2+k, trained when that token is
    under the loss mask (an answer token) and both positions are real (not padding)."""
    shift = 2 + k
    labels = batch["input_ids"][:, shift:]
    mask = batch["loss_mask"][:, shift:] & batch["attention_mask"][:, :-shift].bool()
    return labels, mask


def head_losses(heads, hidden, teacher_logits, batch, recipe: MedusaRecipe) -> list[torch.Tensor]:
    """One loss per head. `hidden` [B, T, H] is the target's post-norm last hidden state;
    `teacher_logits` [B, T, V] its logits (None for hard CE). Heads over a reduced vocabulary learn
    the draft tokens only: a label outside it, or (for a divergence) a position where the target's
    argmax is outside it, teaches nothing they can draft and is masked."""
    losses, reduced = [], heads.config.reduced
    if reduced:
        vocab = heads.draft_ids()  # [Vd] target ids
        draft_of = torch.full((heads.config.vocab_size,), -1, dtype=torch.long, device=vocab.device)
        draft_of[vocab] = torch.arange(vocab.numel(), device=vocab.device)  # [V]: draft id, -1 outside
    for k, hk in enumerate(heads.head_hidden(hidden)):
        labels, mask = head_targets(batch, k)
        shift = 2 + k
        student = Projected(hk[:, :-shift], heads.lm_head_weight(k))
        if recipe.loss == "ce":
            if reduced:
                labels = draft_of[labels]
                mask, labels = mask & (labels >= 0), labels.clamp(min=0)
            losses.append(cross_entropy(student, labels, mask, chunk_size=recipe.chunk_size))
        else:
            # The target's distribution for token t+2+k is its prediction at position t+1+k.
            teacher = teacher_logits[:, 1 + k : teacher_logits.shape[1] - 1]
            if reduced:
                teacher, in_vocab = on_draft_vocab(teacher, vocab, heads.t2d)
                mask = mask & in_vocab
            losses.append(
                divergence(
                    recipe.loss, student, teacher, mask, temperature=recipe.temperature, chunk_size=recipe.chunk_size
                )
            )
    return losses


def next_token_kl(adapted_logits, original_logits, batch, temperature: float = 1.0) -> torch.Tensor:
    """Medusa-2's L_base: KL(original || adapted) on the next token at answer positions."""
    mask = batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()
    return divergence("forward_kl", adapted_logits[:, :-1], original_logits[:, :-1], mask, temperature=temperature)


class MedusaObjective(torch.nn.Module):
    """The trainable parts and the loss, behind one forward (what DDP wraps).

    Medusa-1: `hidden`/`teacher` come from the frozen target, computed outside under no_grad.
    Medusa-2: the LoRA-adapted backbone runs here; the teacher is the same model with its
    adapters disabled (the original target), and L = L_base + lam * sum_k w_k L_k.
    """

    def __init__(self, heads, backbone, recipe: MedusaRecipe):
        super().__init__()
        self.heads = heads
        self.backbone = backbone  # a peft model (medusa2) or None
        self.recipe = recipe
        self.weights = [recipe.head_decay**k for k in range(recipe.num_heads)]

    def backbone_forward(self, batch):
        with torch.no_grad(), self.backbone.disable_adapter():
            original = self.backbone(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits.float()
        out = self.backbone(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
            use_cache=False,
        )
        return original, out

    def forward(self, input_ids, attention_mask, loss_mask, hidden=None, teacher=None, lam: float = 0.0, shares=None):
        """`shares`: per head (then L_base) the factor of this process's token share
        (`TrainingRun.token_shares`; 1 with one process)."""
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        shares = shares or [1.0] * (len(self.weights) + 1)
        base = None
        if self.backbone is not None:
            teacher, out = self.backbone_forward(batch)
            hidden = out.hidden_states[-1]
            base = next_token_kl(out.logits.float(), teacher, batch) * shares[-1]
        per_head = head_losses(self.heads, hidden.to(self.heads.dtype), teacher, batch, self.recipe)
        per_head = [l * share for l, share in zip(per_head, shares)]
        loss = sum(w * l for w, l in zip(self.weights, per_head))
        if base is not None:
            loss = base + lam * loss
        return loss, per_head, base


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_heads(heads, states_fn, data, rows, recipe: MedusaRecipe, pad_id: int, device) -> dict:
    """Per-head top-1/top-5 accuracy, rank-wise accuracy table, simulated chain tau.

    `states_fn(batch) -> (hidden [B,T,H], extra dict)` supplies the target's hidden states.
    """
    K, R = recipe.num_heads, recipe.eval_topk
    rank_hits = torch.zeros(K, R, dtype=torch.float64)
    counted = torch.zeros(K, dtype=torch.float64)
    tau_sum = tau_n = 0.0
    walks = torch.zeros(2, 2, dtype=torch.float64)  # (every held-out row, the serve check's) x (tokens, calls)
    drift_sum = drift_n = 0.0
    for start in range(0, len(rows), recipe.batch_size):
        batch = collate_rows(data, rows[start : start + recipe.batch_size], recipe.max_length, pad_id)
        batch = to_device(batch, device)
        hidden, extra = states_fn(batch)
        if "drift" in extra:
            drift_sum += float(extra["drift"]) * extra["drift_n"]
            drift_n += extra["drift_n"]
        T = hidden.shape[1]
        correct_top1, head0_valid = [], None
        for k, logits in enumerate(heads(hidden.to(heads.dtype))):
            labels, mask = head_targets(batch, k)
            top = logits[:, : T - 2 - k].float().topk(min(R, logits.shape[-1]), dim=-1).indices  # [B, T', R]
            hit = top == labels[..., None]
            rank_hits[k, : hit.shape[-1]] += hit[mask].double().sum(0).cpu()
            counted[k] += mask.sum().cpu()
            # top-1 correctness aligned at the context position t, padded to T
            c = torch.zeros(hidden.shape[:2], dtype=torch.float64, device=hidden.device)
            c[:, : T - 2 - k] = (hit[..., 0] & mask).double()
            correct_top1.append(c)
            if k == 0:
                head0_valid = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
                head0_valid[:, : T - 2] = mask
        # The chain at positions where head 0 is evaluated: heads accepted until the first miss;
        # the decoder's walk over those chains, and their mean over every position.
        chains, starts = torch.stack(correct_top1, -1).cpu(), head0_valid.cpu()
        walks += heldout_walks(chains, starts, start, recipe)
        tau_sum += float(simulated_tau(correct_top1)[head0_valid].sum())
        tau_n += float(head0_valid.sum())
    acc = (rank_hits / counted.clamp(min=1)[:, None]).tolist()
    return {
        "top1": [a[0] for a in acc],
        "top5": [sum(a[:5]) for a in acc],
        "rank_accuracy": acc,
        **walk_taus(walks),  # along the decoder's walk: every held-out row, the serve check's; bonus token counted
        "tau_simulated_mean": tau_sum / tau_n if tau_n else 1.0,  # the chain's length averaged over every position
        "positions": tau_n,
        **({"kl_drift": drift_sum / max(1.0, drift_n)} if drift_n else {}),
    }


# --------------------------------------------------------------------------- the loop


@cleaned_up_on_error
def train(recipe: MedusaRecipe, *, progress: bool = True) -> dict:
    from draftsmith.heads.medusa import MedusaHeads, save_medusa

    run = TrainingRun(recipe, "medusa", progress)
    device, out = run.device, Path(recipe.out)
    # head 0 at position t predicts token t+2: position 2 is the first a head is trained on
    target, data, train_rows, heldout_rows = run.load_training(first=2)
    text_config = target.config.get_text_config()
    # Offline Medusa-1 reads the post-norm last state (HF hidden_states id = number of layers).
    last = (text_config.num_hidden_layers,)
    cache = open_hidden_cache(recipe.hidden_cache, target, data, last) if recipe.hidden_cache else None
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0

    vocab_map = draft_vocab_map(recipe, data, target.get_output_embeddings().weight.shape[0])
    heads = MedusaHeads.for_target(
        target,
        recipe.num_heads,
        recipe.num_layers,
        recipe.share_lm_head,
        target_name_or_path=recipe.target,
        data_hash=data.data_hash,
        vocab_map=vocab_map,
    ).to(device)
    if vocab_map is not None:
        run.print(vocab_map.describe())
    backbone = None
    params = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": recipe.lr}]
    if recipe.mode == "medusa2":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=recipe.lora_r,
            lora_alpha=recipe.lora_alpha,
            lora_dropout=recipe.lora_dropout,
            target_modules=list(recipe.lora_target_modules),
        )
        try:
            backbone = get_peft_model(target, lora)
        except ValueError as err:
            raise RecipeError(f"lora_target_modules {recipe.lora_target_modules}: {err}") from None
        params = [
            {"params": [p for p in backbone.parameters() if p.requires_grad], "lr": recipe.lr},
            {"params": params[0]["params"], "lr": recipe.lr * recipe.head_lr_multiplier},
        ]
    # Everything trainable sits behind one forward, so DDP syncs the gradients of all of it.
    model = MedusaObjective(heads, backbone, recipe)
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    model = run.prepare(model, optimizer)
    objective = run.accelerator.unwrap_model(model)
    heads_module = objective.heads

    def target_states(batch):
        """Medusa-1: the frozen target's post-norm last hidden state and, for divergence
        losses, its logits; from the forward (online) or the cache (offline)."""
        if cache is not None:
            hidden = cached_states(cache, batch, device, last)[0][:, 0]  # [B, T, H]: the cache may hold more layers
            teacher = None if recipe.loss == "ce" else target.get_output_embeddings()(hidden.to(target.dtype)).float()
            return hidden, teacher
        out = target_forward(target, batch["input_ids"], batch["attention_mask"])
        return out.hidden_states[-1].float(), (None if recipe.loss == "ce" else out.logits.float())

    def eval_states(batch):
        if backbone is None:
            return target_states(batch)[0], {}
        with torch.no_grad():
            original, out = objective.backbone_forward(batch)
        mask = batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()
        drift = next_token_kl(out.logits.float(), original, batch)
        return out.hidden_states[-1].float(), {"drift": float(drift), "drift_n": float(mask.sum())}

    run.start()

    # Forward-only throughput of the target on a few training batches: the yardstick for the
    # training throughput below (Medusa-1 training costs a target forward plus the heads).
    forward_tokens, forward_seconds = 0, 0.0
    for micro in range(min(3, recipe.max_steps)):
        batch = collate_rows(
            data,
            batch_rows(train_rows, 0, micro % recipe.grad_accum, recipe.batch_size, recipe.grad_accum, recipe.seed),
            recipe.max_length,
            pad_id,
        )
        ids, att = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        sync(device)
        t0 = time.perf_counter()
        target_forward(target, ids, att)
        sync(device)
        forward_seconds += time.perf_counter() - t0
        forward_tokens += int(att.sum())

    def micro_step(step, micro):
        """One micro-batch: the loss (this process's token share), the batch, per-head losses."""
        batch = run.batch(data, train_rows, step, micro, pad_id)
        hidden = teacher = None
        if backbone is None:
            hidden, teacher = target_states(batch)
        lam = recipe.medusa2_lambda * min(1.0, (step + 1) / recipe.lambda_warmup_steps)
        counts = [head_targets(batch, k)[1].sum() for k in range(recipe.num_heads)]
        counts.append((batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()).sum())  # L_base's tokens
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        loss, per_head, base = model(ids, attention, loss_mask, hidden, teacher, lam, run.token_shares(counts))
        return loss, batch, ({"base_kl": base} if base is not None else {}) | {"head_losses": per_head}

    def evaluate():
        return evaluate_heads(heads_module, eval_states, data, heldout_rows, recipe, pad_id, device)

    def describe(ev):
        drift = f", KL drift {ev['kl_drift']:.4f}" if "kl_drift" in ev else ""
        return f"top-1 per head {[round(a, 3) for a in ev['top1']]}, simulated tau {ev['tau_simulated']:.3f}{drift}"

    evaluate = evaluate if heldout_rows else None
    done = train_loop(run, model, micro_step, desc=f"medusa ({recipe.mode})", evaluate=evaluate, describe=describe)

    summary = {
        "steps": done.step,
        "mode": recipe.mode,
        "eval": done.last_eval,
        "train_tokens_per_second": done.tokens_per_second,
        "target_forward_tokens_per_second": forward_tokens / forward_seconds if forward_seconds else None,
    }
    with run.gathered(model):
        if run.is_main:
            if done.last_eval is not None:
                heads_module.config.head_accuracies = done.last_eval["rank_accuracy"]
            save_medusa(heads_module, out / "heads")
            if backbone is not None:
                backbone.save_pretrained(str(out / "adapter"))
    K, prompts = recipe.num_heads, heldout_prompts(data, heldout_rows, recipe.serve_check_prompts)  # K of the tau
    summary["serve_check"] = serve_check(run, target, "medusa", out / "heads", prompts, K, done.last_eval)
    return run.finish(summary)


def merge_adapter(target_dir, adapter_dir, out_dir, *, dtype=torch.float32) -> Path:
    """Medusa-2: fold the trained LoRA adapter into the target's weights (a plain HF model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    try:
        AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp)
    except (OSError, ValueError):
        pass
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv=None) -> int:
    shown = ("steps", "train_tokens_per_second", "target_forward_tokens_per_second")
    return trainer_main("train/medusa.py", __doc__, MedusaRecipe, train, argv, result="heads", shown=shown)


if __name__ == "__main__":
    sys.exit(main())
