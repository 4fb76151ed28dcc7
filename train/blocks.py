"""The training loop of the block heads (`heads.blocks`) on a frozen target's own generations: each
method's trainer (train/<kind>.py) gives it its recipe, layout (`heads.block_formats.BlockLayout`)
and losses, and runs under `accelerate launch` as the others.

One forward per batch trains many blocks at once (arXiv 2602.06036):
- anchors: per row, up to `max_anchors` positions p sampled uniformly among the trained
  (loss-mask) tokens whose block p..p+B-1 fits in the row (a head drafting from its anchor's slot:
  the positions before trained tokens);
- each anchor's block is [token_p, mask, ..., mask] at positions p..p+B-1; every block of a row
  is packed after the row's T context columns in ONE forward with the anchor-block mask: a
  block sees the context columns s < p of its row (the target's features, `head.project`) and
  its own B slots (bidirectional), nothing else (`anchor_block_mask`);
- slot k >= 1 predicts the token at p + k; its target is the target's distribution for that
  token (the teacher logits at position p + k - 1, restricted to the draft vocabulary, positions
  whose target argmax falls outside it masked, `slot_targets`); the method's loss per slot is
  averaged with `draft_weights` (decay w_k = exp(-(k - 1) / decay_gamma): early slots matter most,
  a chain stops at its first miss; or D-PACE's), `weighted_slots`;
- online (the target runs in the loop, default) or offline (`hidden_cache`: a `cache-hidden`
  folder holding the aux layers and `last`); every `eval_every` steps, held-out per-slot top-1
  accuracy and the greedy tau along the decoder's walk of blocks anchored at every held-out
  position (`every_block`, `walk_tau`); checkpoints and `resume=true` as the others.
The result is `OUT/head/` (`layout.save`, without the target's tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftsmith.decoding.masks import additive
from draftsmith.distill.losses import dpace_weights
from draftsmith.heads.layers import layer_value
from draftsmith.train import common
from draftsmith.train.command_line import trainer_main
from draftsmith.train.loop import train_loop
from draftsmith.train.recipe import MaskedHeadRecipe, RecipeError
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import cleaned_up_on_error
from draftsmith.train.sharding import draft_vocab, layer_params, target_dims
from draftsmith.train.teacher import head_target_states, teacher_rows

LOSS_WEIGHTINGS = ("decay", "dpace")
#: The summary keys `main` prints, for every block head's trainer.
SHOWN = ("steps", "block_size", "mask_token_id", "train_tokens_per_second")


class BlockLosses(Protocol):
    """A method's losses over one packed forward of anchored blocks: (weighted loss, greedy hits
    [B, A, S], trained slots [B, A, S], weight sum), S the head's drafts per block. `feats`: the aux
    states concatenated [B, T, n*H]; `teacher`: the target's logits on the head's vocabulary [B, T, Vd]
    (or `teacher.TeacherStates`, projected at the slots' positions only) and `in_vocab` [B, T] (None:
    the whole vocabulary), as `teacher.aux_states_and_teacher` makes them; anchors/valid [B, A] from
    `sample_anchors` (on the batch's device)."""

    def __call__(self, head, batch, feats, teacher, anchors, valid, recipe, in_vocab) -> tuple: ...


@dataclass(kw_only=True)
class BlockRecipe(MaskedHeadRecipe):
    """RunRecipe's keys (target, data, out, lr, batch, schedule, cadence, ...), the masked heads'
    (mask token, aux layers, vocabulary, loss: soft CE by default) and the block heads'. aux_layers'
    default: one per draft layer, spread over 1..L-3."""

    num_layers: int = 1  # draft decoder layers (arXiv 2602.06036's released drafters use a few, e.g. 5 on Qwen3-8B)
    block_size: int = 8  # slots per block: one forward drafts block_size - 1 tokens (speculators' default)
    max_anchors: int = 64  # blocks trained per row and step (more: more signal per target forward)
    decay_gamma: float = 4.0  # slot k's weight exp(-(k-1)/gamma) (arXiv 2602.06036: gamma ~4 for 8-16 slots)
    loss_weighting: str = "decay"  # decay: exp(-(k-1)/gamma); dpace: D-PACE's survival weights (`draft_weights`)
    dpace_alpha: float = 0.5  # D-PACE's smoothing of each slot's probability (the paper's and speculators' 0.5)
    lr: float = 6e-4  # the released recipes' peak lr at 8B; tiny heads take ~1e-3
    grad_clip: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"num_layers = {self.num_layers} must be >= 1")
        if self.block_size < 2:
            raise ValueError(
                f"block_size = {self.block_size} must be >= 2 (slot 0 is the anchor, the rest are drafted)"
            )
        if self.max_anchors < 1:
            raise ValueError(f"max_anchors = {self.max_anchors} must be >= 1")
        if not self.decay_gamma > 0:
            raise ValueError(f"decay_gamma = {self.decay_gamma} must be > 0")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting = {self.loss_weighting!r}: expected one of {', '.join(LOSS_WEIGHTINGS)}")
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha = {self.dpace_alpha} must be in [0, 1]")


