"""Chat templates for self-distillation: render conversations and find the tokens to train on,
using only the tokenizer's own chat template (no hard-coded separators, no per-family code).

What is trained. In a conversation, the loss mask is 1 exactly on the tokens of every assistant
message's content and on the end-of-turn token the template writes after it (<|eot_id|>,
<|im_end|>, </s>, ...): the drafter must learn to predict where the target stops. Everything
else is 0: system and user turns, role headers, the generation prompt, and any text after the
end-of-turn token (the "\\n" after <|im_end|>).

How the mask is found (the "prefix diff" method):
  1. Render the whole conversation once to text (with the generation prompt when asked).
  2. For each assistant turn i, render messages[:i] with add_generation_prompt=True and
     messages[:i+1] without it. Both must be prefixes of the full text, otherwise the template
     rewrites earlier turns (e.g. drops the reasoning of past answers) and the turn cannot be
     located: ChatTemplateError "chat template is not prefix-stable at turn i". The assistant
     segment is full_text[len(render(messages[:i], gen)) : len(render(messages[:i+1]))].
     (For i = 0 the segment starts at 0: an empty conversation cannot be rendered.)
  3. Inside the segment the message content is found verbatim (or stripped, for templates that
     `|trim` it); not found -> ChatTemplateError. Text of the segment before the content (a
     header the generation prompt did not write) is not trained.
  4. After the content, the suffix is trained up to and including the first special token (an id
     in `tokenizer.all_special_ids`, or an added token marked special: `special_token_ids`). If
     the suffix holds no special token, only the content is trained.
  5. The full text is tokenized once, `add_special_tokens=False` (the template writes BOS itself
     when it wants one), with offsets. The ids are therefore exactly `tokenizer(full_text,
     add_special_tokens=False).input_ids`.

Straddling tokens. A token is trained when its START offset lies inside a trained character span.
A token that starts in the header and runs into the content (e.g. " Hello" after a header
ending in a space, with a byte-level BPE) is NOT trained: training it would teach the drafter to
produce text the prompt already holds. A token that starts inside the content and runs past its
end is trained. The same rule splits multi-byte characters cleanly (their byte tokens share one
start offset). Real templates rarely straddle: headers end in a special token or a newline.

Templates with `{% generation %}` blocks mark the trained text themselves; for them the mask
comes from Hugging Face's `return_assistant_tokens_mask=True` instead. HF marks every token that
OVERLAPS a generation block, so there a straddling token at the start is trained.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from pathlib import Path

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A chat template that cannot be used on a conversation; the message says which and why."""


def resolve_chat_template(spec: str, tokenizer, *, where: str = "--chat-template") -> str | None:
    """ "auto": the tokenizer's own template (None when it has none); "none": None (plain-prompt
    data); anything else: the path of a Jinja file. `where` names the option in error messages."""
    if spec == "none":
        return None
    if spec == "auto":
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # a tokenizer with named templates ("default", "tool_use", ...)
            if "default" not in template:
                raise ChatTemplateError(
                    f"{where} auto: the tokenizer has named chat templates {sorted(template)} but no 'default'; "
                    "save the one to use to a file and pass its path"
                )
            template = template["default"]
        return template or None
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"{where}: chat template file {spec!r} does not exist; expected 'auto' (the tokenizer's own), "
            "'none', or the path of a Jinja template file"
        )
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ChatTemplateError(f"{where}: chat template file {spec!r} is empty")
    return text


def template_hash(template: str | None) -> str | None:
    """sha256 hex of the template text (provenance: data rendered with another template differs)."""
    return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()


def render(tokenizer, template: str, messages, *, add_generation_prompt: bool) -> str:
    """The conversation as text, exactly as the template writes it."""
    if template is None:
        raise ChatTemplateError(
            "no chat template: the tokenizer has none, and chat data needs one; pass --chat-template FILE"
        )
    messages = list(messages)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as err:  # jinja syntax/undefined errors, raise_exception(), TypeError in filters...
        raise ChatTemplateError(
            f"chat template {_first_line(template)} failed to render a conversation of roles "
            f"{[m.get('role') for m in messages]}: {_reason(err)}"
        ) from err
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template {_first_line(template)} rendered {type(text).__name__}, expected text")
    return text


def check_template(tokenizer, template, messages) -> None:
    """Render `messages` once (with the generation prompt when it does not end with an assistant
    turn), so that a broken template fails before hours of generation, with a clear message."""
    messages = list(messages)
    if not messages:
        raise ChatTemplateError("cannot check a chat template on an empty conversation")
    render(tokenizer, template, messages, add_generation_prompt=messages[-1]["role"] != "assistant")


