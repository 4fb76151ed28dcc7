"""Train DFlash block drafters on a frozen target's own generations.

    accelerate launch train/dflash.py --recipe recipes/smollm2/dflash.yaml
    accelerate launch train/dflash.py --recipe recipes/smollm2/dflash.yaml block_size=4 max_steps=100
    python train/dflash.py --recipe recipes/smollm2/dflash.yaml          # one process, same loop

The block heads' loop (`train.blocks.train_blocks`: anchored blocks packed in one forward, held-out
blocks at every position, the serve check) with DFlash's head and loss (DFlash, arXiv 2602.06036):
- slots: the block anchored at p drafts slots 1..B-1, slot k the token at p + k; slot 0 (the
  anchor) is not trained;
- loss per slot: the recipe's `loss` (soft cross-entropy by default) against the target's
  distribution for that token, weighted by w_k = exp(-(k - 1) / decay_gamma) (or D-PACE's,
  `loss_weighting: dpace`), averaged over the trained slots by those weights.
The result is `OUT/head/` (`save_dflash`, without the target's tensors), for
`draftsmith eval --drafter dflash=DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from draftsmith.distill.losses import divergence
from draftsmith.heads.dflash_formats import DFLASH
from draftsmith.train.blocks import BlockRecipe, block_hidden, block_trainer, slot_targets, weighted_slots
from draftsmith.train.blocks import head_parameters as backbone_parameters
from draftsmith.train.draft_opd import block_replay, block_states

#: (trainable, frozen) parameters of a DFlash head: the backbone's, nothing added (the memory estimate).
head_parameters = backbone_parameters


@dataclass(kw_only=True)
class DFlashRecipe(BlockRecipe):
    """BlockRecipe's keys (block, anchors, decay or D-PACE weights, vocabulary, ...); DFlash adds none."""


def dflash_losses(head, batch, feats, teacher, anchors, valid, recipe: DFlashRecipe, in_vocab):
    """(weighted loss, per-slot hits [B, A, Bs-1], per-slot trained mask [B, A, Bs-1], weight sum)
    of one packed forward (`train.blocks.BlockLosses`): each drafting slot's own logits against the
    target's distribution there."""
    h, slot_pos = block_hidden(head, batch, feats, anchors, recipe.block_size)  # [B, A*Bs, H], [B, A*Bs]
    B, A, Bs = *anchors.shape, recipe.block_size
    logits = head.lm_head(h.view(B, A, Bs, -1)[:, :, 1:])  # slot k >= 1 drafts the token at p + k
    _, label, targets = slot_targets(batch, slot_pos, anchors, valid, teacher, in_vocab, Bs)
    per_slot = divergence(recipe.loss, logits, targets, label, reduction="none")  # fp32 over the kept rows
    loss, hits, weight_sum = weighted_slots(recipe, per_slot, logits, targets, label)
    return loss, hits, label, weight_sum


def _replayed_law(head, batch, kept, anchors, drafts):
    """Slot k >= 1's logits, drawn independently of the other slots."""
    return head.lm_head(block_states(head, kept, anchors))[:, :, 1:]


#: On-policy post-training (train/onpolicy.py) replays a head's calls at its blocks' anchors.
REPLAY = block_replay(dflash_losses, _replayed_law, "draftsmith.heads.dflash_formats:save_dflash")


train, main = block_trainer("train/dflash.py", __doc__, DFlashRecipe, DFLASH, dflash_losses)


if __name__ == "__main__":
    sys.exit(main())