def head_parameters(recipe: BlockRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters of the head `train` builds for `target` (meta is fine; the
    memory estimate, train/sharding.py): `num_layers` decoder layers (with q/k norms), fc over the n
    aux states (n H x H), hidden_norm and the final norm; the embeddings are a frozen copy (V x H),
    and lm_head trains over a reduced draft vocabulary (Vd x H) or is the target's, frozen."""
    from draftsmith.heads.blocks import default_aux_layer_ids

    tc, H, V = target_dims(target)
    aux = len(recipe.aux_layers or default_aux_layer_ids(tc.num_hidden_layers, recipe.num_layers))
    hd = layer_value(tc, "head_dim") or H // tc.num_attention_heads
    layers = recipe.num_layers * (layer_params(tc, H) + 2 * hd)
    Vd = draft_vocab(recipe, V)
    trained, frozen = layers + aux * H * H + 2 * H, V * H
    return (trained + Vd * H, frozen) if Vd < V else (trained, frozen + V * H)


# ---------------------------------------------------------------------- anchored blocks
def sample_anchors(loss_mask, attention_mask, block_size: int, max_anchors: int, generator=None):
    """(anchors [B, A] long, valid [B, A] bool): per row, up to `max_anchors` positions p drawn
    uniformly without replacement among the trained tokens with p + block_size <= row length,
    sorted; rows with fewer candidates are padded with invalid anchors (position 0)."""
    loss_mask, attention_mask = loss_mask.cpu().bool(), attention_mask.cpu().bool()
    B, T = loss_mask.shape
    lengths = attention_mask.sum(1)
    cols = torch.arange(T)[None]
    ok = loss_mask & attention_mask & (cols + block_size <= lengths[:, None])
    picks = []
    for b in range(B):
        candidates = ok[b].nonzero().flatten()
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:max_anchors]]
        picks.append(chosen.sort().values)
    A = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, : p.numel()], valid[b, : p.numel()] = p, True
    return anchors, valid


def anchor_chunks(loss_mask, attention_mask, chunk: int):
    """(starts [B, T] bool, then (anchors [B, A], valid [B, A]) per chunk of <= `chunk` positions):
    an anchor at every position p whose block's first draft (the token at p + 1) is trained, as
    the decoder calls there (the last prompt token included), in chunks that bound one forward."""
    B, T = loss_mask.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    starts[:, :-1] = loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    chunks = []
    for lo in range(0, T, chunk):
        width = min(chunk, T - lo)
        if starts[:, lo : lo + width].any():
            anchors = torch.arange(lo, lo + width, device=loss_mask.device)[None].expand(B, width)
            chunks.append((anchors, starts[:, lo : lo + width]))
    return starts, chunks


