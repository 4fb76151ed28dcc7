"""What a head trainer reads from the frozen target: its hidden states (from one forward, or from
the offline `cache-hidden` cache) and the teacher, the target's distribution on the head's
vocabulary, with the mask of the positions whose argmax that vocabulary holds.

    target_states = head_target_states(run, target, data, head, vocab_map)
    feats, teacher, in_vocab = target_states(batch)   # [B, T, n*H], [B, T, Vd], [B, T] | None
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.train.common import target_sizes


def open_hidden_cache(path: str, target, data, layers: tuple[int, ...]):
    """The `draftsmith cache-hidden` folder at `path`, checked to hold `layers` of this target
    (its fingerprint and width) on this data: states of another model or data train nothing."""
    from draftsmith.distill.hidden_cache import HiddenStateCache
    from draftsmith.heads.models import target_fingerprint

    cache = HiddenStateCache(path)
    cache.check(
        target_fingerprint=target_fingerprint(target),
        layers=layers,
        data_hash=data.data_hash,
        hidden_size=target.config.get_text_config().hidden_size,
    )
    return cache


def cached_states(cache, batch: dict, device, layers, top1: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the offline cache's hidden states of `layers` (HF ids, in that order; the cache may hold more)
    for the batch's rows, right-padded to its width [B, len(layers), T, H] fp32, cast on the one copy
    into place; with `top1`, the target's top-1 id at each position [B, T] long (0 past a row's end)
    from a cache of top-k logits (`cache-hidden --topk-logits k`), else None)."""
    B, width = batch["input_ids"].shape
    pick = cache.layer_index(layers)
    states = torch.zeros(B, len(pick), width, cache.manifest["hidden_size"])
    top1 = torch.zeros(B, width, dtype=torch.long) if top1 else None
    for r, row in enumerate(batch["rows"]):
        item = cache[row]
        h = item["hidden"][pick, :width]  # [len(layers), t, H]
        states[r, :, : h.shape[1]] = h
        if top1 is not None:
            ids = item["topk_ids"][:width, 0]  # the top-k are sorted: the first is the argmax
            top1[r, : ids.shape[0]] = ids
    return states.to(device), (top1.to(device) if top1 is not None else None)


def on_draft_vocab(logits: torch.Tensor, vocab, t2d) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits [..., V] as a head with a reduced draft vocabulary learns them: (those of the
    draft tokens [..., Vd] fp32, in_vocab [...] bool: the target's argmax is a draft token; a position
    where it is not teaches nothing the head can draft and is masked). (logits fp32, None) without."""
    if vocab is None:
        return logits.float(), None
    return logits[..., vocab].float(), t2d[logits.argmax(-1)]


def vocab_argmax(hidden: torch.Tensor, lm_head, chunk: int = 8192) -> torch.Tensor:
    """[...] long: the argmax of lm_head(hidden) over the whole vocabulary, `chunk` rows of the weight at
    a time (never a [..., V] tensor); the first index on ties, as torch.argmax."""
    weight, bias = lm_head.weight, lm_head.bias
    best = index = None
    for lo in range(0, weight.shape[0], chunk):
        z = torch.nn.functional.linear(hidden, weight[lo : lo + chunk], None if bias is None else bias[lo : lo + chunk])
        value, at = z.max(-1)  # the first maximum of the slice
        if best is None:
            best, index = value, at
        else:
            later = value > best  # strictly: an equal value in a later slice keeps the earlier index
            best, index = torch.where(later, value, best), torch.where(later, at + lo, index)
    return index


def target_forward(target, ids: torch.Tensor, attention_mask: torch.Tensor):
    """The frozen target's forward over a training batch, with every layer's hidden states (no
    KV cache, no gradients)."""
    with torch.no_grad():
        return target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)


@dataclass(frozen=True)
class TeacherStates:
    """A teacher whose logits are left uncomputed: the target's last states [B, T, H] and the lm_head
    rows of the head's vocabulary; `teacher_rows` projects only the positions a loss reads."""

    states: torch.Tensor
    weight: torch.Tensor  # [Vd, H]
    bias: torch.Tensor | None = None


def teacher_rows(teacher, index: torch.Tensor) -> torch.Tensor:
    """The teacher's float logits [B, N, Vd] at the positions `index` [B, N]: rows of the logits
    [B, T, Vd], or the projection of just those rows' states (`TeacherStates`)."""
    states = teacher.states if isinstance(teacher, TeacherStates) else teacher
    rows = states.gather(1, index[..., None].expand(-1, -1, states.shape[-1]))
    if isinstance(teacher, TeacherStates):
        with torch.no_grad():
            rows = torch.nn.functional.linear(rows, teacher.weight, teacher.bias)
    return rows.float()


