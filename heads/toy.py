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

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gpt_neox": GPTNeoXConfig}

# The decoder families users target, as transformers names them (`AutoConfig.for_model`), with the
# keys that make each tiny and keep its shape: its layer kinds (4 layers, sliding / full / linear
# attention / convolutions / SSMs mixed as the family mixes them), experts, MLA. Hidden 64, 4 heads
# of 16, 2 KV heads unless a family says otherwise.
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 16}
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_ROUTED = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
MATRIX = {
    **dict.fromkeys(["llama", "qwen2", "qwen3", "phi3", "olmo2", "granite", "glm4", "smollm3", "seed_oss"], {}),
    **dict.fromkeys(["hunyuan_v1_dense", "ernie4_5", "ministral3"], {}),
    "qwen3_moe": _MOE,
    "mistral": {"sliding_window": 8},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"sliding_window": 8},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    "deepseek_v3": {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    }
    | {"head_dim": 8, "num_key_value_heads": 4, "n_group": 1, "topk_group": 1, **_ROUTED},
    "cohere2": {"sliding_window": 8},
    "glm4_moe": {"n_group": 1, "topk_group": 1, **_ROUTED},
    "exaone4": {"sliding_window": 8},
    "gemma3_text": {"layer_types": _ALTERNATING, "sliding_window": 8},
    "olmo3": {"layer_types": _ALTERNATING, "sliding_window": 8},
    "gemma4_text": {"layer_types": _ALTERNATING, "sliding_window": 8, "global_head_dim": 32}
    | {"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB},
    # hybrids: recurrent layers beside attention (decoding/recurrent.py)
    "qwen3_5_text": _LINEAR,
    "qwen3_next": {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32},
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2, "block_dim": 64, "block_ff_dim": 128},
    "bamba": {"attn_layer_indices": [1], **_MAMBA},
    "falcon_h1": {**_MAMBA, "mamba_d_head": 16, "mamba_d_ssm": 64},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    | {"shared_intermediate_size": 64, **_MAMBA},
    "nemotron_h": {"layers_block_type": ["mamba", "attention", "mlp", "mamba"], "mamba_num_heads": 4}
    | {"mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16, "chunk_size": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}
    | {"num_experts": 2, "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_expand": 2},
    "olmo_hybrid": {},
    # MiniMax keeps its lightning-attention state in a cache class of its own: the decoder refuses it
    "minimax": {"layer_types": ["linear_attention", "full_attention"] * 2, "num_local_experts": 2}
    | {"num_experts_per_tok": 1, "block_size": 16},
}
FAMILIES = tuple(_CONFIGS)  # the tests' classic four
TOY_FAMILIES = (*FAMILIES, *sorted(set(MATRIX) - set(_CONFIGS)))  # what `draftsmith make-toy --family` builds

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
    with the keywords). `intermediate` defaults to 2 x hidden; `kv_heads` is ignored by gpt_neox.
    A family of `MATRIX` beyond the four classic ones: `matrix_config`."""
    if family not in _CONFIGS:
        return matrix_config(family, vocab=vocab, init=init, max_positions=max_positions)
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


def matrix_config(family: str, *, vocab: int = VOCAB, init: float = 0.05, max_positions: int = 512):
    """A tiny config of a `MATRIX` family: 4 layers of hidden 64 with the family's own layer kinds."""
    from transformers import AutoConfig

    if family not in MATRIX:
        raise ValueError(f"family {family!r}: expected one of {', '.join(sorted(MATRIX))}")
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    common |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions)
    common |= dict(tie_word_embeddings=False, initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return AutoConfig.for_model(family, **(common | MATRIX[family]))


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
