"""Train P-EAGLE heads (parallel EAGLE, arXiv 2602.01469) on a frozen target's own generations.

    accelerate launch train/peagle.py --recipe recipes/smollm2/peagle.yaml
    accelerate launch train/peagle.py --recipe recipes/smollm2/peagle.yaml num_depths=4 max_steps=100
    python train/peagle.py --recipe recipes/smollm2/peagle.yaml          # one process, same loop

The head is EAGLE-3's (`draftsmith.heads.eagle.PEagleHead`): pair t = (token_{t+1}, f_t) at
position t predicts token t+2 (depth 0). Depth d >= 1 of the chain anchored at a is a placeholder
at position a + d (the mask token, the trained feature `mask_hidden`) predicting token a + d + 2,
so one forward drafts `num_depths` tokens when decoding. Training packs, per row, every pair
(depth 0) and a conditional-drop sample of the deeper placeholders into ONE forward (speculators'
COD sampling, `cod_sample`): depth d keeps a fraction max(down_sample_ratio^d,
down_sample_ratio_min) of the chains still alive at depth d - 1, drawn at random, so memory grows
with sum_d ratio^d instead of num_depths. A placeholder sees the pairs at or before its anchor and
its own chain's earlier depths (`chain_mask`). Every element's target is the target's
distribution for the token it predicts, restricted to the draft vocabulary (out-of-vocabulary
argmaxes masked); loss = `loss` (default soft CE; nla / lk_hybrid are the LK losses) averaged over
the trained elements of every depth alike, as speculators does. Embeddings train and are saved.
Held-out: per-depth top-1 over every chain (no dropping; `max_anchors` chains per forward) and
the chains' greedy tau along the decoder's walk (`walk_tau`).
The result is `OUT/head/` (`save_eagle`), for `draftsmith eval --peagle` and
`draftsmith export --format vllm` (speculators `peagle`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from draftsmith.decoding.masks import additive
from draftsmith.distill.losses import divergence
from draftsmith.train.command_line import trainer_main
from draftsmith.train.common import (
    describe_top1,
    draft_vocab_map,
    finish_head,
    head_origin,
    heldout_batches,
    mask_token,
    one_pass_evaluation,
    prepare_head,
    target_sizes,
)
from draftsmith.train.eagle import aux_layer_count, eagle3_parameters, head_options
from draftsmith.train.loop import train_loop
from draftsmith.train.recipe import MaskedHeadRecipe, RecipeError
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import cleaned_up_on_error
from draftsmith.train.sharding import target_dims
from draftsmith.train.teacher import head_target_states


@dataclass(kw_only=True)
class PEagleRecipe(MaskedHeadRecipe):
    """RunRecipe's keys (target, data, out, lr, batch, schedule, cadence, ...), the masked heads'
    (mask token, aux layers (default 2, L//2, L-3), vocabulary, loss, hidden cache) and P-EAGLE's
    (named and defaulted as speculators' trainer names them)."""

    num_depths: int = 8  # tokens one forward drafts (speculators: 8)
    down_sample_ratio: float = 0.7  # COD: depth d keeps ratio^d of the chains (speculators: 0.7)
    down_sample_ratio_min: float = 0.2  # COD: ... but never less than this fraction (speculators: 0.2)
    max_anchors: int | None = 512  # chains seeded per row (speculators: 512); null = every trained position
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: the head's output is post-norm
    qk_norm: bool = True  # per-head q/k RMSNorm before RoPE: speculators' peagle trainer's qwen3 layer has it
    lr: float = 1e-4  # as EAGLE-3 at 7B; small heads on small targets take 1e-3
    grad_clip: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.num_depths, bool) or not isinstance(self.num_depths, int) or self.num_depths < 1:
            raise ValueError(f"num_depths = {self.num_depths!r} must be an integer >= 1 (depth 0 is EAGLE-3's draft)")
        for name in ("down_sample_ratio", "down_sample_ratio_min"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} = {getattr(self, name)} must be in [0, 1] (a fraction of the chains kept)")
        if self.down_sample_ratio_min > self.down_sample_ratio:
            raise ValueError(
                f"down_sample_ratio_min = {self.down_sample_ratio_min} is above down_sample_ratio = "
                f"{self.down_sample_ratio}: the floor must not exceed the first depth's ratio"
            )
        if self.max_anchors is not None and self.max_anchors < 1:
            raise ValueError(f"max_anchors = {self.max_anchors} must be >= 1 (or null for every trained position)")


def head_parameters(recipe: PEagleRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters of the head `train` builds for `target` (meta is fine; the
    memory estimate, train/sharding.py): EAGLE-3's trained part (`eagle3_parameters`), plus the
    embeddings, which train here (V x H, nothing frozen), plus `mask_hidden`, the placeholders'
    feature in the concatenated aux states' space (n x H)."""
    tc, H, V = target_dims(target)
    return eagle3_parameters(recipe, target) + V * H + aux_layer_count(recipe, tc) * H, 0


# ---------------------------------------------------------------------- the packed chains
def cod_sample(
    trained: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None,
    generator=None,
    drop: bool = True,
    window: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor [N], depth [N]) of one row of n pairs; `trained [n]` marks the pairs whose target is
    trained. Depth 0: every pair (the context). The seeds are the trained positions (at most
    `max_anchors`, drawn at random); depth d draws int((seeds - d) * max(ratio^d, ratio_min))
    positions among the candidates (trained positions one past a depth d - 1 element), or keeps
    them all when fewer, or always with `drop=False` (held-out: every chain). An element at
    position p of depth d has anchor p - d. `window = (lo, hi)`: only the chains anchored in
    lo..hi-1 (their depth 1 is seeded at lo+1..hi), every pair still packed as their context."""
    trained = trained.cpu().bool()
    n = trained.shape[0]
    valid = trained.nonzero().flatten()
    seeds = valid if window is None else valid[(valid > window[0]) & (valid <= window[1])]
    if max_anchors is not None and seeds.numel() > max_anchors:
        seeds = seeds[torch.randperm(seeds.numel(), generator=generator)[:max_anchors]].sort().values
    anchors, depths = [torch.arange(n)], [torch.zeros(n, dtype=torch.long)]
    candidates = seeds[seeds >= 1]  # depth 1 at p is anchored at p - 1 >= 0
    for d in range(1, num_depths):
        size = int(max(0, seeds.numel() - d) * max(ratio**d, ratio_min))
        if candidates.numel() == 0 or (drop and size <= 0):
            break
        if drop and candidates.numel() > size:
            picked = candidates[torch.randperm(candidates.numel(), generator=generator)[:size]].sort().values
        else:
            picked = candidates
        anchors.append(picked - d)
        depths.append(torch.full_like(picked, d))
        following = picked + 1
        following = following[following < n]
        candidates = following[trained[following]]
    return torch.cat(anchors), torch.cat(depths)


def pack_chains(trained: torch.Tensor, recipe: PEagleRecipe, generator=None, drop: bool = True, window=None):
    """(anchor, depth, real) [B, N]: each row's `cod_sample`, padded to the longest (real False)."""
    rows = [
        cod_sample(
            trained[b],
            recipe.num_depths,
            recipe.down_sample_ratio,
            recipe.down_sample_ratio_min,
            recipe.max_anchors,
            generator,
            drop,
            window,
        )
        for b in range(trained.shape[0])
    ]
    N = max(a.numel() for a, _ in rows)
    anchor = torch.zeros(len(rows), N, dtype=torch.long)
    depth = torch.zeros_like(anchor)
    real = torch.zeros(len(rows), N, dtype=torch.bool)
    for b, (a, d) in enumerate(rows):
        anchor[b, : a.numel()], depth[b, : a.numel()], real[b, : a.numel()] = a, d, True
    return anchor, depth, real


def chain_mask(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """Bool [B, N, N]: element q sees the pairs (depth 0) anchored at or before its anchor that are
    real context (`context [B, n]`, the row's tokens) and the elements of its own chain up to its
    depth; a padding element sees itself only."""
    rows = torch.arange(anchor.shape[0], device=anchor.device)[:, None]
    key_is_context = (depth == 0) & real & context[rows, anchor]  # [B, N]
    earlier = anchor[:, None, :] <= anchor[:, :, None]
    same_chain = (anchor[:, None, :] == anchor[:, :, None]) & (depth[:, None, :] <= depth[:, :, None])
    allowed = ((key_is_context[:, None, :] & earlier) | (same_chain & real[:, None, :])) & real[:, :, None]
    return allowed | torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)[None]


def pair_targets(batch) -> torch.Tensor:
    """[B, T - 1] bool: pair t's target, the token t + 2, is trained (the last pair has none)."""
    trained = batch["loss_mask"][:, 2:].bool() & batch["attention_mask"][:, 2:].bool()
    return torch.cat([trained, torch.zeros(trained.shape[0], 1, dtype=torch.bool, device=trained.device)], dim=1)


def peagle_losses(
    head, batch, feats, teacher, recipe: PEagleRecipe, in_vocab, generator=None, drop: bool = True, window=None
):
    """(loss, hits [B, N], trained [B, N], anchor, depth) of one packed forward. `feats`: the aux
    states concatenated [B, T, n*H]; `teacher`: the target's logits on the head's vocabulary
    [B, T, Vd] and `in_vocab` [B, T] (None: the whole vocabulary), as `teacher.on_draft_vocab` makes
    them; `drop`, `window`: `cod_sample`'s."""
    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    B, T = ids.shape
    n = T - 1  # pairs t = 0..T-2 (token t+1 exists)
    trained = pair_targets(batch)  # [B, n]: pair t's target, the token t+2, the target's prediction at t+1
    anchor, depth, real = (x.to(ids.device) for x in pack_chains(trained, recipe, generator, drop, window))
    position = (anchor + depth).clamp(max=n - 1)  # the position each element sits at and predicts from
    rows = torch.arange(B, device=ids.device)[:, None]
    is_pair = depth == 0
    pair_ids = ids[:, 1:][rows, anchor]
    element_ids = torch.where(is_pair, pair_ids, torch.full_like(pair_ids, head.config.mask_token_id))
    pairs = head.project(feats[:, :-1].to(head.dtype))[rows, anchor]  # [B, N, H]
    hidden = torch.where(is_pair[..., None], pairs, head.mask_features(B, anchor.shape[1]).to(pairs.dtype))
    mask = chain_mask(anchor, depth, real, valid[:, 1:])  # pair t is real when token t+1 is
    allowed = additive(mask, head.dtype)[:, None]
    label = trained[rows, position] & real
    if in_vocab is not None:  # the draft vocabulary only; out-of-vocabulary argmaxes teach nothing: masked
        label = label & in_vocab[:, 1:][rows, position]
    # logits [L, Vd] of the L kept elements only: the lm_head is most of a step's cost
    _, logits = head(element_ids, hidden, position_ids=position, attention_mask=allowed, logits_at=label)
    # [L, Vd]: the target's distribution for token position + 2, read at the kept elements only
    targets = teacher[rows.expand_as(position)[label], position[label] + 1]
    loss = divergence(recipe.loss, logits, targets)  # fp32, the mean over the kept elements
    with torch.no_grad():
        hits = torch.zeros_like(label)  # [B, N]
        hits[label] = logits.argmax(-1) == targets.argmax(-1)
    return loss, hits, label, anchor, depth


@torch.no_grad()
def every_chain(head, batch, feats, teacher, recipe: PEagleRecipe, in_vocab):
    """(chains [B, n, K] bool, starts [B, n], hits [K], trained [K]) of held-out rows: the greedy
    hits of the chain anchored at each pair (nothing dropped; the chains of `max_anchors` anchors
    per forward, every pair as their context; depths past a row's trained tokens are misses),
    where the decoder can call (the pair's own draft is trained), and the per-depth counts."""
    K = recipe.num_depths
    starts = pair_targets(batch).cpu()
    B, n = starts.shape
    chunk = recipe.max_anchors or n
    chains = torch.zeros(B, n, K, dtype=torch.bool)
    hit_sums, count_sums = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for lo in range(0, n, chunk):
        if not starts[:, lo : lo + chunk].any():
            continue
        window = (lo, min(n, lo + chunk))
        out = peagle_losses(head, batch, feats, teacher, recipe, in_vocab, drop=False, window=window)
        _, hits, label, anchor, depth = (x.cpu() for x in out)
        mine = label & (anchor >= window[0]) & (anchor < window[1])  # each pair once over the chunks
        rows = torch.arange(B)[:, None].expand_as(anchor)
        chains[rows[mine], anchor[mine], depth[mine]] = hits[mine]
        for d in range(K):
            hit_sums[d] += float(hits[mine & (depth == d)].sum())
            count_sums[d] += float((mine & (depth == d)).sum())
    return chains, starts, hit_sums, count_sums


class PEagleObjective(torch.nn.Module):
    """The head and its packed loss behind one forward (DDP/DeepSpeed average what runs inside it)."""

    def __init__(self, head, recipe: PEagleRecipe):
        super().__init__()
        self.head, self.recipe = head, recipe

    def forward(self, input_ids, attention_mask, loss_mask, feats, teacher, in_vocab, generator):
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        return peagle_losses(self.head, batch, feats, teacher, self.recipe, in_vocab, generator)


@cleaned_up_on_error
def train(recipe: PEagleRecipe, *, progress: bool = True) -> dict:
    from draftsmith.heads.eagle import EagleError, PEagleHead, save_eagle

    run = TrainingRun(recipe, "peagle", progress)
    device = run.device
    target, data, train_rows, heldout_rows = run.load_training(first=2)  # pair 0 drafts token 2
    _, V, pad_id = target_sizes(target)
    vocab_map = draft_vocab_map(recipe, data, V)
    mask_id, mask_source = mask_token(recipe, data, V)
    try:
        mask = {"mask_token_id": mask_id, "mask_token_source": mask_source}
        origin = head_origin(recipe, data, vocab_map)
        options = head_options(recipe)
        head = PEagleHead.for_target(target, num_depths=recipe.num_depths, **mask, **options, **origin).to(device)
    except EagleError as err:
        raise RecipeError(str(err)) from None
    run.print(head.describe())
    target_states = head_target_states(run, target, data, head, vocab_map)  # offline: hidden_cache

    model, head = prepare_head(run, PEagleObjective(head, recipe))
    run.start()
    rank = run.accelerator.process_index

    def micro_step(step, micro):
        batch = run.batch(data, train_rows, step, micro, pad_id)
        feats, teacher, in_vocab = target_states(batch)
        generator = torch.Generator().manual_seed(hash((recipe.seed, step, micro, rank)) % 2**31)
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        loss, _, label, _, _ = model(ids, attention, loss_mask, feats, teacher, in_vocab, generator)
        (share,) = run.token_shares([label.sum()])
        return loss * share, batch, {"trained_elements": label.sum().float()}

    @torch.no_grad()
    def evaluate():
        """Per-depth top-1 over every held-out chain (nothing dropped; `max_anchors` anchors per
        forward) and the chains' greedy tau along the decoder's walk: a chain ends at its first
        miss, or where its row's trained tokens end."""
        batches = heldout_batches(data, heldout_rows, recipe.batch_size, recipe.max_length, pad_id, device)

        def every(batch, feats, teacher, in_vocab):
            return every_chain(head, batch, feats, teacher, recipe, in_vocab)

        return one_pass_evaluation(batches, target_states, every, recipe.num_depths, recipe, "depth", "chains")

    done = train_loop(
        run, model, micro_step, evaluate=evaluate if heldout_rows else None, describe=describe_top1("depth")
    )
    K = recipe.num_depths
    return finish_head(
        run, done, model, head, save_eagle, target, K, data, heldout_rows, vocab_map, num_depths=K, **mask
    )


def main(argv=None) -> int:
    shown = ("steps", "num_depths", "mask_token_id", "train_tokens_per_second")
    return trainer_main("train/peagle.py", __doc__, PEagleRecipe, train, argv, result="head", shown=shown)


if __name__ == "__main__":
    sys.exit(main())
