"""Prompts as the target sees them: the token ids of every user turn of a prompt source.

One loader for every command that feeds prompts to the target (`eval`, `tune`, `check-lossless`,
and the plain prompts of `generate`): the rows come from `sources.load_source` (every format and
file type it reads), and `Prompter` turns a row into token ids.

    source = load_source("question.jsonl")                 # MT-bench rows: "turns", "category"
    prompter = Prompter(tokenizer, template)               # template: chat.resolve_chat_template
    ids = prompter.ids(source.records[0])                   # turn 1, rendered with the generation prompt
    ids = prompter.ids(source.records[0], ["answer 1"])     # turn 2, after the target's answer to turn 1

How a row becomes ids:
  conversations ("messages", "conversations", "turns"): the chat template renders the messages
    before the assistant turn to answer, with the generation prompt; the text is tokenised with
    add_special_tokens=False, since the template writes BOS itself when it wants one.
  plain prompts: `plain="raw"` (the default) tokenises the text as it is (`encode_text`);
    `plain="chat"` sends it as one user turn through the chat template, as an instruct target
    was trained. Text that already starts with the tokenizer's BOS token is a rendered template:
    it is tokenised as it is, in both modes, and gets no second BOS.
  "input_ids": as given.

Turns. Every assistant turn of a conversation is answered by the target itself (recorded answers
are replaced, as `generate` does), so a conversation holds `num_turns` prompts: turn j is asked
after the target's own answers to turns 1..j-1 (its decoded text, rendered back through the
template as a chat server would). A plain or pre-tokenised prompt is one turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.distill.chat import ChatTemplateError, render
from draftsmith.distill.sources import Record, SourceError, assistant_turns

PLAIN_MODES = ("raw", "chat")  # how a plain "prompt" row is tokenised; see the module docstring


def is_rendered(tokenizer, text: str) -> bool:
    """Whether `text` already starts with the tokenizer's BOS token: a prompt rendered by a chat template."""
    bos = getattr(tokenizer, "bos_token", None)
    return isinstance(bos, str) and bool(bos) and text.startswith(bos)


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as token ids with the tokenizer's own special tokens (BOS for most), except when the
    text is already rendered (`is_rendered`): no second BOS."""
    return list(tokenizer(text, add_special_tokens=not is_rendered(tokenizer, text)).input_ids)


@dataclass(frozen=True)
class Prompter:
    tokenizer: object  # the target's tokenizer (None: only "input_ids" rows can be used)
    template: str | None  # the chat template (chat.resolve_chat_template), None: none in use
    plain: str = "raw"  # "raw" | "chat": plain prompts as text, or as one user turn through the template

    def __post_init__(self):
        if self.plain not in PLAIN_MODES:
            raise ValueError(f"plain must be one of {PLAIN_MODES}, got {self.plain!r}")

    def messages(self, record: Record) -> list[dict] | None:
        """The row as a conversation, or None when it is tokenised as it is (raw text, token ids)."""
        if record.messages is not None:
            return list(record.messages)
        if record.prompt is not None and self.plain == "chat" and not is_rendered(self.tokenizer, record.prompt):
            return [{"role": "user", "content": record.prompt}]  # (a rendered prompt is not rendered twice)
        return None

    def turns(self, record: Record) -> list[int]:
        """Positions in `messages(record)` of the assistant turns to answer ([0] for a one-turn prompt):
        every one with a user message before it (a greeting before the first user turn answers nothing)."""
        messages = self.messages(record)
        if messages is None:
            return [0]
        roles = [m["role"] for m in messages]
        turns = [i for i in assistant_turns(messages) if "user" in roles[:i]]
        if not turns:
            where = record.where or f"row {record.index}"
            raise SourceError(f"{where}: the conversation has no user message to answer")
        return turns

    def num_turns(self, record: Record) -> int:
        return len(self.turns(record))

    def ids(self, record: Record, answers: list[str] = ()) -> list[int]:
        """Token ids of the prompt of turn len(answers) + 1, the earlier assistant turns being `answers`."""
        where = record.where or f"row {record.index}"
        if record.input_ids is not None:
            return list(record.input_ids)
        if self.tokenizer is None:
            raise SourceError(f'{where}: a text prompt needs a tokenizer in the target folder (or give "input_ids")')
        messages = self.messages(record)
        if messages is None:
            ids = encode_text(self.tokenizer, record.prompt)
        else:
            ids = self._conversation_ids(messages, self.turns(record), list(answers), where)
        if not ids:
            raise SourceError(f"{where}: the prompt tokenizes to nothing")
        return ids

    def _conversation_ids(self, messages: list[dict], turns: list[int], answers: list[str], where: str) -> list[int]:
        if len(answers) >= len(turns):
            raise ValueError(f"{where}: {len(answers)} answers given for a conversation of {len(turns)} turns")
        if self.template is None:
            raise SourceError(
                f"{where}: a conversation needs a chat template, and none is in use (the tokenizer has none, "
                "or --chat-template none): pass --chat-template FILE"
            )
        for turn, answer in zip(turns, answers):
            messages[turn] = {"role": "assistant", "content": answer}
        try:
            text = render(self.tokenizer, self.template, messages[: turns[len(answers)]], add_generation_prompt=True)
        except ChatTemplateError as err:
            raise SourceError(f"{where}: {err}") from None
        # As `generate` tokenises its conversations (chat.conversation_tokens): the template writes
        # BOS itself when the target wants one, so the prompts match the data the drafter learnt from.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
