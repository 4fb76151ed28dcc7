"""Train DSpark block drafters on a frozen target's own generations (docs/dspark.md).

    accelerate launch train/dspark.py --recipe recipes/smollm2/dspark.yaml
    accelerate launch train/dspark.py --recipe recipes/smollm2/dspark.yaml markov_head_type=rnn loss_weighting=dpace
    python train/dspark.py --recipe recipes/smollm2/dspark.yaml          # one process, same loop

The block heads' loop (`train.blocks.train_blocks`: anchored blocks packed in one forward, held-out blocks
at every position, the serve check) with DSpark's head and loss (DSpark, arXiv 2607.05147):
- slots: the block anchored at p drafts every slot, slot k the token at p + k + 1 (anchors are the
  positions before trained tokens); the teacher is the target's distribution there;
- the sequential correction is trained teacher-forced: slot k's bias reads the data's token at
  p + k (the anchor for slot 0), which for greedy self-distillation data is the draft a correct
  chain has made;
- loss per slot: `ce_weight` CE(the data's token) + `divergence_weight` x `loss` (default tv:
  DeepSpec's 0.9 L1 = 1.8 TV) + `confidence_weight` BCE(c_k, 1 - TV(q_k, p_k) detached), weighted by
  exp(-k / gamma) over the block's drafts (or D-PACE's, `loss_weighting: dpace`), a weighted mean.
The result is `OUT/head/` (`save_dspark`), for `draftsmith eval --drafter dspark=DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.distill.losses import divergence
from draftsmith.heads.dspark_formats import DSPARK
from draftsmith.train.blocks import BlockRecipe, block_hidden, block_trainer, weighted_slots
from draftsmith.train.blocks import head_parameters as backbone_parameters
from draftsmith.train.draft_opd import block_replay, block_states, block_tokens
from draftsmith.train.sharding import draft_vocab, target_dims
from draftsmith.train.teacher import teacher_rows

VARIANT = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "markov_embedding",
)


@dataclass(kw_only=True)
class DSparkRecipe(BlockRecipe):
    """BlockRecipe's keys (block, anchors, decay or D-PACE weights, vocabulary, ...) and DSpark's."""

    block_size: int = 7  # slots per block, every one drafting (DeepSpec's Qwen3-4B recipe: 7)
    markov_rank: int = 256  # rank r of the Markov bias W2 W1[x] (0: none, the bare backbone drafting from its anchor)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (heads/dspark.py)
    enable_confidence_head: bool = True  # c_k predicts each draft's acceptance (dynamic draft length)
    confidence_head_with_markov: bool = True  # c_k reads [h_k; W1[x_{k-1}]], else h_k
    markov_embedding: str = "table"  # W1: table (a free [V, r]) | target (E P: the target's embeddings, P trained)
    loss: str = "tv"  # the distribution term: DeepSpec's L1(p_d, p_t) = 2 TV
    divergence_weight: float = 1.8  # 0.9 L1 = 1.8 TV
    ce_weight: float = 0.1  # CE on the data's token
    confidence_weight: float = 1.0  # BCE of the confidence head
    lr: float = 6e-4  # DeepSpec's; tiny heads take ~1e-3

    def __post_init__(self):
        super().__post_init__()
        from draftsmith.heads.dspark import MARKOV_EMBEDDINGS, MARKOV_HEADS

        if self.markov_rank < 0:
            raise ValueError(f"markov_rank = {self.markov_rank} must be >= 0 (0: no sequential head)")
        if self.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"markov_head_type = {self.markov_head_type!r}: expected one of {', '.join(MARKOV_HEADS)}")
        if self.markov_embedding not in MARKOV_EMBEDDINGS:
            raise ValueError(
                f"markov_embedding = {self.markov_embedding!r}: expected one of {', '.join(MARKOV_EMBEDDINGS)}"
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0 (or set it false)")
        for name in ("divergence_weight", "ce_weight", "confidence_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 0")


def head_parameters(recipe: DSparkRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters: the backbone's (`train.blocks.head_parameters`), then the
    Markov head (W1 [V, r] or its P [H, r], W2 [r, Vd], gated: G [H + r -> r], rnn: J [2r + H -> 3r]) and the
    confidence head ([H (+ r) -> 1])."""
    trained, frozen = backbone_parameters(recipe, target)
    _, H, V = target_dims(target)
    r, Vd = recipe.markov_rank, draft_vocab(recipe, V)
    if r:
        trained += (V if recipe.markov_embedding == "table" else H) * r + r * Vd
        trained += {"gated": (H + r) * r + r, "rnn": (2 * r + H) * 3 * r + 3 * r}.get(recipe.markov_head_type, 0)
    if recipe.enable_confidence_head:
        trained += H + (r if recipe.confidence_head_with_markov else 0) + 1
    return trained, frozen


