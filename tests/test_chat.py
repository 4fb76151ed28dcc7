"""Loss masks from chat templates: written locally as Jinja, rendered with a tiny local BPE."""

from __future__ import annotations

import copy
import hashlib

import pytest
from fixtures import tiny_tokenizer
from tokenizers import AddedToken, processors

from draftsmith.distill.chat import (
    ChatTemplateError,
    check_template,
    conversation_tokens,
    render,
    resolve_chat_template,
    special_token_ids,
    template_hash,
)

# Templates in the style of the real ones (raw strings: Jinja itself turns '\n' into a newline).
LLAMA3 = (
    r"{% for message in messages %}"
    r"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    r" + message['content'] | trim + '<|eot_id|>' %}"
    r"{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
    r"{{ content }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    r"{{ bos_token }}"
    r"{% if messages[0]['role'] == 'system' %}"
    r"{% set system = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    r"{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    r"{% for message in loop_messages %}"
    r"{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    r"{% endif %}"
    r"{% if message['role'] == 'user' %}"
    r"{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    r"{% else %}{{ message['content'] + eos_token }}{% endif %}"
    r"{% endfor %}"
)
# ChatML again, with the trained text marked by {% generation %} blocks (HF's assistant mask).
CHATML_GENERATION = (
    r"{% for message in messages %}"
    r"{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    r"{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Past answers are replaced (as templates that drop earlier reasoning do): not prefix-stable.
HIDES_PAST_ANSWERS = (
    r"{% for message in messages %}"
    r"{% if message['role'] == 'assistant' and not loop.last %}"
    r"{{ '<|im_start|>assistant\n(earlier answer)<|im_end|>\n' }}"
    r"{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The turn ends with END_TOKEN, to be replaced by an added token, special or not.
PLAIN_END = (
    r"{% for message in messages %}{{ message['role'] + ':\n' + message['content'] + 'END_TOKEN\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)
# The generation prompt ends in a space, so a byte-level BPE glues it to the first word.
STRADDLE = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + ': ' + message['content'] + '<|im_end|>' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant: ' }}{% endif %}"
)

END = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "mistral": "</s>"}
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL}

SINGLE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
MULTI = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six, café ☕\nsecond line"},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}] + MULTI
CONVERSATIONS = {"single": SINGLE, "multi": MULTI, "system": WITH_SYSTEM}


@pytest.fixture(scope="module")
def tok():
    """The toy byte-level BPE plus the special tokens of the templates above (on a copy: the
    toy tokenizer is cached and shared with other tests). Like Llama's, it adds BOS when asked to
    add special tokens: the templates write BOS themselves, so it must not be added twice."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = None  # each test names its template
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|im_start|>",
                "<|im_end|>",
            ]
        }
    )
    tokenizer.add_tokens(["<end>"])  # added, not special
    # Added and marked special, but not in the special-tokens map (how Llama 3 ships <|eot_id|>).
    tokenizer.add_tokens([AddedToken("<|turn_end|>", special=True)])
    return tokenizer


def masked_runs(tok, ids, mask) -> list[str]:
    """Decode each maximal run of trained tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run, skip_special_tokens=False) for run in runs]


