"""FSDP2 (torch `fully_shard`) on CPU over gloo, for what every trainer trains.

accelerate's FSDP path needs CUDA, so tests/test_distributed.py runs the trainers under DDP and
DeepSpeed only. Here the module a trainer hands to `run.prepare` (MedusaObjective,
EagleObjective, the draft model) is built the trainer's way in two spawned processes, sharded
with `fully_shard` on its repeated blocks and on its root, and trained for 3 AdamW steps (the
trainer's clipping and schedule), each process on its half of a global batch of 4 rows with the
loss weighted by `TrainingRun.token_shares`. One unsharded process training the whole batch must
log the same loss and gradient norm at every step and end with the same weights: gradients that
are not averaged, or averaged without the token shares, drift apart from the first step on. The
gradient norm is compared too because Adam and clipping hide a gradient that is off by a constant
factor (summed instead of averaged): the losses and weights alone would not see it.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lifecycle_helpers import METHODS, free_port, recipe_values

from draftsmith.distill.data import DistillData
from draftsmith.train.common import batch_rows, collate_rows, split_rows, warmup_cosine
from draftsmith.train.run import TrainingRun

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH, WORLD = 3, 4, 2
RECIPES = {"medusa": "MedusaRecipe", "eagle": "EagleRecipe", "draft": "DraftRecipe"}
# Losses and gradient norms agree to float32 summation order (measured rel. diff. <= 1e-6).
# Adam's first steps move every weight by ~lr whatever the size of its gradient, so a weight
# whose gradient is close to zero turns the rounding difference of the sharded sum into an
# update difference: at the lifecycle recipe's EAGLE lr of 3e-3 one q_proj element in 4608
# differed by 2e-5. At the lr below the largest difference is 7e-7 (Medusa at 1e-2: 9e-7;
# draft at 1e-3: 3e-7), well inside the tolerance, while the weights move by >= 2.5e-3.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
LR = {"eagle": 1e-3}


# --------------------------------------------------------------------------- the trainers' pieces


def build(method: str, recipe, data):
    """(module the trainer prepares, its repeated blocks, loss(batch, shares) -> scalar, optimizer
    kwargs), built as train/<method>.py builds them. `shares(counts)` is the trainer's
    `run.token_shares`."""
    from draftsmith.heads.models import load_causal_lm, load_tokenizer

    cpu = torch.device("cpu")
    torch.manual_seed(recipe.seed)  # the trainers' set_seed: both runs start from the same weights
    target = load_causal_lm(recipe.target, device=cpu, dtype=torch.float32, role="target")
    target.requires_grad_(False)

    if method == "medusa":
        from draftsmith.heads.medusa import MedusaHeads
        from draftsmith.train.medusa import MedusaObjective, head_targets

        heads = MedusaHeads.for_target(
            target, recipe.num_heads, recipe.num_layers, recipe.share_lm_head, data_hash=data.data_hash
        )
        module = MedusaObjective(heads, None, recipe)
        blocks = [block for head in heads.blocks for block in head]

        def loss_fn(batch, shares):
            with torch.no_grad():
                out = target(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
                )
            hidden, teacher = out.hidden_states[-1].float(), (None if recipe.loss == "ce" else out.logits.float())
            counts = [head_targets(batch, k)[1].sum() for k in range(recipe.num_heads)]
            counts.append((batch["loss_mask"][:, 1:] & batch["attention_mask"][:, :-1].bool()).sum())
            lam = 0.0  # Medusa-2's weight of the head losses; Medusa-1 has no L_base
            loss, _, _ = module(
                batch["input_ids"], batch["attention_mask"], batch["loss_mask"], hidden, teacher, lam, shares(counts)
            )
            return loss

        return module, blocks, loss_fn, {}

    if method == "eagle":
        from draftsmith.distill.vocab import build_vocab_map
        from draftsmith.heads.eagle import EagleHead
        from draftsmith.train.eagle import EagleObjective
        from draftsmith.train.teacher import on_draft_vocab

        vocab_map = build_vocab_map(data.token_counts(), recipe.draft_vocab_size, data.data_hash)
        head = EagleHead.for_target(
            target, recipe.version, aux_layer_ids=recipe.aux_layers, vocab_map=vocab_map, data_hash=data.data_hash
        )
        aux = tuple(head.config.aux_layer_ids)
        vocab = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
        module = EagleObjective(head, recipe)

        def loss_fn(batch, shares):
            with torch.no_grad():
                o = target(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
                )
            feats = torch.cat([o.hidden_states[i] for i in aux], dim=-1).float()
            teacher, in_vocab = on_draft_vocab(o.logits, vocab, head.t2d)  # [B, T, Vd], [B, T]
            per_step, _, counts = module(
                batch["input_ids"],
                batch["attention_mask"],
                batch["loss_mask"],
                feats,
                teacher,
                in_vocab,
                recipe.ttt_steps,
            )
            per_step = [l * share for l, share in zip(per_step, shares([c.sum() for c in counts]))]
            return sum(recipe.ttt_decay**j * l for j, l in enumerate(per_step))

        # The decoder layer runs ttt_steps times in one forward: FSDP2 gathers it for every call.
        return module, list(head.layers), loss_fn, {"betas": (0.9, 0.95)}

    from draftsmith.train.draft import build_draft, draft_loss, trained_rows

    module = build_draft(recipe, target, load_tokenizer(recipe.target), cpu)

    def loss_fn(batch, shares):
        kept = trained_rows(batch)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))[kept]
        with torch.no_grad():
            teacher = None if recipe.loss == "ce" else target(**inputs).logits[kept]
        student = module(**inputs).logits[kept]
        return draft_loss(recipe, student, labels=labels, teacher=teacher) * shares([kept.sum()])[0]

    return module, list(module.model.layers), loss_fn, {}


class Processes:
    """The two things `TrainingRun.token_shares` and `TrainingRun.mean` ask of the accelerator,
    over torch.distributed's own process group (no Accelerator: its FSDP path needs CUDA)."""

    def __init__(self, world: int):
        self.num_processes = world

    def reduce(self, t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        if self.num_processes > 1:
            dist.all_reduce(t)
        return t / self.num_processes if reduction == "mean" else t


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every process (a collective: every rank calls it); plain
    tensors as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train(method: str, values: dict, rank: int = 0, world: int = 1) -> dict:
    """STEPS optimizer steps of the trainer's module on this process's share of the global batch;
    with world > 1 the module is sharded with FSDP2 first. -> logged losses and grad norms (the
    means over processes), the full final weights and how much of them this process held."""
    from torch.distributed.fsdp import fully_shard

    recipe = getattr(importlib.import_module(f"draftsmith.train.{method}"), RECIPES[method])(**values)
    data = DistillData(recipe.data)
    module, blocks, loss_fn, optimizer_kwargs = build(method, recipe, data)
    initial = {name: p.detach().clone() for name, p in module.named_parameters()}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
    # Built after sharding: fully_shard swaps every parameter for a DTensor shard.
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay, **optimizer_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(recipe.warmup_steps, recipe.max_steps))
    run = SimpleNamespace(accelerator=Processes(world), device=torch.device("cpu"), out=Path(recipe.out), method=method)

    def shares(counts):  # the trainers' run.token_shares
        return TrainingRun.token_shares(run, counts)

    train_rows, _ = split_rows(len(data), recipe.heldout_fraction)
    losses, grad_norms = [], []
    module.train()
    for step in range(STEPS):
        rows = batch_rows(train_rows, step, 0, GLOBAL_BATCH // world, 1, recipe.seed, rank=rank, world=world)
        batch = collate_rows(data, rows, recipe.max_length, pad_id=0)
        loss = loss_fn(batch, shares)
        losses.append(TrainingRun.mean(run, loss))
        loss.backward()
        # The trainers clip at grad_clip (none when 0) and log the norm before clipping.
        norm = torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip or math.inf)
        grad_norms.append(float(full(norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    weights = {name: full(p.detach()).clone() for name, p in module.named_parameters()}
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
    sharded = all(hasattr(p, "to_local") for p in module.parameters())
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "initial": initial,
        "weights": weights,
        "local_numel": local,
        "all_sharded": sharded,
    }


def worker(rank: int, world: int, port: int, method: str, values: dict, result_path: str) -> None:
    torch.set_num_threads(1)  # two processes on a 2-core runner
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = train(method, values, rank, world)
        if rank == 0:
            torch.save(result, result_path)
        dist.barrier()  # no process closes its sockets while the other may still read from them
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize("method", METHODS)
def test_fsdp2_two_processes_train_what_one_process_trains(method, toy_dir, toy_data, tmp_path):
    values = recipe_values(method, toy_dir, toy_data, tmp_path / "run", **({"lr": LR[method]} if method in LR else {}))
    reference = train(method, values)

    result_path = tmp_path / "fsdp2.pt"
    torch.multiprocessing.spawn(
        worker, args=(WORLD, free_port(), method, values, str(result_path)), nprocs=WORLD, join=True
    )
    sharded = torch.load(result_path, weights_only=True)

    # FSDP2 shards every parameter on dim 0, rank 0 holding the first ceil(d0 / WORLD) rows.
    expected_local = sum(
        math.ceil(w.shape[0] / WORLD) * (w.numel() // w.shape[0]) for w in reference["weights"].values()
    )
    assert sharded["all_sharded"] and sharded["local_numel"] == expected_local, (
        f"rank 0 holds {sharded['local_numel']} parameters, a shard holds {expected_local}: the module is not sharded"
    )
    torch.testing.assert_close(
        sharded["initial"], reference["initial"], rtol=0, atol=0
    )  # rank 0 starts where one process starts
    torch.testing.assert_close(sharded["losses"], reference["losses"], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(sharded["grad_norms"], reference["grad_norms"], rtol=LOSS_RTOL, atol=0)
    assert sharded["weights"].keys() == reference["weights"].keys()
    worst = 0.0
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(
            sharded["weights"][name], weight, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )
        worst = max(worst, float((sharded["weights"][name] - weight).abs().max()))
    # The comparison means something only when training moved the weights far beyond the tolerance.
    moved = max(float((reference["weights"][n] - reference["initial"][n]).abs().max()) for n in reference["weights"])
    assert moved > 100 * WEIGHT_ATOL, f"3 steps moved no weight by more than {moved:.1e}"
    print(
        f"{method}: losses {[round(l, 5) for l in reference['losses']]}, largest update {moved:.2e}, largest difference {worst:.2e}"
    )
