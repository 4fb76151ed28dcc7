"""Self-distillation data: the target answers the prompts itself, turn by turn.

A drafter is accepted in proportion to how well it predicts *this* target, so it trains on
the target's own outputs: every assistant turn of the source is replaced by the target's
answer given the turns before it (earlier turns already regenerated), and plain prompts get
the target's completion. What the drafter learns is marked by the loss mask: the assistant
content and its end-of-turn token, taken from the tokenizer's own chat template
(`distill/chat.py`), or the completion tokens for plain prompts.

This file is the generation loop: `generate_shard` turns one shard's samples into rows.
Answers cut by --max-new-tokens are kept with finish_reason "length" and counted; a cut turn
ends its conversation (later turns would follow an answer the target never finished).
Logits are watched while generating (NaN or inf at the lm_head is an error, never a dataset
of token 0). The run around it (the command, the --out folder, shards over processes, resume,
provenance, the summary) is distill/generate_run.py.

The answers come from a backend: by default the loaded target (`_generate_batch`); with
`backend=` any callable taking `TurnRequest`s and returning `Answer`s, e.g. a serving engine
(`distill/endpoint.py`). Prompts, masks, shards and the summary are the same either way; each row
records where its answer's token ids came from (`token_source`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from draftsmith.distill import data as store
from draftsmith.distill.chat import ChatTemplateError, conversation_tokens, special_token_ids
from draftsmith.distill.prompts import encode_text
from draftsmith.distill.sources import Record, Source, assistant_turns


@dataclass(frozen=True)
class GenerateSettings:
    max_new_tokens: int = 512  # per assistant turn; longer answers are cut and flagged
    temperature: float = 0.0  # 0 = greedy; sample at the serving temperature when serving samples
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (HF's generate defaults to 50; draftsmith never warps silently)
    num_samples: int = 1  # answers per prompt (needs temperature > 0 when > 1)
    batch_size: int = 8
    shard_size: int = 256  # samples per shard: the unit of resumption
    max_length: int | None = None  # prompt + answer tokens; default: the target's max positions
    seed: int = 0

    def __post_init__(self):
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "num_samples": self.num_samples >= 1,
            "batch_size": self.batch_size >= 1,
            "shard_size": self.shard_size >= 1,
            "max_length": self.max_length is None or self.max_length >= 2,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is out of range")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(
                "num_samples > 1 with temperature 0 would repeat the same greedy answer; set temperature > 0"
            )


@dataclass(frozen=True)
class TurnRequest:
    """One answer to generate, as a backend sees it."""

    prompt_ids: list[int]  # the prompt as local generation tokenizes it (chat template or raw text)
    messages: list[dict] | None  # the conversation before the turn (None for raw-text prompts)
    prompt: str | None  # the raw prompt text (None for conversations)
    budget: int  # max new tokens of this turn
    key: tuple[int, int, int]  # (record index, sample index, turn): seeds a server-side sampler


@dataclass(frozen=True)
class Answer:
    ids: list[int]  # through the stop token when the turn ended
    finish_reason: str  # "stop" | "length"
    token_source: str = "local"  # "local" | "server" (ids the server returned) | "retokenized" (its text)
    refused: str | None = None  # a reason to drop the sample (counted in `skipped`)
    generated: int | None = None  # tokens the backend generated, when its count is not len(ids) (a server's usage)


@dataclass
class _Conversation:
    """One sample in the making: the messages so far and the turns still to generate."""

    record: Record
    sample_index: int
    messages: list[dict] | None  # None for plain prompts without a chat template
    turns: list[int]
    prompt_ids: list[int] = field(default_factory=list)  # of the last generated turn
    prompt_mask: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_turns: int = 0
    skipped: str | None = None
    token_source: str = "local"  # of the last answer (earlier turns are re-rendered through the template)


def stop_token_ids(model, tokenizer, template: str | None) -> list[int]:
    """EOS ids of the target, plus the chat template's end-of-turn token (e.g. <|im_end|>).

    The end-of-turn token is read off the template itself: render a one-turn exchange and take
    the special token the mask places after the assistant's content.
    """
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    end = end_of_turn_token(tokenizer, template)
    if end is not None:
        ids.append(end)
    return sorted(set(ids))


def end_of_turn_token(tokenizer, template: str | None) -> int | None:
    """The special token the chat template writes after an assistant's content, or None."""
    if template is None:
        return None
    try:
        tokens, mask = conversation_tokens(
            tokenizer, template, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        )
    except ChatTemplateError:
        return None  # a template that cannot render this exchange is reported when it is first used
    trained = [t for t, m in zip(tokens, mask) if m]
    return trained[-1] if trained and trained[-1] in special_token_ids(tokenizer) else None


