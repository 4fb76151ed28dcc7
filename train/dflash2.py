"""Train DFlash2 block drafters on a frozen target's own generations (docs/dflash2.md).

    accelerate launch train/dflash2.py --recipe recipes/smollm2/dflash2.yaml
    accelerate launch train/dflash2.py --recipe recipes/smollm2/dflash2.yaml selector_loss_alpha=0.5 selector_rank=128
    python train/dflash2.py --recipe recipes/smollm2/dflash2.yaml          # one process, same loop

The block heads' loop (`train.blocks.train_blocks`: anchored blocks packed in one forward, held-out blocks
at every position, the serve check) with DFlash2's head and loss (speculators 0.9.0's
`DFlash2DraftModel.forward` and `models/dflash2/metrics.py`):
- slots as the backbone's: the block anchored at p drafts slots 1..B-1, slot k the token at p + k, its
  target the target's distribution there (the teacher logits at p + k - 1);
- the unary term: D(U_k, p_k), D the recipe's `loss` (soft CE by default; speculators' default
  kl_div has the same gradient), on the backbone's logits U_k = lm_head(h_k) over the full vocabulary;
- the selector term: a K-way hard cross-entropy over slot k's training candidates, the top
  `selector_top_k` of U_k with the target's argmax t_k put in the last place when it is not among
  them (speculators' `selector_training_candidates`), scored s(c | x, h_k) = U_k(c) + <A[x] W h_k, B[c]>
  with x the data's token at p + k - 1 (teacher forcing: for greedy self-distillation data, the draft
  a correct chain has made);
- per slot: unary + `selector_loss_alpha` x selector, weighted exp(-(k-1)/gamma) (or by D-PACE's
  weights, `loss_weighting: dpace`, from the walk's law) and averaged by those weights (`weighted_slots`);
- hits (the held-out per-slot top-1 and the simulated tau) are the walk's: the selector's argmax over
  the unary top-K alone (no target put in), what the decoder drafts.
The result is `OUT/head/` (`save_dflash2`), for `draftsmith eval --drafter dflash2=DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.distill.losses import divergence
from draftsmith.heads.dflash2_formats import DFLASH2
from draftsmith.train.blocks import BlockRecipe, block_hidden, block_trainer, slot_targets, weighted_slots
from draftsmith.train.blocks import head_parameters as backbone_parameters
from draftsmith.train.draft_opd import block_replay, block_states, block_tokens
from draftsmith.train.sharding import target_dims

VARIANT = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # the head config's keys


@dataclass(kw_only=True)
class DFlash2Recipe(BlockRecipe):
    """BlockRecipe's keys (block, anchors, decay or D-PACE weights, loss, ...; the full vocabulary
    only) and DFlash2's."""

    conv_kernel_size: int = 2  # causal taps of each convolution (speculators' default)
    conv_group_size: int = 16  # channels per dynamic kernel coefficient; must divide the target's hidden size
    selector_rank: int = 256  # rank of the selector's codebooks A, B [V, rank] and W [H -> rank]
    selector_top_k: int = 16  # candidates per slot the walk chooses among
    selector_loss_alpha: float = 1.0  # weight of the selector's K-way CE beside the unary term (speculators')

    def __post_init__(self):
        super().__post_init__()
        for name in ("draft_vocab_size", "vocab_map"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} = {getattr(self, name)!r}: DFlash2 drafts over the target's full vocabulary "
                    "(its selector scores target ids; speculators' DFlash2 refuses a reduced vocabulary): remove it"
                )
        for name in VARIANT:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"conv_kernel_size = {self.conv_kernel_size} must be <= block_size = {self.block_size} "
                "(a convolution reads its own block's slots)"
            )
        if self.selector_loss_alpha < 0:
            raise ValueError(f"selector_loss_alpha = {self.selector_loss_alpha} must be >= 0")


