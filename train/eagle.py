"""Train EAGLE-1 / EAGLE-3 heads on a frozen target's own generations.

    accelerate launch train/eagle.py --recipe recipes/smollm2/eagle3.yaml
    accelerate launch train/eagle.py --recipe recipes/smollm2/eagle3.yaml ttt_steps=1 max_steps=100
    python train/eagle.py --recipe recipes/smollm2/eagle3.yaml          # one process, same loop

At position t the head reads the embedding of token t+1 and the target's feature f_t and
predicts token t+2 (its output g_t is the next step's feature when drafting further):

- EAGLE-1 (`version: eagle1`): f_t is the target's last hidden state (after the final norm);
  loss = `feature_weight` * SmoothL1(g_t, f_{t+1}) + `ce_weight` * soft CE against the target's
  distribution for token t+2; uniform noise U(-feature_noise/2, +feature_noise/2) on the input
  features makes the head robust to its own errors.
- EAGLE-3 (`version: eagle3`): f_t = fc(concat of the target's hidden states at `aux_layers`,
  default (2, L//2, L-3)); training-time test: the head is unrolled `ttt_steps` times, step j
  feeding its own output of step j-1 as the feature (tokens stay the data's), attending to the
  step-0 keys of positions <= t and to its own earlier steps at t; loss = sum_j ttt_decay^j
  `loss` (default soft CE; nla / lk_hybrid are the LK losses) against the target's
  distribution restricted to the draft vocabulary (positions whose target argmax falls
  outside it are masked). The reduced draft vocabulary comes from
  the data's trained-token counts (`draft_vocab_size`) or a `vocab_map` file built from the
  same data (a map of other data is refused). EAGLE-3.1: `fc_norm=true norm_output=true`;
  `qk_norm=true`: Qwen3's per-head q/k norms (speculators' `--draft-arch qwen3`).
- online (the target runs in the loop, default) or offline (`hidden_cache`: a `cache-hidden`
  folder holding the aux layers and `last`); held-out per-step top-1 accuracy and simulated
  chain tau every `eval_every` steps; checkpoints and `resume=true` as for every trainer.
The result is `OUT/head/` (`EagleHead.save_pretrained`), for `draftsmith eval --eagle` and
`draftsmith export --format vllm|sglang|hf`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from draftsmith.distill.acceptance import simulated_tau
from draftsmith.distill.losses import DIVERGENCES, divergence, smooth_l1
from draftsmith.heads.layers import layer_value
from draftsmith.train.command_line import trainer_main
from draftsmith.train.common import (
    describe_top1,
    draft_vocab_map,
    finish_head,
    head_origin,
    heldout_batches,
    heldout_walks,
    prepare_head,
    target_sizes,
    walk_taus,
)
from draftsmith.train.draft_opd import Replay
from draftsmith.train.loop import train_loop
from draftsmith.train.recipe import RecipeError, RunRecipe
from draftsmith.train.run import TrainingRun
from draftsmith.train.run_folder import cleaned_up_on_error
from draftsmith.train.sharding import draft_vocab, layer_params, target_dims
from draftsmith.train.teacher import head_target_states


@dataclass(kw_only=True)
class EagleRecipe(RunRecipe):
    """RunRecipe's keys (target, data, out, lr, batch, schedule, cadence, ...) and EAGLE's."""

    version: str = "eagle3"  # eagle3 | eagle1
    aux_layers: list | None = None  # eagle3: HF hidden_states ids; default (2, L//2, L-3)
    draft_vocab_size: int | None = None  # eagle3: reduced vocabulary from the data (None = full)
    vocab_map: str | None = None  # eagle3: a `draftsmith vocab-map` file of this data instead
    fc_norm: bool = False  # eagle3 (EAGLE-3.1): an RMSNorm per aux layer before fc, each on its own scale
    norm_output: bool = False  # eagle3 (EAGLE-3.1): each TTT step reads norm(out), steadier over depths
    qk_norm: bool = False  # eagle3: per-head q/k RMSNorm before RoPE; off as speculators' eagle3 trainer (llama layer)
    loss: str = "soft_ce"  # divergence to the target per draft step: any of DIVERGENCES (LK: nla, lk_hybrid)
    ttt_steps: int = 7  # eagle3 training-time test unroll (EAGLE-3: 7)
    ttt_decay: float = 0.8  # weight of step j: decay^j
    eval_depth: int = 4  # held-out accuracy is measured this many draft steps deep (any ttt_steps)
    feature_weight: float = 1.0  # eagle1: SmoothL1 on the next feature (EAGLE-1: 1.0)
    ce_weight: float = 0.1  # eagle1: soft CE weight (EAGLE-1: 0.1)
    feature_noise: float = 0.2  # eagle1: width of the uniform noise on input features (EAGLE-1: 0.2)
    hidden_cache: str | None = None  # offline: a cache-hidden folder with the needed layers + last
    lr: float = 1e-4  # EAGLE used 3e-5 at 7B; small heads on small targets take 1e-3
    grad_clip: float = 0.5  # EAGLE clips at 0.5

    def __post_init__(self):
        super().__post_init__()
        if self.version not in ("eagle1", "eagle3"):
            raise ValueError(f"version = {self.version!r}: expected eagle1 or eagle3")
        if self.version == "eagle1" and (self.draft_vocab_size or self.vocab_map):
            raise ValueError("draft_vocab_size / vocab_map are eagle3 options (EAGLE-1 uses the target's lm_head)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(
                f"draft_vocab_size = {self.draft_vocab_size} must be >= 1 (or unset for the full vocabulary)"
            )
        if self.version == "eagle1" and (self.fc_norm or self.norm_output):
            raise ValueError("fc_norm / norm_output are eagle3 options (EAGLE-3.1)")
        if self.version == "eagle1" and self.qk_norm:
            raise ValueError("qk_norm = true is an eagle3 option (speculators' qwen3 layer); version = 'eagle1'")
        if self.loss not in DIVERGENCES:
            raise ValueError(f"loss = {self.loss!r}: expected one of {', '.join(DIVERGENCES)}")
        if self.draft_vocab_size is not None and self.vocab_map:
            raise ValueError("give draft_vocab_size or vocab_map, not both")
        for name in ("ttt_steps", "eval_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if not 0 < self.ttt_decay <= 1 or self.feature_noise < 0:
            raise ValueError("need 0 < ttt_decay <= 1, feature_noise >= 0")


def head_parameters(recipe: EagleRecipe, target) -> tuple[int, int]:
    """(trainable, frozen) parameters of the head `train` builds for `target` (meta is fine; the
    memory estimate, train/sharding.py). The embeddings are a frozen copy (V x H); EAGLE-1's
    lm_head too, and its layer has no input norm but fc(2H -> H) with a bias."""
    tc, H, V = target_dims(target)
    if recipe.version == "eagle1":
        return layer_params(tc, H) - H + 2 * H * H + H, 2 * V * H
    return eagle3_parameters(recipe, target), V * H


def eagle3_parameters(recipe, target) -> int:
    """The trained part of an EAGLE-3 head (also of the heads built on it): the layer (q/k/v read
    2H) and its hidden_norm, fc over the n aux states (n H x H; `fc_norm`: one RMSNorm per aux state),
    the final norm, lm_head over the draft vocabulary (Vd x H), and (`qk_norm`) the q and k norms
    (head_dim each)."""
    tc, H, V = target_dims(target)
    aux = aux_layer_count(recipe, tc)
    fc = aux * H * H + (aux * H if recipe.fc_norm else 0)
    qk = 2 * (layer_value(tc, "head_dim") or H // tc.num_attention_heads) if recipe.qk_norm else 0
    return layer_params(tc, 2 * H) + H + fc + H + draft_vocab(recipe, V) * H + qk


def head_options(recipe) -> dict:
    """The EAGLE-3 options of the head a recipe (EAGLE-3's or P-EAGLE's) trains, as `for_target`
    takes them."""
    return {"fc_norm": recipe.fc_norm, "norm_output": recipe.norm_output, "qk_norm": recipe.qk_norm}


def aux_layer_count(recipe, text_config) -> int:
    """How many target hidden states fc reads: the recipe's `aux_layers`, else EAGLE-3's default."""
    from draftsmith.heads.eagle.model import default_aux_layer_ids

    return len(recipe.aux_layers or default_aux_layer_ids(text_config.num_hidden_layers))


def shifted(x: torch.Tensor, j: int, fill=0) -> torch.Tensor:
    """x[:, j:] padded back to x's length with `fill` (positions past the end)."""
    if j == 0:
        return x
    pad = torch.full_like(x[:, :j], fill)
    return torch.cat([x[:, j:], pad], dim=1)