def _from_first_user_turn(messages: list[dict]) -> list[dict]:
    """Drop assistant turns before the first user turn (a canned greeting): the target cannot
    regenerate an answer to nothing, and training on someone else's text is what this avoids."""
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        return messages
    first = roles.index("user")
    return [m for m in messages[:first] if m["role"] == "system"] + messages[first:]


def _conversation(record: Record, sample_index: int, template: str | None) -> _Conversation:
    if record.messages is None and template is None:
        return _Conversation(record, sample_index, None, [0])
    messages = list(record.messages) if record.messages is not None else [{"role": "user", "content": record.prompt}]
    messages = _from_first_user_turn(messages)
    return _Conversation(record, sample_index, messages, assistant_turns(messages))


def _prompt_tokens(conv: _Conversation, tokenizer, template: str | None) -> tuple[list[int], list[int]]:
    if conv.messages is None:
        ids = encode_text(tokenizer, conv.record.prompt)  # no second BOS on an already rendered prompt
        return ids, [0] * len(ids)
    turn = conv.turns[conv.num_turns]
    return conversation_tokens(tokenizer, template, conv.messages[:turn], add_generation_prompt=True)


class NonFiniteLogits(store.DataError):
    """The target computed NaN or inf logits: nothing it generates from them is data."""


@contextlib.contextmanager
def _watch_logits(model):
    """Yield a device flag that turns False when a logit at the lm_head (the last position of
    every forward) is NaN or inf. The raw logits are checked, before any warper sets -inf on
    filtered tokens, and the flag is read once per batch, so decoding gains no extra sync."""
    finite = torch.ones((), dtype=torch.bool, device=model.device)
    head = model.get_output_embeddings()
    if head is None:
        yield finite
        return

    def check(module, args, output):
        finite.logical_and_(torch.isfinite(output[..., -1, :]).all().to(finite.device))

    handle = head.register_forward_hook(check)
    try:
        yield finite
    finally:
        handle.remove()


def check_prompts_fit(source: Source, tokenizer, template: str | None, max_length: int, explicit: bool) -> None:
    """At least one record gives a first prompt that fits in max_length (the scan stops at the
    first that does): a source that would make an empty dataset is an error, not a warning."""
    skipped: dict[str, int] = {}
    shortest = None
    for record in source.records:
        conv = _conversation(record, 0, template)
        if not conv.turns:
            skipped["no user turn"] = skipped.get("no user turn", 0) + 1
            continue
        try:
            ids, _ = _prompt_tokens(conv, tokenizer, template)
        except ChatTemplateError:
            skipped["template error"] = skipped.get("template error", 0) + 1
            continue
        if len(ids) < max_length:
            return
        skipped["too long"] = skipped.get("too long", 0) + 1
        shortest = len(ids) if shortest is None else min(shortest, len(ids))
    limit = f"--max-length {max_length}" if explicit else f"the target's max_position_embeddings ({max_length})"
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    if shortest is None:
        todo = "check the source's rows"
    elif explicit:
        todo = f"raise --max-length past {shortest} or use shorter prompts"
    else:
        todo = "use shorter prompts (or a target with more positions)"
    raise store.DataError(
        f"no record of {source.name!r} gives a prompt that fits in {limit} ({why}"
        + (f"; the shortest prompt has {shortest} tokens" if shortest is not None else "")
        + f"): {todo}; nothing was written"
    )