def aux_states_and_teacher(
    recipe, target, data, aux: tuple[int, ...], last: int, device, vocab=None, t2d=None, lazy: bool = False
):
    """batch -> (the aux layers' states concatenated [B, T, n*H], teacher, in_vocab): the target's
    logits on the head's vocabulary and its argmax mask as `on_draft_vocab` makes them (`vocab` [Vd]:
    the target id of each draft id, `t2d` [V] bool; None: the whole vocabulary). From the offline
    hidden cache `recipe.hidden_cache` (checked to hold `aux` and `last` of this target on this data;
    it may hold more) when the recipe names one, else from one frozen target forward.

    Offline the teacher is the cached last state projected on the lm_head rows of the draft tokens
    only ([Vd, H]: at Vd = 8192 of 49k, a sixth of the full projection, and no [B, T, V] tensor to
    index every step). The argmax over the whole vocabulary (in_vocab) is the cache's top-1 id when it
    is that of the stored state (`cache-hidden --topk-logits 1` with --dtype the forward's:
    `HiddenStateCache.top1_is_argmax`), else computed once per data row over vocabulary slices
    (`vocab_argmax`) and kept: it is a function of the row alone, so later epochs skip the full
    projection for 1 byte per token. Teacher, masks and losses equal the full-vocabulary path's
    (tests/test_draft_teacher.py). `lazy` (offline only): the teacher is `TeacherStates`, projected
    by the loss at the positions it reads (`teacher_rows`)."""
    cache, lm_head = None, target.get_output_embeddings()
    if recipe.hidden_cache:
        cache = open_hidden_cache(recipe.hidden_cache, target, data, tuple(sorted(set(aux) | {last})))
    use_top1 = vocab is not None and cache is not None and cache.top1_is_argmax(lm_head.weight.dtype)
    if vocab is not None:
        draft_weight = lm_head.weight.detach()[vocab]  # [Vd, H]
        draft_bias = None if lm_head.bias is None else lm_head.bias.detach()[vocab]
    known: dict[int, torch.Tensor] = {}  # data row -> [t] bool: in_vocab of its real positions

    def in_vocab_of(batch, last_state):
        rows, real = batch["rows"], batch["attention_mask"].sum(1).tolist()
        todo = [r for r, row in enumerate(rows) if row not in known or known[row].numel() < real[r]]
        if todo:
            with torch.no_grad():
                hits = t2d[vocab_argmax(last_state[todo], lm_head)].cpu()  # [len(todo), T]
            known.update({rows[r]: hits[i, : real[r]] for i, r in enumerate(todo)})
        in_vocab = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
        for r, row in enumerate(rows):
            in_vocab[r, : real[r]] = known[row][: real[r]]
        return in_vocab.to(device)

    def states(batch):
        if cache is None:
            o = target_forward(target, batch["input_ids"], batch["attention_mask"])
            feats = torch.cat([o.hidden_states[i] for i in aux], dim=-1).float()
            return feats, *on_draft_vocab(o.logits, vocab, t2d)
        held, top1 = cached_states(cache, batch, device, (*aux, last), use_top1)  # [B, n + 1, T, H], [B, T] | None
        feats = torch.cat(held[:, : len(aux)].unbind(1), dim=-1)
        last_state = held[:, -1].to(lm_head.weight.dtype)
        weight, bias = (lm_head.weight, lm_head.bias) if vocab is None else (draft_weight, draft_bias)
        if lazy:
            teacher = TeacherStates(last_state, weight.detach(), None if bias is None else bias.detach())
        else:
            with torch.no_grad():
                teacher = torch.nn.functional.linear(last_state, weight, bias).float()  # [B, T, Vd]
        if vocab is None:
            return feats, teacher, None
        return feats, teacher, (t2d[top1] if top1 is not None else in_vocab_of(batch, last_state))

    return states


def draft_vocab_ids(head, vocab_map, device) -> torch.Tensor | None:
    """[Vd]: the target id of each draft id of a head with a reduced vocabulary; None with the full one."""
    if vocab_map is None:
        return None
    return head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=device))


def head_target_states(run, target, data, head, vocab_map, lazy: bool = False):
    """batch -> (features, teacher, in_vocab) of `head` (`aux_states_and_teacher` over the target
    states it reads, `aux_layer_ids`, and its draft vocabulary), the vocabulary map described first."""
    vocab = draft_vocab_ids(head, vocab_map, run.device)
    if vocab_map is not None:
        run.print(vocab_map.describe())
    t2d = head.t2d if vocab is not None else None
    aux, last = tuple(head.config.aux_layer_ids), target_sizes(target)[0]
    return aux_states_and_teacher(run.recipe, target, data, aux, last, run.device, vocab, t2d, lazy)