def ttt_mask(n: int, step: int, device, dtype=torch.float32) -> torch.Tensor:
    """Additive mask [1, 1, n, (step + 1) n] of training-time-test step `step` (>= 1).

    The cache holds step 0's keys for positions 0..n-1, then one block per later step. The
    query at position t (drafting `step` tokens past t) sees step 0's keys at s <= t (the real
    context) and its own chain: the entries at t of steps 1..step (the last being itself).
    """
    t = torch.arange(n, device=device)
    allowed = [t[None, :] <= t[:, None]]  # step 0: causal
    for _ in range(step):
        allowed.append(torch.eye(n, dtype=torch.bool, device=device))
    allowed = torch.cat(allowed, dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def eagle_losses(
    head, batch, feats, teacher, recipe: EagleRecipe, in_vocab, *, train: bool, steps: int, dense: bool = False
):
    """Per-step losses, top-1 hits and kept positions over `steps` unrolled draft steps. `feats`:
    eagle1 the post-norm last hidden [B,T,H], eagle3 the concatenated aux states [B,T,n*H]; `teacher` the
    target's logits on the head's vocabulary [B,T,Vd] and `in_vocab` [B,T] (None: the whole
    vocabulary) as `teacher.on_draft_vocab` makes them. Unrolling is the training-time test for
    EAGLE-3 and, at evaluation, simply how both versions draft past the first token (own output
    fed back). The head projects the kept positions only (the lm_head is most of a step's cost);
    `dense`: every position (the on-policy replay reads the logits at its calls)."""
    from transformers import DynamicCache

    ids = batch["input_ids"]
    valid = batch["attention_mask"].bool()
    n = ids.shape[1] - 1  # positions t = 0..T-2 (token t+1 exists)
    positions = torch.arange(n, device=ids.device)[None].expand(ids.shape[0], n)
    step_ids = ids[:, 1:]  # token t+1 at position t
    losses, hits, counts = [], [], []
    cache = DynamicCache()
    hidden = None
    for j in range(steps):
        # Step j at position t drafts token t+2+j; the target's distribution for it is its
        # prediction at position t+1+j.
        label_mask = shifted(batch["loss_mask"], 2 + j, False)[:, :n] & valid[:, 1:]
        if in_vocab is not None:
            # The target's distribution restricted to the draft vocabulary (EAGLE-3); positions whose
            # target argmax the draft vocabulary cannot produce teach nothing useful and are masked.
            label_mask = label_mask & shifted(in_vocab, 1 + j, False)[:, :n]
        at = None if dense else label_mask
        if j == 0:
            if recipe.version == "eagle1":
                f = feats[:, :-1]
                if train and recipe.feature_noise:
                    f = f + (torch.rand_like(f) - 0.5) * recipe.feature_noise
                hidden = f
            else:
                hidden = head.project(feats[:, :-1].to(head.dtype))
            out, logits = head(step_ids, hidden.to(head.dtype), position_ids=positions, cache=cache, logits_at=at)
        else:
            out, logits = head(
                shifted(step_ids, j),
                hidden,
                position_ids=positions + j,
                cache=cache,
                attention_mask=ttt_mask(n, j, ids.device, head.dtype),
                logits_at=at,
            )
        kept_logits = logits[label_mask] if dense else logits  # [N, Vd]
        rows, cols = label_mask.nonzero(as_tuple=True)  # a kept t has its token t+2+j, so t+1+j < T
        kept_teacher = teacher[rows, cols + 1 + j]  # [N, Vd], read in place (no shifted copy of [B, T, Vd])
        loss = divergence(recipe.loss, kept_logits, kept_teacher)  # fp32, the mean over the kept positions
        if recipe.version == "eagle1":
            feature_mask = batch["loss_mask"][:, 1:] & valid[:, 1:]  # f_{t+1} of an answer token
            loss = recipe.ce_weight * loss + recipe.feature_weight * smooth_l1(
                out.float(), feats[:, 1:].float(), feature_mask
            )
        losses.append(loss)
        with torch.no_grad():  # top-1 per position [B, n], False where nothing is kept
            hit = torch.zeros_like(label_mask)
            hit[label_mask] = kept_logits.argmax(-1) == kept_teacher.argmax(-1)
            hits.append(hit)
            counts.append(label_mask)
        hidden = out  # the next step reads the head's own output (training-time test)
    return losses, hits, counts


def trained_steps(recipe: EagleRecipe) -> int:
    """The unrolled steps a version trains: EAGLE-3 its training-time test, EAGLE-1 one step."""
    return recipe.ttt_steps if recipe.version == "eagle3" else 1


def _replayed_loss(kept, rows, feats, teacher, recipe: EagleRecipe, in_vocab, width: int):
    """The TTT-weighted loss over the steps this version trains, unrolled deep enough for the law to
    read `width` steps. train=False: no EAGLE-1 feature noise (its only effect), so the law replayed
    is the decoder's own."""
    trained = trained_steps(recipe)
    width = max(trained, width)
    per_step, _, _ = eagle_losses(kept, rows, feats, teacher, recipe, in_vocab, train=False, steps=width, dense=True)
    return sum(recipe.ttt_decay**j * loss for j, loss in enumerate(per_step[:trained]))


def _replayed_law(head, batch, kept, anchors, drafts):
    """Step j of the unroll at t = n - 2 drafts the token n + j (its own output fed back)."""
    steps = [logits for _, logits in kept[: drafts.shape[-1]]]  # each [B, T-1, Vd]
    at = anchors[..., None].expand(-1, -1, steps[0].shape[-1])
    return torch.stack([logits.gather(1, at) for logits in steps], dim=2)  # [B, A, K, Vd]


#: On-policy post-training (train/onpolicy.py) replays a head's calls at t = n - 2, the pair before the anchor.
REPLAY = Replay(
    eagle_losses,
    _replayed_law,
    offset=2,
    save="draftsmith.heads.eagle:save_eagle",
    shape_keys=("version",),
    unrolled_loss=_replayed_loss,
)


class EagleObjective(torch.nn.Module):
    """The head and its unrolled loss behind one forward: DDP and DeepSpeed average the
    gradients of what runs inside the wrapped module's forward, so every unrolled step must."""

    def __init__(self, head, recipe: EagleRecipe):
        super().__init__()
        self.head = head
        self.recipe = recipe

    def forward(self, input_ids, attention_mask, loss_mask, feats, teacher, in_vocab, steps: int):
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        return eagle_losses(self.head, batch, feats, teacher, self.recipe, in_vocab, train=True, steps=steps)


@cleaned_up_on_error
def train(recipe: EagleRecipe, *, progress: bool = True) -> dict:
    from draftsmith.heads.eagle import EagleError, EagleHead, save_eagle

    run = TrainingRun(recipe, "eagle", progress)
    device = run.device
    # step 0 at position t drafts token t+2: position 2 is the first the head is trained on
    target, data, train_rows, heldout_rows = run.load_training(first=2)
    _, V, pad_id = target_sizes(target)

    vocab_map = draft_vocab_map(recipe, data, V) if recipe.version == "eagle3" else None
    try:
        head = EagleHead.for_target(
            target, recipe.version, **head_options(recipe), **head_origin(recipe, data, vocab_map)
        )
        head = head.to(device)
    except EagleError as err:
        raise RecipeError(str(err)) from None

    # (features, teacher on the draft vocabulary, in_vocab): eagle1's feature is the post-norm last
    # state (aux = [L]), eagle3's the aux states concatenated; offline the cache holds them and `last`.
    target_states = head_target_states(run, target, data, head, vocab_map)

    model, head = prepare_head(run, EagleObjective(head, recipe))
    run.start()

    def micro_step(step, micro):
        """One micro-batch: the TTT-weighted loss (this process's token share), per-step losses."""
        batch = run.batch(data, train_rows, step, micro, pad_id)
        feats, teacher, in_vocab = target_states(batch)
        steps = trained_steps(recipe)
        ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        per_step, _, counts = model(ids, attention, loss_mask, feats, teacher, in_vocab, steps)
        per_step = [l * share for l, share in zip(per_step, run.token_shares([c.sum() for c in counts]))]
        loss = sum(recipe.ttt_decay**j * l for j, l in enumerate(per_step))
        return loss, batch, {"step_losses": per_step}

    @torch.no_grad()
    def evaluate():
        """Per-step top-1 and the chain's tau over `eval_depth` draft steps (greedy; the data's
        tokens, the head's own features fed back): a position's chain ends at its first miss."""
        hit_sums = None
        tau_sum = tau_n = 0.0
        walks = torch.zeros(2, 2, dtype=torch.float64)
        for start, batch in heldout_batches(data, heldout_rows, recipe.batch_size, recipe.max_length, pad_id, device):
            feats, teacher, in_vocab = target_states(batch)
            _, hits, counts = eagle_losses(
                head, batch, feats, teacher, recipe, in_vocab, train=False, steps=recipe.eval_depth
            )
            sums = [(float(h.sum()), float(c.sum())) for h, c in zip(hits, counts)]
            hit_sums = sums if hit_sums is None else [(a + x, b + y) for (a, b), (x, y) in zip(hit_sums, sums)]
            # The decoder calls at every trained position of the answer, an out-of-vocabulary one too (a miss).
            n = hits[0].shape[1]
            starts = shifted(batch["loss_mask"], 2, False)[:, :n] & batch["attention_mask"].bool()[:, 1:]
            walks += heldout_walks(torch.stack(hits, -1).cpu(), starts.cpu(), start, recipe)
            tau_sum += float(simulated_tau([h.double() for h in hits])[counts[0]].sum())
            tau_n += float(counts[0].sum())
        return {
            "top1_per_step": [a / max(1.0, b) for a, b in hit_sums],
            # greedy, teacher-forced tokens, the bonus token counted: along the decoder's walk, and over every position
            **walk_taus(walks),  # every held-out row, and the serve check's prompts
            "tau_simulated_mean": tau_sum / tau_n if tau_n else 1.0,
            "positions": tau_n,
        }

    evaluate = evaluate if heldout_rows else None
    done = train_loop(run, model, micro_step, desc=recipe.version, evaluate=evaluate, describe=describe_top1("step"))
    K, version = recipe.eval_depth, recipe.version
    return finish_head(run, done, model, head, save_eagle, target, K, data, heldout_rows, vocab_map, version=version)


def main(argv=None) -> int:
    shown = ("steps", "version", "train_tokens_per_second")
    return trainer_main("train/eagle.py", __doc__, EagleRecipe, train, argv, result="head", shown=shown)


if __name__ == "__main__":
    sys.exit(main())
