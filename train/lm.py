"""Causal-LM pretraining from scratch on one token stream: the demo target and its small draft.

    from draftsmith.train.lm import LMTrainConfig, train_lm
    result = train_lm(model, train_tokens, heldout_tokens, LMTrainConfig(steps=800))

One plain loop: random windows of `seq_len + 1` tokens from the stream, next-token cross
entropy, AdamW, linear warm-up then cosine decay to `min_lr_ratio * lr`, gradient clipping,
bf16 autocast where the device has bf16 units (`bf16_is_fast`: ~1.7x faster than fp32 on an AMX CPU). Training is
budgeted in steps, never wall-clock: the same config gives the same model on a busy machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@dataclass
class LMTrainConfig:
    steps: int = 800  # the budget; tokens seen = steps * batch_size * seq_len
    batch_size: int = 16  # sequences per step
    seq_len: int = 256  # context trained on; generation past it degrades (RoPE never saw it)
    lr: float = 1e-3  # small models tolerate a high peak lr
    min_lr_ratio: float = 0.1  # cosine floor = lr / 10 (Chinchilla)
    warmup_steps: int = 50  # a few % of the steps: avoids early divergence at lr 1e-3
    weight_decay: float = 0.1  # AdamW default for GPT-style pretraining
    betas: tuple[float, float] = (0.9, 0.95)  # beta2 0.95: steadier at small batch
    grad_clip: float = 1.0
    bf16: bool = True  # autocast matmuls to bfloat16; master weights stay float32
    seed: int = 0  # init is seeded by the caller; this seeds the window sampler
    eval_batches: int = 20  # held-out batches for the final perplexity (0 = skip)
    log_every: int = 10  # steps between progress-bar loss updates
    pick_threads: bool = True  # CPU: time 1 vs all threads first (a shared machine can make 2 threads 5x slower)

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"LMTrainConfig.warmup_steps must be in [0, steps], got {self.warmup_steps}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"LMTrainConfig: need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")


@dataclass
class LMTrainResult:
    steps: int
    tokens_seen: int
    final_train_loss: float  # mean of the last 10% of steps (one step's loss is noisy)
    heldout_loss: float | None
    heldout_perplexity: float | None
    seconds: float
    num_threads: int  # CPU intra-op threads used
    losses: list[float] = field(default_factory=list)  # every step's training loss

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_seen / self.seconds if self.seconds > 0 else math.nan


def lr_at(step: int, cfg: LMTrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def random_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows at uniform random offsets of the 1-D stream."""
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"token stream of {tokens.numel()} tokens is shorter than one window ({seq_len + 1})")
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).long()


def bf16_is_fast(device: torch.device | str) -> bool:
    """Whether bf16 autocast speeds training on `device`: a CUDA device with bf16, or a CPU with
    bf16 units (AMX or AVX512-BF16). Elsewhere autocast emulates it: measured 15x slower than
    fp32 for the cpu preset's target step on an AVX2-only CPU (40 s vs 2.7 s)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, cfg: LMTrainConfig, device: torch.device) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out stream
    (deterministic: the first `eval_batches * batch_size` windows)."""
    was_training = model.training
    model.eval()
    n = min(cfg.eval_batches * cfg.batch_size, (tokens.numel() - 1) // cfg.seq_len)
    if n < 1:
        raise ValueError(f"held-out stream of {tokens.numel()} tokens is shorter than one window")
    windows = tokens[: n * cfg.seq_len + 1]
    total, count = 0.0, 0
    for first in range(0, n, cfg.batch_size):
        rows = [windows[i * cfg.seq_len : (i + 1) * cfg.seq_len + 1] for i in range(first, min(n, first + cfg.batch_size))]
        batch = torch.stack(rows).long().to(device)
        with _autocast(device, cfg.bf16):
            total += _loss(model, batch).item() * len(rows)
        count += len(rows)
    model.train(was_training)
    return total / count


def fastest_num_threads(model, train_tokens: torch.Tensor, cfg: LMTrainConfig, trials: int = 2) -> int:
    """CPU only: time a few training steps with 1 intra-op thread and with all of them, and
    return the faster count. On a machine shared with other jobs, OpenMP threads that wait
    for a descheduled sibling make every op slower (measured: 2 threads 5x slower than 1 on
    2 cores with one core busy). The weights are restored, so the model trained is the same."""
    candidates = sorted({1, torch.get_num_threads()})
    if len(candidates) == 1:
        return candidates[0]
    before = torch.get_num_threads()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(cfg.seed)
    batch = random_windows(train_tokens, cfg.batch_size, cfg.seq_len, gen)
    timings = {}
    model.train()
    for threads in candidates:
        torch.set_num_threads(threads)
        best = math.inf
        for _ in range(trials + 1):  # the first is a warm-up
            start = time.perf_counter()
            with _autocast(torch.device("cpu"), cfg.bf16):
                _loss(model, batch).backward()
            best = min(best, time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        timings[threads] = best
    model.load_state_dict(state)
    torch.set_num_threads(before)
    return min(timings, key=timings.get)


def train_lm(
    model,
    train_tokens: torch.Tensor,
    heldout_tokens: torch.Tensor | None,
    cfg: LMTrainConfig,
    *,
    device: torch.device | str = "cpu",
    desc: str = "train",
    progress: bool = True,
) -> LMTrainResult:
    """Train `model` (an HF causal LM, float32 weights) in place; return losses and perplexity."""
    device = torch.device(device)
    model.to(device).train()
    threads_before = torch.get_num_threads()
    try:
        if device.type == "cpu" and cfg.pick_threads:
            torch.set_num_threads(fastest_num_threads(model, train_tokens, cfg))
        return _train(model, train_tokens, heldout_tokens, cfg, device, desc, progress)
    finally:
        torch.set_num_threads(threads_before)


def _train(model, train_tokens, heldout_tokens, cfg: LMTrainConfig, device: torch.device, desc: str, progress: bool) -> LMTrainResult:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]  # no decay on norms / biases
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = random_windows(train_tokens, cfg.batch_size, cfg.seq_len, gen).to(device)
        with _autocast(device, cfg.bf16):
            loss = _loss(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{desc}: loss became {loss.item()} at step {step}; lower the lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr_at(step, cfg):.1e}")
    bar.close()
    seconds = time.perf_counter() - start
    threads_used = torch.get_num_threads()
    model.eval()
    tail = losses[-max(1, cfg.steps // 10) :]
    held = heldout_loss(model, heldout_tokens, cfg, device) if heldout_tokens is not None and cfg.eval_batches else None
    return LMTrainResult(
        steps=cfg.steps,
        tokens_seen=cfg.steps * cfg.batch_size * cfg.seq_len,
        final_train_loss=sum(tail) / len(tail),
        heldout_loss=held,
        heldout_perplexity=math.exp(held) if held is not None else None,
        seconds=seconds,
        num_threads=threads_used,
        losses=losses,
    )