def _draft_ids(head, token_ids: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (-1 outside a reduced draft vocabulary)."""
    if not head.config.reduced_vocab:
        return token_ids
    table = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    draft = torch.arange(head.config.draft_vocab_size, device=token_ids.device)
    table[head.draft_to_target(draft)] = draft
    return table[token_ids]


def dspark_losses(head, batch, feats, teacher, anchors, valid, recipe: DSparkRecipe, in_vocab):
    """(weighted loss, per-slot hits [B, A, Bs], per-slot trained mask [B, A, Bs], weight sum) of one
    packed forward (`train.blocks.BlockLosses`): slot k of the block anchored at p drafts
    the token at p + k + 1, corrected by the bias of the data's token at p + k."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    Bs, (B, T), A = recipe.block_size, ids.shape, anchors.shape[1]
    h, slot_pos = block_hidden(head, batch, feats, anchors, Bs)  # [B, A*Bs, H], [B, A*Bs]
    at = slot_pos.view(B, A, Bs).clamp(max=T - 1)  # slot k at p + k: the target predicts p + k + 1 there
    after = (at + 1).clamp(max=T - 1)
    label = loss_mask.gather(1, after.flatten(1)).view_as(at) & valid[..., None]
    label = label & (slot_pos.view(B, A, Bs) + 1 < T)  # a block running past the batch's columns drafts nothing there
    if in_vocab is not None:  # the target's distribution on the draft vocabulary; out-of-vocabulary argmax: masked
        label = label & in_vocab.gather(1, at.flatten(1)).view_as(at)
    data = _draft_ids(head, ids.gather(1, after.flatten(1)).view_as(at))  # the data's token, as a draft id
    label = label & (data >= 0)
    prev = ids.gather(1, at.flatten(1))  # [B, A*Bs]: the anchor, then the block's own tokens
    hb = h.view(B * A, Bs, -1)
    logits = head.block_logits(hb, prev.view(B * A, Bs)).view(B, A, Bs, -1).float()
    targets = teacher_rows(teacher, at.flatten(1)).view(B, A, Bs, -1)

    term = divergence(recipe.loss, logits, targets, label, reduction="none")  # [B, A, Bs]
    ce = F.cross_entropy(logits.flatten(0, 2), data.clamp(min=0).flatten(), reduction="none").view_as(term)
    per_slot = recipe.divergence_weight * term + recipe.ce_weight * ce
    tv = term if recipe.loss == "tv" else divergence("tv", logits.detach(), targets, label, reduction="none")
    confidence = head.confidence(hb, prev.view(B * A, Bs))
    if confidence is not None and recipe.confidence_weight:
        accept = (1 - tv).detach().clamp(0, 1)  # the expected acceptance of slot k's q_k against p_k
        bce = F.binary_cross_entropy_with_logits(confidence.view_as(tv).float(), accept, reduction="none")
        per_slot = per_slot + recipe.confidence_weight * bce
    loss, hits, weight_sum = weighted_slots(recipe, per_slot, logits, targets, label)
    return loss, hits, label, weight_sum


def _replayed_law(head, batch, kept, anchors, drafts):
    """Every slot, corrected by the Markov bias of the token before it (`dspark_losses`' forcing)."""
    h, Bs = block_states(head, kept, anchors), head.config.block_size
    tokens = block_tokens(batch, anchors, Bs)  # slot k reads the token at p + k
    return head.block_logits(h.flatten(0, 1), tokens.flatten(0, 1)).view(*anchors.shape, Bs, -1)


#: On-policy post-training (train/onpolicy.py) replays a head's calls at its blocks' anchors.
REPLAY = block_replay(dspark_losses, _replayed_law, "draftsmith.heads.dspark_formats:save_dspark")


train, main = block_trainer("train/dspark.py", __doc__, DSparkRecipe, DSPARK, dspark_losses, VARIANT)


if __name__ == "__main__":
    sys.exit(main())
