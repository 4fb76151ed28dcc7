"""A training run's lifecycle, the same for every method: the accelerator and its engine
(one process, DDP, DeepSpeed, FSDP2), the start (resume or warm start, the run recorded),
each step's reductions and metrics, trackers, the NaN stop, and the end (summary, Hub push).

Each trainer in train/ stays readable top to bottom: it builds its model and optimizer, then

    run = TrainingRun(recipe, "draft", progress)   # accelerator, output folder checked
    model = run.prepare(model, optimizer)          # the run keeps the optimizer and its schedule
    step = run.start()                             # resume / warm start; recipe + run_info written
    done = train_loop(run, model, micro_step, ...)  # from `step` to max_steps: train/loop.py
    ...  save the result (inside `run.gathered(model)`, on the main process)
    return run.finish(summary)                     # summary written, trackers closed, pushed if asked

Checkpoints (their format, exact resume, warm start) are train/checkpoints.py; what a run may do
to its output folder is train/run_folder.py; the command line around a trainer is
train/command_line.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from draftsmith.distill.data import write_json_atomic
from draftsmith.train.checkpoints import resume, save_checkpoint, warm_start
from draftsmith.train.common import batch_rows, collate_rows, length_bytes, to_device, training_rows, warmup_cosine
from draftsmith.train.recipe import RecipeError, recipe_dict, run_info
from draftsmith.train.run_folder import check_out_writable, drop_metrics_after, latest_checkpoint, refuse_earlier_run


def data_target_note(recipe, data, target) -> str | None:
    """Data another target generated teaches another model's answers: a RecipeError naming both
    (`heads.provenance`), unless `recipe.allow_target_mismatch` says `target` is a fine-tune of
    that one; then the note to print (None when they are the same)."""
    from draftsmith.heads.provenance import ProvenanceError, TargetRecord, check_target_provenance

    recorded = TargetRecord.of_description(data.provenance.get("target"))
    try:
        return check_target_provenance(
            f"data {str(data.dir)!r}",
            recorded,
            target,
            allow_mismatch=recipe.allow_target_mismatch,
            flag="set allow_target_mismatch=true",
        )
    except ProvenanceError as err:
        raise RecipeError(str(err)) from None


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, a checkpoint that does not fit); the message says
    what happened and what on disk is still good."""


# --------------------------------------------------------------------------- the run


def mixed_precision(recipe) -> str | None:
    """The autocast the drafter's forward runs under (accelerate's `mixed_precision`): the recipe's,
    else (auto) the launcher's when `accelerate launch --mixed_precision` set one (None: accelerate
    reads it), else the target dtype's half type. Master weights stay fp32 (`fp32_master`)."""
    from draftsmith.heads.models import resolve_dtype

    if recipe.mixed_precision != "auto":
        return recipe.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None
    cpu = recipe.device == "cpu" or not torch.cuda.is_available()
    dtype = resolve_dtype(recipe.dtype, torch.device("cpu" if cpu else "cuda"))
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
    return "no" if cpu and half == "fp16" else half  # fp16 autocast needs a CUDA grad scaler


def fp32_master(model) -> None:
    """The trainable parameters in fp32, in place (the optimizer keeps the same tensors): AdamW's
    small updates vanish in bf16 weights. The frozen ones (the target's embedding copy) keep their
    dtype; the forward runs under the run's autocast (`mixed_precision`)."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


def make_accelerator(recipe, grad_accum: int):
    """An Accelerator for whatever `accelerate launch` set up (one process, DDP, DeepSpeed,
    FSDP2), with the recipe's `mixed_precision`. On CPU the processes talk over gloo (DeepSpeed
    picks no backend of its own there)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and (recipe.device == "cpu" or not torch.cuda.is_available()):
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    precision = mixed_precision(recipe)
    shared = AcceleratorState._shared_state
    if not launched and shared and precision is not None and str(shared.get("_mixed_precision")) != precision:
        # one process training again with another precision (a second run in the same Python, as the
        # demo's do): accelerate keeps its first state for the process and refuses any other
        AcceleratorState._reset_state()
    return Accelerator(
        gradient_accumulation_steps=grad_accum,
        mixed_precision=precision,
        cpu=recipe.device == "cpu",
        log_with=list(recipe.report_to) or None,
        project_dir=str(recipe.out),
        kwargs_handlers=handlers,
    )