def head_parameters(recipe: DFlash2Recipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters: the backbone's with the full vocabulary
    (`train.blocks.head_parameters`: the target's embeddings and lm_head frozen), then per draft layer
    two convolutions (base kernels 2 K H and the projection H x 2 K H/group each) and the selector
    (codebooks 2 V r, projection H r), every one trained."""
    trained, frozen = backbone_parameters(recipe, target)
    _, H, V = target_dims(target)
    K, r = recipe.conv_kernel_size, recipe.selector_rank
    conv = 2 * K * H + H * 2 * K * (H // recipe.conv_group_size)
    return trained + recipe.num_layers * 2 * conv + 2 * V * r + H * r, frozen


def training_candidates(candidates: torch.Tensor, wanted: torch.Tensor):
    """(candidates with the wanted id put in the last place where it is missing [..., K], its place
    [...], whether the unary top-K held it [...]): speculators' `selector_training_candidates`, so every
    slot has a K-way label without scoring the whole vocabulary. candidates [..., K], wanted [...]."""
    match = candidates == wanted[..., None]  # [..., K]
    inside = match.any(-1)
    where = torch.where(inside, match.long().argmax(-1), candidates.shape[-1] - 1)
    training = candidates.clone()
    training[..., -1] = torch.where(inside, candidates[..., -1], wanted)
    return training, where, inside


def dflash2_losses(head, batch, feats, teacher, anchors, valid, recipe: DFlash2Recipe, in_vocab):
    """(weighted loss, per-slot hits [B, A, Bs-1], per-slot trained mask [B, A, Bs-1], weight sum) of
    one packed forward (`train.blocks.BlockLosses`; `in_vocab` is None: the full vocabulary)."""
    ids, Bs = batch["input_ids"], recipe.block_size
    B, A = anchors.shape
    h, slot_pos = block_hidden(head, batch, feats, anchors, Bs)  # [B, A*Bs, H], [B, A*Bs]
    h = h.view(B, A, Bs, -1)[:, :, 1:]  # [B, A, Bs-1, H]: slot k >= 1 drafts the token at p + k
    unary = head.lm_head(h)  # [B, A, Bs-1, V] (the divergence casts the kept rows)
    target_at, label, targets = slot_targets(batch, slot_pos, anchors, valid, teacher, in_vocab, Bs)
    prev = ids.gather(1, target_at.flatten(1)).view_as(target_at)  # [B, A, Bs-1]: the data's token at p + k - 1

    serving = head.candidates(unary.detach())  # [B, A, Bs-1, K]: what the walk chooses among
    best = targets.argmax(-1)
    training, where, _ = training_candidates(serving, best)
    scores = head.edge_scores(unary, h, prev, training)  # [B, A, Bs-1, K] float32
    selector = F.cross_entropy(scores.flatten(0, -2), where.flatten(), reduction="none").view_as(where)
    per_slot = divergence(recipe.loss, unary, targets, label, reduction="none") + recipe.selector_loss_alpha * selector
    with torch.no_grad():  # the walk's law: the scores on the serving candidates
        walk = (serving, head.edge_scores(unary, h, prev, serving))
    loss, hits, weight_sum = weighted_slots(recipe, per_slot, walk, targets, label, best)
    return loss, hits, label, weight_sum


def _replayed_law(head, batch, kept, anchors, drafts):
    """The selector's walk law, its edge scores on the candidates (-inf elsewhere). The drafted token
    is put among the candidates where the current head's top-K lost it (`training_candidates`), so
    log q stays finite after a step has moved the head."""
    Bs = head.config.block_size
    h = block_states(head, kept, anchors)[:, :, 1:]  # [B, A, Bs-1, H]
    unary = head.lm_head(h).float()  # [B, A, Bs-1, V]
    prev = block_tokens(batch, anchors, Bs)[:, :, :-1]  # slot k's walk reads the token at p + k - 1
    wanted = F.pad(drafts, (0, Bs - 1 - drafts.shape[-1]))  # [B, A, Bs-1]
    candidates, _, _ = training_candidates(head.candidates(unary.detach()), wanted)
    scores = head.edge_scores(unary, h, prev, candidates).float()
    return torch.full_like(unary, float("-inf")).scatter(-1, candidates, scores)


#: On-policy post-training (train/onpolicy.py) replays a head's calls at its blocks' anchors.
REPLAY = block_replay(dflash2_losses, _replayed_law, "draftsmith.heads.dflash2_formats:save_dflash2")


train, main = block_trainer("train/dflash2.py", __doc__, DFlash2Recipe, DFLASH2, dflash2_losses, VARIANT)


if __name__ == "__main__":
    sys.exit(main())