@torch.inference_mode()
def _generate_batch(
    model, prompts: list[list[int]], budgets: list[int], settings: GenerateSettings, stop_ids: list[int], pad_id: int
):
    """Left-padded batched generation; returns each row's answer ids (through the stop token)
    and its finish reason."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    sample = settings.temperature > 0
    config = GenerationConfig(
        max_new_tokens=max(budgets),
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_p=settings.top_p if sample else None,
        top_k=settings.top_k if sample and settings.top_k else None,
        eos_token_id=stop_ids or None,
        pad_token_id=pad_id,
    )
    with _watch_logits(model) as finite:
        try:
            out = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention.to(model.device),
                generation_config=config,
            )
        except RuntimeError:  # sampling from NaN probabilities fails inside torch.multinomial
            if bool(finite):
                raise
            out = None
    if not bool(finite):
        raise NonFiniteLogits(f"the target's logits are NaN or inf (dtype {str(model.dtype).removeprefix('torch.')})")
    new = out[:, width:].tolist()
    stops = set(stop_ids)
    results = []
    for row, budget in zip(new, budgets):
        row = row[:budget]
        end = next((i for i, t in enumerate(row) if t in stops), None)
        results.append((row[: end + 1], "stop") if end is not None else (row, "length"))
    return results


def _row(conv: _Conversation) -> dict:
    ids = conv.prompt_ids + conv.answer_ids
    mask = conv.prompt_mask + [1] * len(conv.answer_ids)
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "length": len(ids),
        "num_trained": sum(mask),
        "prompt_length": len(conv.prompt_ids),
        "finish_reason": conv.finish_reason,
        "num_turns": conv.num_turns,
        "record_index": conv.record.index,
        "sample_index": conv.sample_index,
        "token_source": conv.token_source,
    }


def generate_shard(
    model,
    tokenizer,
    items: list[tuple[Record, int]],
    template: str | None,
    settings: GenerateSettings,
    *,
    max_length: int,
    stop_ids: list[int],
    progress=None,
    backend=None,
):
    """Generate one shard's samples; returns (rows in item order, shard statistics). `backend`
    (TurnRequests -> Answers) answers instead of `model`; it is given each round whole, and
    bounds its own concurrency."""
    convs = [_conversation(record, sample_index, template) for record, sample_index in items]
    skipped: dict[str, int] = {}
    examples: list[dict] = []
    dropped_turns = 0

    def skip(conv, reason, detail):
        conv.skipped = reason
        skipped[reason] = skipped.get(reason, 0) + 1
        if len(examples) < 5:
            examples.append({"record_index": conv.record.index, "reason": reason, "detail": detail})

    for conv in convs:
        if not conv.turns:
            skip(conv, "no_user_turn", "the conversation has no user message to answer")
    pad_id = next(x for x in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if x is not None)
    generated = prompt_tokens = 0
    round_index = 0
    while True:
        active = [c for c in convs if c.skipped is None and c.finish_reason != "length" and c.num_turns < len(c.turns)]
        if not active:
            break
        ready = []
        for conv in active:
            try:
                ids, mask = _prompt_tokens(conv, tokenizer, template)
            except ChatTemplateError as err:
                if round_index == 0:
                    skip(conv, "template_error", str(err))
                else:  # keep the turns already made; the rest cannot be rendered
                    conv.turns = conv.turns[: conv.num_turns]
                    dropped_turns += 1
                continue
            if len(ids) >= max_length:
                if round_index == 0:
                    skip(conv, "prompt_too_long", f"{len(ids)} prompt tokens >= max_length {max_length}")
                else:  # the conversation outgrew the window: it ends at its last complete turn
                    conv.turns = conv.turns[: conv.num_turns]
                    dropped_turns += 1
                continue
            ready.append((conv, ids, mask))
        # Similar lengths side by side: less padding, and the order is still deterministic.
        ready.sort(key=lambda r: len(r[1]))
        step = settings.batch_size if backend is None else max(1, len(ready))
        for start in range(0, len(ready), step):
            batch = ready[start : start + step]
            budgets = [min(settings.max_new_tokens, max_length - len(ids)) for _, ids, _ in batch]
            if backend is None:
                results = [
                    Answer(a, r)
                    for a, r in _generate_batch(
                        model, [ids for _, ids, _ in batch], budgets, settings, stop_ids, pad_id
                    )
                ]
            else:
                results = backend([_turn_request(conv, ids, budget) for (conv, ids, _), budget in zip(batch, budgets)])
            before = generated
            for (conv, ids, mask), result in zip(batch, results):
                if result.refused is not None:
                    skip(conv, result.refused, f"turn {conv.num_turns}: the answer was refused ({result.refused})")
                    continue
                answer, reason = result.ids, result.finish_reason
                conv.prompt_ids, conv.prompt_mask, conv.answer_ids, conv.finish_reason = ids, mask, answer, reason
                conv.token_source = result.token_source
                generated += len(answer) if result.generated is None else result.generated
                prompt_tokens += len(ids)
                if conv.messages is not None:
                    turn = conv.turns[conv.num_turns]
                    text = tokenizer.decode([t for t in answer if t not in stop_ids], skip_special_tokens=True)
                    message = {"role": "assistant", "content": text}
                    if turn < len(conv.messages):
                        conv.messages[turn] = message
                    else:
                        conv.messages.append(message)
                conv.num_turns += 1
            if progress is not None:
                _advance(progress, len(batch), generated - before)
        round_index += 1
    rows = [_row(c) for c in convs if c.skipped is None]
    stats = {
        "samples": len(rows),
        "skipped": skipped,
        "skipped_examples": examples,
        "turns_dropped": dropped_turns,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
    }
    return rows, stats


def _turn_request(conv: _Conversation, ids: list[int], budget: int) -> TurnRequest:
    key = (conv.record.index, conv.sample_index, conv.num_turns)
    if conv.messages is None:
        return TurnRequest(ids, None, conv.record.prompt, budget, key)
    return TurnRequest(ids, [dict(m) for m in conv.messages[: conv.turns[conv.num_turns]]], None, budget, key)


def _advance(bar, turns: int, tokens: int) -> None:
    """The progress bar `turns` further, showing answer tokens per second since it started."""
    bar.answer_tokens = getattr(bar, "answer_tokens", 0) + tokens
    elapsed = bar.format_dict.get("elapsed") or 0
    bar.update(turns)
    if elapsed > 0:
        bar.set_postfix_str(f"{bar.answer_tokens / elapsed:,.1f} tok/s")