def conversation_tokens(
    tokenizer, template: str, messages, *, add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the rendered conversation; see the module docstring for the mask.

    add_generation_prompt=True builds the prompt of the NEXT assistant turn: the ids end with the
    generation prompt and the mask covers the earlier assistant turns only.
    """
    messages = list(messages)
    if not messages:
        raise ChatTemplateError("cannot tokenize an empty conversation")
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer: loss masks need character offsets"
        )
    if template is not None and _GENERATION_BLOCK.search(template):
        return _generation_block_tokens(tokenizer, template, messages, add_generation_prompt)

    text = render(tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = list(enc["input_ids"])
    starts = [start for start, _ in enc["offset_mapping"]]
    ends = [end for _, end in enc["offset_mapping"]]
    special = special_token_ids(tokenizer)

    spans = []  # trained character spans [a, b), in order
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        seg_start = len(_prefix(tokenizer, template, messages[:i], True, text, i)) if i else 0
        seg_end = len(_prefix(tokenizer, template, messages[: i + 1], False, text, i))
        c0, c1 = _locate_content(tokenizer, template, messages, i, text, seg_start, seg_end)
        stop = c1
        # The first special token that starts after the content and inside the segment ends the turn.
        for k in range(bisect.bisect_left(starts, c1), len(ids)):
            if starts[k] >= seg_end:
                break
            if ids[k] in special:
                stop = ends[k]
                break
        spans.append((c0, stop))

    mask = [0] * len(ids)
    for a, b in spans:
        for k in range(bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)):
            mask[k] = 1
    return ids, mask


def _prefix(tokenizer, template, head, add_generation_prompt, text, turn) -> str:
    rendered = render(tokenizer, template, head, add_generation_prompt=add_generation_prompt)
    if not text.startswith(rendered):
        what = "the generation prompt before it" if add_generation_prompt else "the turn itself"
        raise ChatTemplateError(
            f"chat template is not prefix-stable at turn {turn}: rendering the conversation up to "
            f"{what} ({len(head)} messages) is not a prefix of the whole conversation's rendering, so "
            f"the turn cannot be located (the template {_first_line(template)} rewrites earlier turns, "
            "e.g. drops past reasoning); use a template that renders history unchanged, or one with "
            "{% generation %} blocks"
        )
    return rendered


# Stands in for the content to learn where the template puts it: no whitespace (survives |trim),
# nothing a template would special-case.
_SENTINEL = "DRAFTSMITHCONTENTSENTINEL7f3a"


def _locate_content(tokenizer, template, messages, turn, text, seg_start, seg_end) -> tuple[int, int]:
    """Character span of assistant `turn`'s content inside its segment of `text`."""
    content = messages[turn]["content"]
    segment = text[seg_start:seg_end]
    # Verbatim first; stripped for templates that `|trim` the content (Llama 3 does).
    for needle in (content, content.strip()):
        k = segment.find(needle)
        if k < 0:
            continue
        if not needle or segment.find(needle, k + 1) >= 0:
            # Ambiguous: an empty answer is "found" anywhere, a short one like "a" also in the role
            # header. Render the turn with a sentinel content to learn how much header precedes it.
            header = _header_length(tokenizer, template, messages, turn, text, seg_start)
            if header is not None and segment.startswith(needle, header):
                k = header
        return seg_start + k, seg_start + k + len(needle)
    raise ChatTemplateError(
        f"assistant turn {turn}: its content does not appear verbatim in the chat template's rendering "
        f"of that turn ({segment[:80]!r}); the template {_first_line(template)} rewrites assistant "
        "content, so the tokens to train cannot be found"
    )


def _header_length(tokenizer, template, messages, turn, text, seg_start) -> int | None:
    probe = list(messages[:turn]) + [{"role": "assistant", "content": _SENTINEL}]
    try:
        rendered = render(tokenizer, template, probe, add_generation_prompt=False)
    except ChatTemplateError:
        return None
    k = rendered.find(_SENTINEL)
    if k < seg_start or rendered[:seg_start] != text[:seg_start]:
        return None
    return k - seg_start


def _generation_block_tokens(tokenizer, template, messages, add_generation_prompt):
    try:
        out = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
    except Exception as err:
        raise ChatTemplateError(
            f"chat template {_first_line(template)} (with {{% generation %}} blocks) failed to render a "
            f"conversation of roles {[m.get('role') for m in messages]}: {_reason(err)}"
        ) from err
    return list(out["input_ids"]), list(out["assistant_masks"])


def special_token_ids(tokenizer) -> set[int]:
    """Ids that can end an assistant turn: `all_special_ids` plus every added token marked special.
    The second part matters: in transformers 5 an added token with special=True that is not in the
    special-tokens map (Llama 3's <|eot_id|> ships that way) is missing from `all_special_ids`."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return ids


def _first_line(template: str) -> str:
    line = next((ln.strip() for ln in template.splitlines() if ln.strip()), "")
    return repr(line[:60] + ("..." if len(line) > 60 else ""))


def _reason(err: BaseException) -> str:
    lineno = getattr(err, "lineno", None)  # jinja's TemplateSyntaxError
    where = f" (template line {lineno})" if lineno else ""
    return f"{type(err).__name__}{where}: {err}"
