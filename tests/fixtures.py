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
