"""Train Domino block drafters on a frozen target's own generations (docs/domino.md).

    accelerate launch train/domino.py --recipe recipes/smollm2/domino.yaml
    accelerate launch train/domino.py --recipe recipes/smollm2/domino.yaml gru_hidden=512 lambda_decay_fraction=0.25
    python train/domino.py --recipe recipes/smollm2/domino.yaml          # one process, same loop

The block heads' loop (`train.blocks.train_blocks`: anchored blocks packed in one forward, held-out blocks
at every position, the serve check) with Domino's head and loss (Domino, arXiv 2605.29707):
- slots as the backbone's: the block anchored at p drafts slots 1..B-1, slot k the token at p + k, its
  target the target's distribution there (the teacher logits at p + k - 1);
- the GRU correction is trained teacher-forced: slot k's GRU state has read the data's tokens at
  p..p+k-1 (the anchor, then the block's own tokens), which for greedy self-distillation data are
  the drafts a correct chain has made;
- loss per slot: (1 - lambda) D(final_k) + lambda D(base_k), D the recipe's `loss` (soft CE by
  default) against the target's distribution, final = base + correction; lambda falls
  linearly from 1 at step 0 to 0 at `lambda_decay_fraction` of `max_steps` and stays 0 (SpecForge's
  `linear_lambda_base`): the backbone learns to draft alone first, then the correction takes over.
  Slots are weighted exp(-(k-1)/gamma) (or by D-PACE's weights, `loss_weighting: dpace`), a
  weighted mean (`train.blocks.weighted_slots`).
The result is `OUT/head/` (`save_domino`), for `draftsmith eval --drafter domino=DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from draftsmith.distill.losses import divergence
from draftsmith.heads.domino_formats import DOMINO
from draftsmith.train.blocks import BlockRecipe, block_hidden, block_trainer, slot_targets, weighted_slots
from draftsmith.train.blocks import head_parameters as backbone_parameters
from draftsmith.train.draft_opd import block_replay, block_states, block_tokens
from draftsmith.train.sharding import draft_vocab, target_dims

VARIANT = ("gru_hidden", "proj_dim")  # the recipe keys the head's config takes


@dataclass(kw_only=True)
class DominoRecipe(BlockRecipe):
    """BlockRecipe's keys (block, anchors, decay or D-PACE weights, vocabulary, loss, ...) and Domino's."""

    gru_hidden: int = 1024  # the GRU's state width (the paper's and SpecForge's 1024)
    proj_dim: int = 256  # the correction MLP's bottleneck, Linear(H + gru_hidden -> proj_dim) (SpecForge's emb_dim)
    lambda_decay_fraction: float = 0.5  # the base loss's weight falls 1 -> 0 over this share of max_steps
    # (SpecForge's lambda_base_decay_ratio default 0.5; its Qwen3-8B example sets 1.0)

    def __post_init__(self):
        super().__post_init__()
        for name in ("gru_hidden", "proj_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if not 0 <= self.lambda_decay_fraction <= 1:
            raise ValueError(
                f"lambda_decay_fraction = {self.lambda_decay_fraction} must be in [0, 1] "
                "(0: no base-loss phase; 1: the weight reaches 0 at max_steps)"
            )


def base_loss_weight(recipe: DominoRecipe, step: int | None) -> float:
    """lambda of optimizer step `step` (from 0): 1 - step / (lambda_decay_fraction * max_steps),
    clamped to [0, 1]; 0 when the fraction is 0 or there is no step (held-out batches: the
    evaluation scores the final logits only)."""
    horizon = recipe.lambda_decay_fraction * recipe.max_steps
    if step is None or horizon <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - step / horizon))


def head_parameters(recipe: DominoRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters: the backbone's (`train.blocks.head_parameters`), then the
    bias-free GRU (input and hidden weights of its 3 gates: 3 G (H + G)) and the correction MLP
    ((H + G) P + P Vd), every one trained."""
    trained, frozen = backbone_parameters(recipe, target)
    _, H, V = target_dims(target)
    G, P, Vd = recipe.gru_hidden, recipe.proj_dim, draft_vocab(recipe, V)
    return trained + 3 * G * (H + G) + (H + G) * P + P * Vd, frozen


def domino_losses(head, batch, feats, teacher, anchors, valid, recipe: DominoRecipe, in_vocab):
    """(weighted loss, per-slot hits [B, A, Bs-1], per-slot trained mask [B, A, Bs-1], weight sum) of
    one packed forward (`train.blocks.BlockLosses`): slot k of the block anchored at p drafts
    the token at p + k, corrected by the GRU over the data's tokens at p..p+k-1; hits are the final
    logits'. `batch["step"]` (the training step, None held out) sets the base loss's weight."""
    ids, Bs = batch["input_ids"], recipe.block_size
    (B, T), A = ids.shape, anchors.shape[1]
    h, slot_pos = block_hidden(head, batch, feats, anchors, Bs)  # [B, A*Bs, H], [B, A*Bs]
    tokens = ids.gather(1, slot_pos.clamp(max=T - 1))  # [B, A*Bs]: the data's tokens at p..p+Bs-1
    base, final = head.block_logits(h.view(B * A, Bs, -1), tokens.view(B * A, Bs))  # [B*A, Bs-1, Vd] each
    base, final = base.view(B, A, Bs - 1, -1), final.view(B, A, Bs - 1, -1)  # slot k >= 1: the token at p + k
    _, label, targets = slot_targets(batch, slot_pos, anchors, valid, teacher, in_vocab, Bs)  # [B, A, Bs-1(, Vd)]
    weight = base_loss_weight(recipe, batch.get("step"))
    per_slot = (1 - weight) * divergence(recipe.loss, final, targets, label, reduction="none")  # [B, A, Bs-1]
    if weight:  # no backbone term (and no second divergence) once lambda has reached 0
        per_slot = per_slot + weight * divergence(recipe.loss, base, targets, label, reduction="none")
    loss, hits, weight_sum = weighted_slots(recipe, per_slot, final, targets, label)
    return loss, hits, label, weight_sum


def _replayed_law(head, batch, kept, anchors, drafts):
    """Slot k >= 1's final logits, the GRU having read the tokens at p..p+k-1."""
    h, Bs = block_states(head, kept, anchors), head.config.block_size
    tokens = block_tokens(batch, anchors, Bs)
    _, final = head.block_logits(h.flatten(0, 1), tokens.flatten(0, 1))
    return final.view(*anchors.shape, Bs - 1, -1)


#: On-policy post-training (train/onpolicy.py) replays a head's calls at its blocks' anchors.
REPLAY = block_replay(domino_losses, _replayed_law, "draftsmith.heads.domino_formats:save_domino")


train, main = block_trainer("train/domino.py", __doc__, DominoRecipe, DOMINO, domino_losses, VARIANT)


if __name__ == "__main__":
    sys.exit(main())
