"""Test fixtures: the toy models of `draftsmith.heads.toy`, re-exported for the tests."""

from draftsmith.heads.toy import (  # noqa: F401
    CORPUS,
    DRAFT_NOISE,
    FAMILIES,
    HEAD_SCALE,
    VOCAB,
    tiny_config,
    tiny_model,
    tiny_pair,
    tiny_tokenizer,
    write_toy,
)


def save_pair(tmp_path, family: str = "llama", seed: int = 0):
    """Write a target and a draft with the tokenizer to `tmp_path/{target,draft}`."""
    paths = write_toy(tmp_path, family, seed)
    return paths["target"], paths["draft"]


def windowed_model(family: str, window: int = 5, seed: int = 0):
    """A tiny target with sliding-window attention narrower than the tests' sequences: mistral
    slides on every layer (one mask); qwen2 has a full layer, then sliding ones (a mask per kind)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=3)
    config.sliding_window = window
    if family == "qwen2":
        config.use_sliding_window, config.layer_types = True, ["full_attention"] + ["sliding_attention"] * 2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.generation_config.eos_token_id = None
    return model.eval()
