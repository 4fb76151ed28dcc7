"""Targets whose config holds one RoPE per layer type (Gemma 3, OLMo 3): a head records and applies
the target's full-attention RoPE (its layers attend to the whole context, as those do), loads back
against the very target it was built for, and its server export carries that base."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dflash_formats import export_dflash, load_dflash, save_dflash
from draftsmith.heads.eagle import EagleHead, export_eagle, load_eagle, save_eagle

FULL_THETA = {"olmo3": 500_000.0, "gemma3_text": 1_000_000.0}  # transformers' defaults for the full-attention layers


def tiny(model_type: str):
    config = AutoConfig.for_model(
        model_type,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=320,
        max_position_embeddings=512,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", FULL_THETA)
def test_heads_take_the_full_attention_rope_and_keep_it_through_save_and_export(model_type, tmp_path):
    target = tiny(model_type)
    theta = FULL_THETA[model_type]
    assert set(target.config.rope_parameters) == {"full_attention", "sliding_attention"}  # the per-type form
    expected = 1.0 / theta ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12)
    eagle = EagleHead.for_target(target)
    dflash = DFlashHead.for_target(target, block_size=4, mask_token_id=319, aux_layer_ids=[1, 2, 3])
    for head in (eagle, dflash):
        assert head.config.rope_parameters == {"rope_type": "default", "rope_theta": theta}
        torch.testing.assert_close(head.rotary_emb.inv_freq, expected)  # the base it applies, not 10,000
    save_eagle(eagle, tmp_path / "eagle")
    save_dflash(dflash, tmp_path / "dflash")
    assert load_eagle(tmp_path / "eagle", target=target).config.rope_parameters["rope_theta"] == theta
    assert load_dflash(tmp_path / "dflash", target=target).config.rope_parameters["rope_theta"] == theta
    export_eagle(eagle, tmp_path / "eagle-vllm", "vllm")
    export_dflash(dflash, tmp_path / "dflash-vllm")
    for folder in ("eagle-vllm", "dflash-vllm"):
        config = json.loads((tmp_path / folder / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert layer.get("rope_theta", layer.get("rope_parameters", {}).get("rope_theta")) == theta, folder
