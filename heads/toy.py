"""Toy models built locally in seconds: random weights, a small BPE, no download.

Used by the tests (tiny configs of four families) and by `draftsmith make-toy`, which writes a
target/draft pair and a prompt file so that `draftsmith eval` can run on any machine.

Random models need care to be useful: with the default initialisation every next-token
distribution is near-uniform, and any two models accept each other's tokens at random.
Here the output head is scaled up so that distributions are peaked (top token ~0.2-0.9), and
the draft is a noisy copy of the target, so that acceptance lands between 0.3 and 0.7 and
every branch of the verification rule (accept, residual, bonus) is exercised. Toy models
measure the decoder, not a drafter: real acceptance needs a trained target.
"""

from __future__ import annotations

import functools
import inspect

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 320  # 256 byte symbols + 3 specials + merges
FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox")

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gpt_neox": GPTNeoXConfig}

# Real text every Python has: the sources of two standard-library modules.
CORPUS = inspect.getsource(inspect) + inspect.getsource(functools)


def tiny_config(
    family: str,
    *,
    hidden: int = 48,
    layers: int = 2,
    init: float = 0.05,
    vocab: int = VOCAB,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 512,
):
    """A small config of `family` (the tests' defaults; the decoder bench sizes its random target
    with the keywords). `intermediate` defaults to 2 x hidden; `kv_heads` is ignored by gpt_neox."""
    cls = _CONFIGS[family]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family != "gpt_neox":
        kwargs["num_key_value_heads"] = kv_heads
    if family == "mistral":
        kwargs["sliding_window"] = None
    return cls(**kwargs)


HEAD_SCALE = 8.0  # makes the random model's distributions peaked
DRAFT_NOISE = 0.3  # relative weight noise of the draft: alpha ~0.3-0.6


def tiny_model(family: str, seed: int = 0, head_scale: float = HEAD_SCALE, **kwargs):
    """A random model of `tiny_config(family, **kwargs)` with its output head scaled by `head_scale`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    model.generation_config.eos_token_id = None  # tests decide where decoding stops
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_pair(family: str, seed: int = 0):
    """A target (2 layers, hidden 48) and a draft that is a noisy copy of it (same vocab)."""
    target = tiny_model(family, seed=seed)
    draft = tiny_model(family, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            if "norm" not in name:
                noise = torch.randn(weight.shape, generator=gen) * DRAFT_NOISE * weight.std()
                weight.add_(noise)
    return target, draft


# A Mistral-style chat template over the toy tokenizer's own specials, so that the chat paths
# (`draftsmith generate` on conversations, loss masks) run on toy models too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with VOCAB tokens trained on a few stdlib modules (a fresh copy each
    call: callers may add tokens or change the template without touching anyone else's)."""
    import copy

    return copy.deepcopy(_trained_tiny_tokenizer())


@functools.lru_cache(maxsize=1)
def _trained_tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )


def write_toy(out_dir, family: str = "llama", seed: int = 0, num_prompts: int = 16):
    """Write `out_dir/{target,draft}` (models + tokenizer), `out_dir/prompts.jsonl` and
    `out_dir/chats.jsonl`.

    Prompts are three-line windows of the standard-library text the tokenizer was trained on;
    chats are two-turn ShareGPT-style conversations made of the same lines.
    """
    import json
    from pathlib import Path

    out_dir = Path(out_dir)
    target, draft = tiny_pair(family, seed)
    tok = tiny_tokenizer()
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        paths[name] = out_dir / name
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    step = max(1, (len(lines) - 3) // num_prompts)
    rows = [json.dumps({"prompt": "\n".join(lines[i : i + 3]) + "\n"}) for i in range(0, step * num_prompts, step)]
    paths["prompts"] = out_dir / "prompts.jsonl"
    paths["prompts"].write_text("\n".join(rows) + "\n", encoding="utf-8")
    chats = []
    for i in range(0, step * num_prompts, step):
        turns = [
            ("human", "Continue:\n" + lines[i]),
            ("gpt", lines[i + 1]),
            ("human", "And then?"),
            ("gpt", lines[i + 2]),
        ]
        chats.append(json.dumps({"conversations": [{"from": who, "value": text} for who, text in turns]}))
    paths["chats"] = out_dir / "chats.jsonl"
    paths["chats"].write_text("\n".join(chats) + "\n", encoding="utf-8")
    return paths


def make_toy(out_dir, family: str = "llama", seed: int = 0):
    """`write_toy` into `out_dir`, replacing what is there (`draftsmith make-toy`). Built beside
    the destination, then renamed: an interrupted run leaves no half-written pair."""
    import shutil
    import tempfile
    from pathlib import Path

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_toy(tmp, family=family, seed=seed)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
