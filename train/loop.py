"""The optimizer-step loop every trainer runs, written once: micro-batches under
`accelerator.accumulate`, backward, clipping, the optimizer and schedule step, the NaN stop, a
metrics line every `log_every` steps, a held-out evaluation every `eval_every` steps (and at the
end), a checkpoint every `save_every` steps. What differs between methods stays in
train/<method>.py as plain functions it passes in:

    def micro_step(step, micro):                   # runs inside accumulate(model)
        batch = ...                                # this process's rows (run.batch_rows)
        loss, per_head = model(...)
        return loss, batch, {"head_losses": per_head}   # extras: averaged over processes, logged

    done = train_loop(run, model, micro_step, desc="draft",
                      evaluate=evaluate, describe=lambda ev: f"tau {ev['tau_simulated']:.3f}")

A metrics line reads {"step", **fields(step), "lr", "tokens_per_second", "loss", "grad_norm",
**extras}; an evaluation line {"step", "eval": evaluate()}. `grad_norm` is the norm before
clipping, logged when the engine reports it (and grad_clip > 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from draftsmith.train.common import sync


@dataclass
class Trained:
    """What the loop hands back for the training summary."""

    step: int  # optimizer steps done (recipe.max_steps)
    last_eval: dict | None  # the last held-out evaluation (or the one passed in)
    tokens_per_second: float | None  # tokens (every process's, padding excluded) per second of training


def evaluate_now(run, model, evaluate):
    """`evaluate()` with the model in eval mode, under the run's autocast (as its training forward)
    and with its parameters whole on every process (ZeRO-3 partitions them), then back to training."""
    model.eval()
    with run.gathered(model), run.accelerator.autocast():
        result = evaluate()
    model.train()
    return result


def _mean(run, value):
    """A logged extra averaged over the processes: a scalar tensor, or a list of them."""
    return [run.mean(v) for v in value] if isinstance(value, (list, tuple)) else run.mean(value)


def train_loop(
    run, model, micro_step, *, desc: str | None = None, evaluate=None, describe=None, last_eval=None, fields=None
) -> Trained:
    """Optimizer steps of `run.optimizer` and `run.scheduler` (`run.prepare`) from `run.start_step`
    (`run.start`) to recipe.max_steps, under a progress bar named `desc` (default: `run.method`).

    micro_step(step, micro) -> (loss, batch, extras): the forward of one micro-batch (called
      inside `accelerate.accumulate(model)`); `loss` is this process's share of the step's loss
      (weighted by `run.token_shares`), `batch["attention_mask"]` counts the tokens, `extras`
      maps names to scalar tensors (or lists of them) to average and log.
    evaluate() -> dict: the held-out evaluation (None: the run has no held-out rows);
      describe(result) -> str: what the console shows of it.
    fields(step) -> dict: plain values logged first on each metrics line of `step`.
    """
    r, acc, step = run.recipe, run.accelerator, run.start_step
    bar = run.progress(step, desc or run.method)
    tokens, seconds = 0, 0.0
    window_tokens, window_seconds = 0, 0.0
    model.train()
    while step < r.max_steps:
        run.step = step + 1  # as logged: the step a nan stop names
        sync(run.device)
        t0 = time.perf_counter()
        logged = {}
        for micro in range(r.grad_accum):
            with acc.accumulate(model):
                loss, batch, extras = micro_step(step, micro)
                logged["loss"] = run.mean(loss)  # every process stops together on nan/inf
                norm = run.backward_and_step(model, loss, r.grad_clip)
                if norm is not None:
                    logged["grad_norm"] = norm
            logged.update({name: _mean(run, value) for name, value in extras.items()})
            n = int(batch["attention_mask"].sum()) * acc.num_processes
            tokens, window_tokens = tokens + n, window_tokens + n
        sync(run.device)
        seconds += time.perf_counter() - t0
        window_seconds += time.perf_counter() - t0
        first = fields(step) if fields is not None else {}
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{logged['loss']:.4f}")
        if step % r.log_every == 0 or step == r.max_steps:
            rate = window_tokens / max(window_seconds, 1e-9)
            run.log(step, {**first, "lr": run.scheduler.get_last_lr()[0], "tokens_per_second": rate, **logged})
            window_tokens, window_seconds = 0, 0.0
        if evaluate is not None and (step % r.eval_every == 0 or step == r.max_steps):
            last_eval = evaluate_now(run, model, evaluate)
            run.log(step, {"eval": last_eval})
            run.print(f"step {step}: {describe(last_eval)}")
        run.checkpoint(step)
    if bar is not None:
        bar.close()
    return Trained(step, last_eval, tokens / seconds if seconds else None)