def anchor_block_mask(anchors, attention_mask, block_size: int) -> torch.Tensor:
    """Bool [B, A*Bs, T + A*Bs]: slot (a, k) of row b sees the row's real context columns
    s < anchors[b, a] and the Bs slots of its own block; no other block, nothing at or after
    its anchor (the block's own slots stand for those positions)."""
    B, A = anchors.shape
    T = attention_mask.shape[1]
    slot_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    before = torch.arange(T, device=anchors.device)[None, None] < slot_anchor[..., None]
    context = before & attention_mask.bool()[:, None]
    block = torch.arange(A, device=anchors.device).repeat_interleave(block_size)
    own = (block[:, None] == block[None, :])[None].expand(B, -1, -1)
    return torch.cat([context, own], dim=-1)


def block_inputs(input_ids, anchors, block_size: int, mask_token_id: int):
    """(block ids [B, A*Bs]: the anchor's token then mask tokens; slot positions [B, A*Bs])."""
    B, A = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    positions = (anchors[..., None] + offsets).reshape(B, A * block_size)
    ids = torch.full((B, A, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids.reshape(B, A * block_size), positions


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[Bs]: 0 for the anchor slot, exp(-(k - 1) / gamma) for slot k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def draft_weights(recipe: BlockRecipe, law, targets, label, best=None) -> torch.Tensor:
    """[B, A, S] loss weights of the S drafting slots of each block (targets [B, A, S, Vd], label
    [B, A, S]; `law`: the slots' drafting law, logits [B, A, S, Vd] or a walk among candidates, see
    `weighted_slots`), detached: `decay`, exp(-j/gamma) for the j-th draft; `dpace`, D-PACE's
    (`dpace_weights`) from each draft's hard cross-entropy on the target's argmax, the token a
    greedy chain must match. Losses divide by the weights' sum (a weighted mean, so the loss keeps
    its scale whatever the weighting; speculators divides by the count of trained slots instead).
    `best`: targets.argmax(-1), when the caller has it."""
    if recipe.loss_weighting == "dpace":
        best = targets.argmax(-1) if best is None else best
        return dpace_weights(_hard_cross_entropy(law, best), label, recipe.dpace_alpha)
    S = label.shape[-1]
    return slot_weights(S + 1, recipe.decay_gamma, label.device)[1:] * label


def _hard_cross_entropy(law, tokens) -> torch.Tensor:
    """-log q(tokens) [B, A, S] under a drafting law (`weighted_slots`), detached; +inf where a walk's
    candidates lack the token."""
    if isinstance(law, tuple):
        candidates, scores = law
        log_q = torch.log_softmax(scores.detach().float(), -1)
        return -torch.where(candidates == tokens[..., None], log_q, float("-inf")).amax(-1)
    return -torch.log_softmax(law.detach().float(), -1).gather(-1, tokens[..., None])[..., 0]


def _greedy_drafts(law) -> torch.Tensor:
    """The token [B, A, S] a greedy chain drafts at each slot under a drafting law (`weighted_slots`)."""
    if isinstance(law, tuple):
        candidates, scores = law
        return candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return law.argmax(-1)


def block_hidden(head, batch, feats, anchors, block_size: int):
    """(final-norm states [B, A*Bs, H] of every anchored block, packed in one forward; the slots'
    positions [B, A*Bs]): block [anchor, mask, ...] at p..p+Bs-1 sees the context strictly before p
    (`anchor_block_mask`) and its own slots."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    (B, T), Bs = ids.shape, block_size
    block_ids, slot_pos = block_inputs(ids, anchors, Bs, head.config.mask_token_id)  # [B, A*Bs] each
    positions = torch.cat([torch.arange(T, device=ids.device)[None].expand(B, T), slot_pos], dim=1)
    mask = additive(anchor_block_mask(anchors, attention, Bs), head.dtype)[:, None]  # [B, 1, Q, S]
    return head.hidden(
        block_ids, head.project(feats.to(head.dtype)), positions=positions, attention_mask=mask
    ), slot_pos


def slot_targets(batch, slot_pos, anchors, valid, teacher, in_vocab, block_size: int):
    """Of the drafting slots k >= 1 (slot 0 is the anchor): (where the target predicts each, p + k - 1
    [B, A, Bs-1]; which are trained [B, A, Bs-1]; the teacher there [B, A, Bs-1, Vd])."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    (B, T), A, Bs = ids.shape, anchors.shape[1], block_size
    target_at = (slot_pos.view(B, A, Bs)[:, :, 1:] - 1).clamp(max=T - 1)  # the target predicts p + k at p + k - 1
    label = loss_mask.gather(1, (target_at + 1).clamp(max=T - 1).flatten(1)).view_as(target_at) & valid[..., None]
    label = label & (target_at + 1 < T)  # a block running past the batch's columns drafts nothing there
    targets = teacher_rows(teacher, target_at.flatten(1)).view(B, A, Bs - 1, -1)  # [B, A, Bs-1, Vd]
    if in_vocab is not None:  # the target's distribution on the draft vocabulary; out-of-vocabulary argmax: masked
        label = label & in_vocab.gather(1, target_at.flatten(1)).view_as(target_at)
    return target_at, label, targets


def weighted_slots(recipe: BlockRecipe, per_slot, law, targets, label, best=None):
    """(the loss: `per_slot` [B, A, S] averaged by `draft_weights`, greedy hits [B, A, S], the weight
    sum) of a block head's drafting slots. `law`: how the head drafts each slot, its logits
    [B, A, S, V], or (candidates, scores) [B, A, S, K] each for a walk among K candidates (a selector's),
    which never builds the vocabulary-wide law. `best`: targets.argmax(-1), when the caller has it."""
    best = targets.argmax(-1) if best is None else best
    weights = draft_weights(recipe, law, targets, label, best)
    weight_sum = weights.sum()
    loss = (per_slot * weights).sum() / weight_sum.clamp(min=1e-6)
    with torch.no_grad():
        hits = (_greedy_drafts(law) == best) & label
    return loss, hits, weight_sum


@torch.no_grad()
def every_block(head, batch, feats, teacher, recipe: BlockRecipe, in_vocab, losses: BlockLosses):
    """(chains [B, T, S] bool, starts [B, T], hits [S], trained [S]) of held-out rows, S the head's
    drafts per block: the greedy hits of the block anchored at each position (`anchor_chunks`,
    `max_anchors` per forward; slots past a row's trained tokens are misses), where the decoder
    can call, and the per-slot hit and trained counts. `losses`: the method's (`BlockLosses`)."""
    S = head.config.drafts_per_block
    starts, chunks = anchor_chunks(batch["loss_mask"], batch["attention_mask"], recipe.max_anchors)
    chains = torch.zeros(*starts.shape, S, dtype=torch.bool)
    hit_sums = torch.zeros(S, dtype=torch.float64)
    count_sums = torch.zeros_like(hit_sums)
    for anchors, valid in chunks:
        _, hits, label, _ = losses(head, batch, feats, teacher, anchors, valid, recipe, in_vocab)
        hit_sums += hits.sum((0, 1)).double().cpu()
        count_sums += label.sum((0, 1)).double().cpu()
        chains[:, anchors[0].cpu()] = hits.cpu()
    return chains, starts.cpu(), hit_sums, count_sums


class BlockObjective(torch.nn.Module):
    """The head and its loss behind one forward (DDP/DeepSpeed average what runs inside it)."""

    def __init__(self, head, recipe: BlockRecipe, losses: BlockLosses):
        super().__init__()
        self.head, self.recipe, self.losses = head, recipe, losses

    def forward(self, input_ids, attention_mask, loss_mask, feats, teacher, in_vocab, anchors, valid, step=None):
        # `step`: the optimizer step (from 0) of a training batch, for a loss whose terms are weighted
        # on a schedule over training; held-out batches (`every_block`) carry none
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "step": step}
        return self.losses(self.head, batch, feats, teacher, anchors, valid, self.recipe, in_vocab)


def block_trainer(path: str, doc: str, recipe_class: type, layout, losses: BlockLosses, variant_keys=()):
    """A block method's entry points (train/<kind>.py): `train(recipe, progress=True)`, `train_blocks`
    with its `layout`, `losses` and the recipe keys `variant_keys` its head config takes, which leaves
    `recipe.out` as it was when it fails; and `main(argv)`, the command line of `path` (`doc` its help)."""

    @cleaned_up_on_error
    def train(recipe, *, progress: bool = True) -> dict:
        return train_blocks(recipe, progress, layout, losses, variant_keys)

    def main(argv=None) -> int:
        return trainer_main(path, doc, recipe_class, train, argv, result="head", shown=SHOWN)

    return train, main


def train_blocks(recipe: BlockRecipe, progress: bool, layout, losses: BlockLosses, variant_keys=()):
    """The loop of every block head: `layout.head.for_target` (`heads.block_formats.BlockLayout`, with the recipe's block, mask token, vocabulary and its values of `variant_keys`, the
    head config's own keys), its `losses` (`BlockLosses`) over anchored blocks, held-out
    blocks at every position, `layout.save`, and the serve check as `layout.kind`."""
    variant = {key: getattr(recipe, key) for key in variant_keys}
    run = TrainingRun(recipe, layout.kind, progress)
    device = run.device
    # an anchor at a trained position t drafts t+1 onwards: position 1 is the first trained
    target, data, train_rows, heldout_rows = run.load_training(first=1)
    _, V, pad_id = common.target_sizes(target)

    vocab_map = common.draft_vocab_map(recipe, data, V)
    mask_id, mask_source = common.mask_token(recipe, data, V)
    try:
        mask = {"mask_token_id": mask_id, "mask_token_source": mask_source}
        block = {"block_size": recipe.block_size, "num_layers": recipe.num_layers}
        origin = common.head_origin(recipe, data, vocab_map)
        head = layout.head.for_target(target, **block, **mask, **origin, **variant).to(device)
    except layout.error as err:
        raise RecipeError(str(err)) from None
    run.print(head.describe())
    # offline (hidden_cache): the teacher projected at the slots' positions only (`teacher_rows`)
    target_states = head_target_states(run, target, data, head, vocab_map, lazy=True)

    model, head = common.prepare_head(run, BlockObjective(head, recipe, losses))
    run.start()
    rank = run.accelerator.process_index

    def anchors_for(batch, seed: int):
        gen = torch.Generator().manual_seed(seed)
        trained = batch["loss_mask"]
        if head.config.sample_from_anchor:  # the anchor's own slot drafts: anchors before trained tokens
            trained = torch.cat([trained[:, 1:], torch.zeros_like(trained[:, :1])], dim=1)
        anchors, valid = sample_anchors(trained, batch["attention_mask"], recipe.block_size, recipe.max_anchors, gen)
        return anchors.to(device), valid.to(device)

    def micro_step(step, micro):
        batch = run.batch(data, train_rows, step, micro, pad_id)
        feats, teacher, in_vocab = target_states(batch)
        anchors, valid = anchors_for(batch, hash((recipe.seed, step, micro, rank)) % 2**31)
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        loss, _, label, weight_sum = model(
            ids, attention, loss_mask, feats, teacher, in_vocab, anchors, valid, step=step
        )
        (share,) = run.token_shares([weight_sum])
        return loss * share, batch, {"trained_slots": label.sum().float()}

    @torch.no_grad()
    def evaluate():
        """Per-slot top-1 of held-out blocks anchored at every position the decoder could call at
        (`max_anchors` per forward) and their greedy tau along the decoder's walk: a block's chain
        ends at its first miss (context features are the target's, as in decoding)."""
        batches = common.heldout_batches(data, heldout_rows, recipe.batch_size, recipe.max_length, pad_id, device)

        def every(batch, feats, teacher, in_vocab):
            return every_block(head, batch, feats, teacher, recipe, in_vocab, losses)

        return common.one_pass_evaluation(batches, target_states, every, K, recipe, "slot", "blocks")

    K = head.config.drafts_per_block  # the held-out tau's
    done = train_loop(
        run, model, micro_step, evaluate=evaluate if heldout_rows else None, describe=common.describe_top1("slot")
    )
    return common.finish_head(
        run, done, model, head, layout.save, target, K, data, heldout_rows, vocab_map, **block, **mask
    )