def plain_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_mask_is_assistant_content_plus_end_token(tok, family, conv):
    template, messages = TEMPLATES[family], CONVERSATIONS[conv]
    ids, mask = conversation_tokens(tok, template, messages)
    text = render(tok, template, messages, add_generation_prompt=False)
    assert ids == plain_ids(tok, text)
    assert tok(text)["input_ids"] == [tok.bos_token_id] + ids  # the fixture does add BOS by default...
    assert ids.count(tok.bos_token_id) == (1 if family == "mistral" else 0)  # ...but only the template writes it
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    expected = [m["content"] + END[family] for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == expected
    # The untrained tokens decode to everything else: headers, user/system turns, BOS.
    untrained = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained
    assert "Hello there" not in untrained and "It is 4." not in untrained


def test_templates_write_what_their_family_writes(tok):
    """Guards the fixtures themselves: the masks above are only meaningful on faithful renders."""
    assert render(tok, LLAMA3, SINGLE, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(tok, CHATML, SINGLE, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there<|im_end|>\n"
    )
    assert render(tok, MISTRAL, WITH_SYSTEM, add_generation_prompt=False) == (
        "<s>[INST] You are terse.\n\nWhat is 2+2? [/INST]It is 4.</s>[INST] And 3+3? [/INST]"
        "Six, café ☕\nsecond line</s>"
    )


def test_whitespace_after_the_end_token_is_not_trained(tok):
    ids, mask = conversation_tokens(tok, CHATML, SINGLE)
    # ChatML ends every turn with "<|im_end|>\n": the last token is the newline, untrained,
    # and the one before it is the end token, trained.
    assert tok.convert_ids_to_tokens(ids[-2]) == "<|im_end|>" and mask[-2] == 1
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0


def test_llama3_trims_content_and_the_mask_follows(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded answer \n"}]
    ids, mask = conversation_tokens(tok, LLAMA3, messages)
    assert masked_runs(tok, ids, mask) == ["padded answer<|eot_id|>"]


@pytest.mark.parametrize("first", ["Welcome!", "a", "t", ""])
def test_assistant_turn_first_and_short_contents(tok, first):
    """Turn 0 has no generation prompt to start from, and "a" / "t" / "" also match inside the
    "<|im_start|>assistant" header: the content must still be found where the template put it."""
    messages = [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "t"},
    ]
    for template, end in ((CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")):
        ids, mask = conversation_tokens(tok, template, messages)
        assert masked_runs(tok, ids, mask) == [first + end, end, "t" + end]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_generation_prompt_masks_earlier_turns_only(tok, family):
    template = TEMPLATES[family]
    messages = MULTI[:3]  # ends with a user turn: the prompt of the next answer
    ids, mask = conversation_tokens(tok, template, messages, add_generation_prompt=True)
    text = render(tok, template, messages, add_generation_prompt=True)
    assert ids == plain_ids(tok, text)
    assert masked_runs(tok, ids, mask) == ["It is 4." + END[family]]
    if family != "mistral":  # Mistral has no generation prompt: the text ends at [/INST]
        header = render(tok, template, messages, add_generation_prompt=False)
        assert text != header and text.startswith(header)
    assert mask[-1] == 0


def test_generation_prompt_changes_nothing_before_it(tok):
    """With and without the generation prompt, the shared tokens carry the same mask."""
    ids_gen, mask_gen = conversation_tokens(tok, CHATML, MULTI, add_generation_prompt=True)
    ids, mask = conversation_tokens(tok, CHATML, MULTI)
    assert ids_gen[: len(ids)] == ids and mask_gen[: len(mask)] == mask
    assert len(ids_gen) > len(ids) and not any(mask_gen[len(mask) :])


@pytest.mark.parametrize("end, trained", [("<end>", False), ("<|turn_end|>", True)])
def test_end_token_is_trained_only_if_special(tok, end, trained):
    end_id = tok.convert_tokens_to_ids(end)
    assert end_id != tok.unk_token_id and end_id not in tok.all_special_ids
    assert (end_id in special_token_ids(tok)) == trained
    ids, mask = conversation_tokens(tok, PLAIN_END.replace("END_TOKEN", end), MULTI)
    suffix = end if trained else ""
    assert masked_runs(tok, ids, mask) == ["It is 4." + suffix, "Six, café ☕\nsecond line" + suffix]


def test_straddling_token_is_not_trained(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "the answer"}]
    ids, mask = conversation_tokens(tok, STRADDLE, messages)
    text = render(tok, STRADDLE, messages, add_generation_prompt=False)
    offsets = tok(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    content_start = text.index("the answer")
    straddling = [k for k, (s, e) in enumerate(offsets) if s < content_start < e]
    assert straddling, "fixture: the space before 'the' should be glued to it by the BPE"
    (k,) = straddling
    assert mask[k] == 0 and mask[k + 1] == 1
    # Trained: the rest of the content after the straddling token, and the end token.
    assert masked_runs(tok, ids, mask) == [text[offsets[k][1] : content_start + len("the answer")] + "<|im_end|>"]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_generation_blocks_match_the_prefix_diff(tok, add_generation_prompt):
    messages = WITH_SYSTEM if not add_generation_prompt else WITH_SYSTEM[:4]
    assert render(tok, CHATML_GENERATION, messages, add_generation_prompt=add_generation_prompt) == render(
        tok, CHATML, messages, add_generation_prompt=add_generation_prompt
    )
    from_blocks = conversation_tokens(tok, CHATML_GENERATION, messages, add_generation_prompt=add_generation_prompt)
    from_diff = conversation_tokens(tok, CHATML, messages, add_generation_prompt=add_generation_prompt)
    assert from_blocks == from_diff
    assert any(from_blocks[1])


def test_generation_blocks_decide_what_is_trained(tok):
    """The blocks win over the content + end-token rule: here they leave the end token out."""
    content_only = CHATML_GENERATION.replace(
        r"{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}",
        r"{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}",
    )
    assert content_only != CHATML_GENERATION
    ids, mask = conversation_tokens(tok, content_only, MULTI)
    assert ids == plain_ids(tok, render(tok, CHATML, MULTI, add_generation_prompt=False))
    assert masked_runs(tok, ids, mask) == ["It is 4.", "Six, café ☕\nsecond line"]


def test_template_that_rewrites_history_is_refused(tok):
    with pytest.raises(ChatTemplateError, match="not prefix-stable at turn 1"):
        conversation_tokens(tok, HIDES_PAST_ANSWERS, MULTI)
    # A single answer is the last turn everywhere: nothing is rewritten, the mask works.
    ids, mask = conversation_tokens(tok, HIDES_PAST_ANSWERS, SINGLE)
    assert masked_runs(tok, ids, mask) == ["Hello there<|im_end|>"]


def test_template_that_rewrites_content_is_refused(tok):
    shouting = CHATML.replace("message['content']", "message['content'] | upper")
    with pytest.raises(ChatTemplateError, match="turn 1: its content does not appear verbatim"):
        conversation_tokens(tok, shouting, SINGLE)


def test_syntax_error_is_a_readable_chat_template_error(tok):
    broken = "{# my broken template #}\n{% for message in messages %}{{ message['content'] }}"  # no endfor
    with pytest.raises(ChatTemplateError) as info:
        render(tok, broken, SINGLE, add_generation_prompt=False)
    message = str(info.value)
    assert "{# my broken template #}" in message  # names the template by its first line
    assert "TemplateSyntaxError" in message and "endfor" in message
    with pytest.raises(ChatTemplateError):
        check_template(tok, broken, SINGLE)
    with pytest.raises(ChatTemplateError):
        conversation_tokens(tok, broken, SINGLE)


def test_raise_exception_in_template_is_a_chat_template_error(tok):
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate") as info:
        check_template(tok, MISTRAL, two_users)
    assert "['user', 'user']" in str(info.value)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        conversation_tokens(tok, MISTRAL, two_users + [{"role": "assistant", "content": "c"}])
    check_template(tok, MISTRAL, MULTI[:3])  # a good conversation passes


def test_no_template_is_an_error(tok):
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        check_template(tok, None, SINGLE)


def test_resolve_chat_template(tok, tmp_path):
    assert tok.chat_template is None
    assert resolve_chat_template("auto", tok) is None
    assert resolve_chat_template("none", tok) is None
    own = copy.deepcopy(tok)
    own.chat_template = CHATML
    assert resolve_chat_template("auto", own) == CHATML
    assert resolve_chat_template("none", own) is None
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3, encoding="utf-8")
    assert resolve_chat_template(str(path), tok) == LLAMA3
    missing = tmp_path / "nope.jinja"
    with pytest.raises(ChatTemplateError, match="--target-template: chat template file .*nope.jinja.* does not exist"):
        resolve_chat_template(str(missing), tok, where="--target-template")


def test_template_hash():
    assert template_hash(None) is None
    assert template_hash(CHATML) == hashlib.sha256(CHATML.encode("utf-8")).hexdigest()
    assert template_hash(CHATML) != template_hash(CHATML + " ")