def _scalars(record: dict, prefix: str = "") -> dict:
    """Flatten a metrics record to the scalar name -> value map trackers take
    (lists become name/1, name/2, ... : position 1 is the first draft position)."""
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_scalars(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                flat.update({f"{name}/{i + 1}": float(v) for i, v in enumerate(value)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            flat[name] = float(value)
    return flat


class TrainingRun:
    def __init__(self, recipe, method: str, progress: bool = True):
        self.recipe, self.method, self.show_progress = recipe, method, progress
        self.out = Path(recipe.out)
        self.step = 0  # the optimizer step being computed (train_loop keeps it), for messages
        self.start_step = 0  # where training continues from (`start`: a resumed run's step)
        self.optimizer = self.scheduler = None  # `prepare`'s, stepped by `backward_and_step`
        self.accelerator = make_accelerator(recipe, recipe.grad_accum)
        from accelerate.utils import set_seed

        set_seed(recipe.seed)
        if self.accelerator.is_main_process:
            check_out_writable(self.out)
        self.accelerator.wait_for_everyone()
        self.metrics_path = self.out / "metrics.jsonl"
        if self.accelerator.state.deepspeed_plugin is not None:
            # Models load whole on every process: the frozen target must stay a plain module and
            # heads copy target weights; ZeRO-3 partitions the trainable model when it is prepared
            # (target_sharding zero3 partitions the target itself, layer by layer: train/sharding.py).
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        self.memory_estimate, self.target_bytes_held = None, None
        self._device_map = self._head_device = None
        self._lengths = None  # (training rows, their lengths as int32 bytes): `batch` reads them once
        from draftsmith.train.sharding import ShardingError, check_process_count

        try:
            check_process_count(recipe.target_sharding, self.accelerator.num_processes)
        except ShardingError as err:
            raise RecipeError(str(err)) from None
        if recipe.target_sharding == "device_map":
            from draftsmith.heads.models import resolve_dtype
            from draftsmith.train.sharding import meta_target, plan_device_map

            self._meta = meta_target(recipe)
            dtype = resolve_dtype(recipe.dtype, self.accelerator.device)
            self._device_map, self._head_device = plan_device_map(recipe, self._meta, dtype)

    def load_target(self):
        """The frozen target in the recipe's dtype, placed as `target_sharding` says (whole on this
        process, spread over its GPUs, or partitioned over the processes by fsdp2 or ZeRO-3:
        train/sharding.py) once the memory estimate, printed first, fits; never given to the
        engine, so it has no gradients and no optimizer state."""
        from draftsmith.heads.models import load_causal_lm, resolve_dtype
        from draftsmith.train import sharding

        r = self.recipe
        dtype = resolve_dtype(r.dtype, self.device)
        meta = getattr(self, "_meta", None) or sharding.meta_target(r)
        if r.serve_check_prompts:  # before any training: the serve check must be able to decode this target
            from draftsmith.decoding.kv import check_decodable

            try:
                check_decodable(meta)
            except ValueError as err:
                raise RecipeError(
                    f"the serve check cannot decode this target: {err} (serve_check_prompts=0 trains without it)"
                ) from None
        shards = len({str(d) for d in self._device_map.values()}) if self._device_map else None
        self.memory_estimate = sharding.estimate_memory(r, self.method, shards=shards, target=meta)
        self.print(self.memory_estimate.describe())
        try:
            sharding.check_fits(self.memory_estimate, *sharding.available_bytes(self.device))
            if r.target_sharding in sharding.PARTITIONED:
                target = sharding.load_partitioned(r, self.device, dtype)
            elif r.target_sharding == "device_map":
                target = sharding.load_device_map(r, dtype, self._device_map, self._head_device)
            else:
                target = load_causal_lm(
                    r.target, device=self.device, dtype=dtype, role="target", trust_remote_code=r.trust_remote_code
                )
        except sharding.ShardingError as err:
            raise RecipeError(str(err)) from None
        self.target_bytes_held = sharding.held_bytes(target)
        if r.target_sharding != "none":
            self.print(
                f"target: {sharding.gib(self.target_bytes_held)} of its {sharding.gib(self.memory_estimate.target_bytes)} held by each process"
            )
        return target.requires_grad_(False)

    def load_training(self, first: int):
        """(target, data, training rows, held-out rows): the frozen target and the recipe's
        `draftsmith generate` folder, checked to be this target's answers (`check_data_target`),
        its rows split and checked to train a token at position >= `first`, the first a draft of
        this method is trained on (`training_rows`)."""
        from draftsmith.distill.data import DistillData

        data = DistillData(self.recipe.data)
        target = self.load_target()
        self.check_data_target(data, target)
        return target, data, *training_rows(self.recipe, data, first)

    def check_data_target(self, data, target) -> None:
        """`data_target_note`, printed by the main process."""
        note = data_target_note(self.recipe, data, target)
        if note:
            self.print(note)

    @property
    def device(self) -> torch.device:
        """Where the trained model and the batches go: the accelerator's device, or with
        target_sharding device_map the device of the target's last hidden state."""
        return self._head_device or self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def print(self, *args) -> None:
        self.accelerator.print(*args)

    def batch_rows(self, train_rows: list[int], step: int, micro: int, lengths: bytes | None = None) -> list[int]:
        """This process's rows of micro-batch `micro` of optimizer step `step` (`common.batch_rows`;
        `lengths`: one per training row, grouping batches by length)."""
        r, acc = self.recipe, self.accelerator
        rank, world = acc.process_index, acc.num_processes
        return batch_rows(
            train_rows, step, micro, r.batch_size, r.grad_accum, r.seed, rank=rank, world=world, lengths=lengths
        )

    def batch(self, data, train_rows: list[int], step: int, micro: int, pad_id: int) -> dict:
        """Micro-batch `micro` of step `step`: this process's rows (`batch_rows`, grouped by length when
        the recipe says `group_by_length`) of a `DistillData`, collated (`collate_rows`, with their row
        ids; the loss on the positions `train_on` names) and on the device."""
        lengths = None
        if self.recipe.group_by_length:
            if self._lengths is None or self._lengths[0] is not train_rows:
                self._lengths = (train_rows, length_bytes(data.lengths()[train_rows], self.recipe.max_length))
            lengths = self._lengths[1]
        rows = self.batch_rows(train_rows, step, micro, lengths)
        every_token = self.recipe.train_on == "all"
        return to_device(collate_rows(data, rows, self.recipe.max_length, pad_id, every_token), self.device)

    # ---------------------------------------------------------------- engine

    def _fit_deepspeed_config(self) -> None:
        """DeepSpeed reads batch sizes from its own config; they must be the recipe's. 'auto'
        takes the recipe's value, a number that contradicts it is an error naming both."""
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            return
        plugin = self.accelerator.state.deepspeed_plugin
        config = plugin.deepspeed_config
        where = getattr(plugin.hf_ds_config, "config_file", None) or "the DeepSpeed config"
        r = self.recipe
        wanted = {
            "train_micro_batch_size_per_gpu": r.batch_size,
            "gradient_accumulation_steps": r.grad_accum,
            "train_batch_size": r.batch_size * r.grad_accum * self.accelerator.num_processes,
            "gradient_clipping": float(r.grad_clip or 0.0),
        }
        for key, value in wanted.items():
            have = config.get(key, "auto")
            if have != "auto" and have != value and not (key == "gradient_clipping" and float(have) == value):
                recipe_key = {
                    "train_micro_batch_size_per_gpu": "batch_size",
                    "gradient_accumulation_steps": "grad_accum",
                    "train_batch_size": "batch_size x grad_accum x processes",
                    "gradient_clipping": "grad_clip",
                }[key]
                raise RecipeError(
                    f'{where}: {key} = {have} contradicts the recipe ({recipe_key} gives {value}); set it to "auto" or {value}'
                )
            config[key] = value

    def prepare(self, model, optimizer):
        """The trainable model wrapped for the engine. The run keeps its optimizer (wrapped too)
        and the recipe's schedule (linear warm-up, cosine decay to 10% of the peak) as
        `self.optimizer` and `self.scheduler`. The scheduler is stepped by hand once per optimizer
        step (so the schedule reads in optimizer steps whatever the number of processes) and saved
        with every checkpoint."""
        r = self.recipe
        fp32_master(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(r.warmup_steps, r.max_steps))
        self._fit_deepspeed_config()
        # device_map: the head stays beside the target's last hidden state, not on the first GPU
        placement = [False, False] if self._head_device is not None else None
        model, optimizer = self.accelerator.prepare(model, optimizer, device_placement=placement)
        self.accelerator.register_for_checkpointing(scheduler)
        self.optimizer, self.scheduler = optimizer, scheduler
        return model

    def gathered(self, model):
        """A context in which the trainable model's parameters are whole on every process (they
        are partitioned under DeepSpeed ZeRO-3): evaluation and saving run inside it."""
        if (
            self.accelerator.state.deepspeed_plugin is not None
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- start

    def start(self) -> int:
        """Resume (latest or a given checkpoint) or warm-start when the recipe says so, refuse to
        write over another run (its checkpoints or its records), create `out` (the first write of
        the run: every input is checked before), record the recipe and the environment, open the
        trackers. Returns the step to continue from."""
        r, acc = self.recipe, self.accelerator
        current = recipe_dict(r)
        step = 0
        if r.resume:
            step = resume(acc, self.out, r.resume, current, say=self.print)
        elif latest_checkpoint(self.out) is not None:
            raise RecipeError(
                f"{self.out} already holds checkpoints: pass resume=true (or --resume) to continue, or choose another out"
            )
        elif r.init_from:
            warm_start(acc, Path(r.init_from).expanduser(), say=self.print)
        if step == 0:
            refuse_earlier_run(self.out)
        # every process has checked `out` as it found it (so all pass or all raise) before the
        # main one writes there: otherwise a slower process would take this run's recipe.json
        # for an earlier run's
        acc.wait_for_everyone()
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            drop_metrics_after(self.metrics_path, step)
            write_json_atomic(self.out / "recipe.json", current)
            write_json_atomic(self.out / "run_info.json", run_info(r))
        if r.report_to:
            acc.init_trackers(
                r.tracker_project,
                config=_scalars(
                    {k: v for k, v in current.items() if isinstance(v, (int, float, str, bool)) and v is not None}
                )
                | {k: str(v) for k, v in current.items() if isinstance(v, (str, bool)) or v is None},
                init_kwargs={"wandb": {"dir": str(self.out), "name": f"{self.method}-{self.out.name}"}},
            )
        acc.wait_for_everyone()
        self.start_step = step
        return step

    # ---------------------------------------------------------------- each step

    def mean(self, value) -> float:
        """The mean of a scalar over every process; a nan/inf stops every process together with
        a message naming the last good checkpoint (nothing is saved after it)."""
        t = value.detach().float().reshape(1) if torch.is_tensor(value) else torch.tensor([float(value)])
        mean = float(self.accelerator.reduce(t.to(self.device), reduction="mean"))
        if not math.isfinite(mean):
            good = latest_checkpoint(self.out)
            where = (
                f"the last good checkpoint is {good} (resume=true continues from it)"
                if good
                else "no checkpoint was written yet"
            )
            raise TrainingError(
                f"{self.method}: the loss became {mean} at step {self.step}; training stopped, {where}. Lower lr, check grad_clip and the data."
            )
        return mean

    def token_shares(self, counts) -> list[float]:
        """Factors that turn losses averaged over this process's tokens into its share of the
        average over every process's tokens: a loss l_r averaged over n_r tokens, times
        n_r * P / sum_r n_r, has gradients whose average over the P processes (what DDP and
        DeepSpeed compute) equals the gradient of the loss over the whole global batch. With one
        process every factor is 1, so the multi-process run trains what the single one does."""
        P = self.accelerator.num_processes
        if P == 1:
            return [1.0] * len(counts)
        local = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=self.device)
        total = self.accelerator.reduce(local.clone(), reduction="sum")
        return [float(n * P / t) if t > 0 else 0.0 for n, t in zip(local.tolist(), total.tolist())]

    def backward_and_step(self, model, loss, grad_clip: float) -> float | None:
        """Backward; on the micro-step that completes an optimizer step, clip, step the optimizer
        and the schedule. Returns the gradient norm before clipping when the engine reports it."""
        acc = self.accelerator
        acc.backward(loss)
        norm = None
        if acc.sync_gradients and grad_clip:
            norm = acc.clip_grad_norm_(model.parameters(), grad_clip)
        self.optimizer.step()
        if acc.sync_gradients:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return None if norm is None else float(norm)

    def log(self, step: int, record: dict) -> None:
        """One line of OUT/metrics.jsonl, and the same numbers to the trackers."""
        if self.is_main:
            with self.metrics_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")
        if self.recipe.report_to:
            self.accelerator.log(_scalars(record), step=step)

    def checkpoint(self, step: int) -> None:
        if step % self.recipe.save_every == 0 and step < self.recipe.max_steps:
            save_checkpoint(
                self.accelerator, self.out, step, recipe_dict(self.recipe), keep=self.recipe.keep_checkpoints
            )

    def progress(self, step: int, desc: str):
        """A progress bar on the main process only, when the run shows progress (None elsewhere)."""
        if not (self.show_progress and self.is_main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.recipe.max_steps, initial=step, desc=desc, unit="step")

    # ---------------------------------------------------------------- end

    def finish(self, summary: dict) -> dict:
        """OUT/training_summary.json written (the summary plus where the run ran), every process
        done, trackers closed, the result pushed when the recipe asks. Returns the summary."""
        acc = self.accelerator
        where = {
            "device": str(self.device),
            "processes": acc.num_processes,
            "distributed": str(acc.distributed_type),
            "target_sharding": self.recipe.target_sharding,
        }
        if self.memory_estimate is not None:
            where["memory_estimate"] = dataclasses.asdict(self.memory_estimate) | {"total": self.memory_estimate.total}
            where["target_bytes_held"] = self.target_bytes_held  # by the main process
        summary = {**summary, **where}
        if self.is_main:
            write_json_atomic(self.out / "training_summary.json", summary)
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        if self.recipe.push_to_hub and self.is_main:
            from draftsmith.publish import push

            url = push(self.out, self.recipe.hub_repo_id, private=self.recipe.hub_private)
            self.print(f"pushed to {url}")
        return summary
