"""EAGLE-3 / P-EAGLE heads with per-head q/k RMSNorm (`qk_norm`, speculators' `qwen3` draft layer):
the attention is Qwen3's, the option round-trips through draftsmith's layout and the speculators
layout, and every speculators config field the loader cannot honour is refused in one line naming
it. speculators itself judges the exports and its own checkpoints in tests/test_speculators_interop.py."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import tiny_model
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from draftsmith.heads.eagle import (
    VARIANT_FLAGS,
    EagleError,
    EagleHead,
    PEagleHead,
    export_eagle,
    load_eagle,
    save_eagle,
)
from draftsmith.train.eagle import EagleRecipe
from draftsmith.train.peagle import PEagleRecipe

L, MASK = 4, 319  # target layers; P-EAGLE's mask token, the toy vocabulary's last id
QK = ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=L, heads=4, kv_heads=2)


def trained(head):
    """Every tensor off its init (the q/k gains too: at 1 a dropped norm weight would not show)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else 0.05))
    return head.eval()


def outputs(head, T: int = 7):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 320, (2, T), generator=gen)
    aux = torch.randn(2, T, head.config.num_aux * head.config.hidden_size, generator=gen)
    with torch.no_grad():
        return head(ids, head.project(aux), position_ids=torch.arange(T) + 5)


def test_the_attention_is_qwen3s_with_the_eagle3_projections(target):
    """Reference: transformers' own Qwen3Attention with q/k/v reading 2H, as speculators patches it."""
    head = trained(EagleHead.for_target(target, qk_norm=True))
    c, attn = head.config, head.layers[0].self_attn
    assert tuple(attn.q_norm.weight.shape) == tuple(attn.k_norm.weight.shape) == (c.head_dim,)
    layer = Qwen3Config(**{k: v for k, v in c.layer_config().to_dict().items() if k not in ("model_type", "mlp_bias")})
    layer._attn_implementation = "eager"
    ref = Qwen3Attention(layer, layer_idx=0).eval()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        setattr(ref, name, getattr(attn, name))  # shared modules: [.., 2H] inputs as speculators' first layer
    T = 6
    x = torch.randn(2, T, 2 * c.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = head.rotary_emb(x, torch.arange(T)[None] + 3)
    causal = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad():
        ours = attn(x, cos, sin, causal, None)
        theirs, _ = ref(x, (cos, sin), causal)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        attn.qk_norm = False  # the same weights without the norms: a different function
        assert not torch.allclose(attn(x, cos, sin, causal, None), theirs, atol=1e-3)


def test_the_option_round_trips_through_every_layout(target, tmp_path):
    head = trained(EagleHead.for_target(target, qk_norm=True, fc_norm=True, norm_before_residual=True))
    expected = outputs(head)
    again = load_eagle(save_eagle(head, tmp_path / "hf"), target=target)
    assert again.config.qk_norm and all(torch.equal(a, b) for a, b in zip(outputs(again), expected))
    out = export_eagle(head, tmp_path / "vllm", "vllm")
    assert set(QK) <= set(load_file(str(out / "model.safetensors")))
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    # speculators builds Qwen3DecoderLayer (q/k norms) from exactly this; full attention, no window
    assert (layer["model_type"], layer["architectures"], layer["layer_types"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        ["full_attention"],
    )
    assert "mlp_bias" not in layer and layer["head_dim"] == head.config.head_dim
    served = load_eagle(out, target=target)
    assert served.config.qk_norm and served.config.fc_norm and served.config.norm_before_residual
    assert all(torch.equal(a, b) for a, b in zip(outputs(served), expected))
    plain = export_eagle(trained(EagleHead.for_target(target)), tmp_path / "plain", "vllm")
    assert json.loads((plain / "config.json").read_text())["transformer_layer_config"]["model_type"] == "llama"
    assert not load_eagle(plain).config.qk_norm and not set(QK) & set(load_file(str(plain / "model.safetensors")))
    with pytest.raises(EagleError, match=r"export to 'sglang'.*qk_norm.*--format vllm"):
        export_eagle(trained(EagleHead.for_target(target, qk_norm=True)), tmp_path / "sglang", "sglang")


def test_a_peagle_head_keeps_its_qk_norms_in_both_layouts(target, tmp_path):
    head = PEagleHead.for_target(target, mask_token_id=MASK, num_depths=3, aux_layer_ids=[1, 2, 3], qk_norm=True)
    head = trained(head)
    expected = outputs(head)
    for folder in (save_eagle(head, tmp_path / "hf"), export_eagle(head, tmp_path / "vllm", "vllm")):
        back = load_eagle(folder, target=target)
        assert isinstance(back, PEagleHead) and back.config.qk_norm, folder
        assert all(torch.equal(a, b) for a, b in zip(outputs(back), expected)), folder
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["transformer_layer_config"]["model_type"] == "qwen3"


def test_the_trainers_defaults_follow_speculators_trainer(tmp_path):
    """speculators' trainer: a llama layer for eagle3, a qwen3 one (q/k norms) for peagle."""
    common = dict(target="t", data="d", out=str(tmp_path / "o"))
    assert EagleRecipe(**common).qk_norm is False and PEagleRecipe(**common).qk_norm is True
    with pytest.raises(ValueError, match="qk_norm = true is an eagle3 option"):
        EagleRecipe(**common, version="eagle1", qk_norm=True)


def test_eagle1_has_no_qk_norm(target):
    with pytest.raises(EagleError, match="qk_norm and target_hidden_size are EAGLE-3 options"):
        EagleHead.for_target(target, "eagle1", qk_norm=True)


def _speculators_folder(target, tmp_path, name: str, **options) -> tuple:
    """A speculators-layout export to edit: (folder, config.json as a dict, weights)."""
    folder = export_eagle(trained(EagleHead.for_target(target, **options)), tmp_path / name, "vllm")
    return folder, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _rewrite(folder, config: dict, state: dict | None = None) -> None:
    (folder / "config.json").write_text(json.dumps(config))
    if state is not None:
        save_file(state, str(folder / "model.safetensors"))


def test_layer_types_the_loader_cannot_build_are_refused_naming_the_key(target, tmp_path):
    folder, config, state = _speculators_folder(target, tmp_path, "types")
    for key, value, message in (
        ("model_type", "mistral", r"transformer_layer_config.model_type='mistral'; .*'llama' or 'qwen3'"),
        ("mlp_bias", True, r"transformer_layer_config.mlp_bias=True; draftsmith's EAGLE-3 MLP has no biases"),
    ):
        _rewrite(folder, {**config, "transformer_layer_config": {**config["transformer_layer_config"], key: value}})
        with pytest.raises(EagleError, match=message) as err:
            load_eagle(folder)
        assert str(folder / "config.json") in str(err.value) and "\n" not in str(err.value)
    # speculators reads a layer without model_type as qwen3: it then needs the q/k norms this file lacks
    untyped = {k: v for k, v in config["transformer_layer_config"].items() if k != "model_type"}
    _rewrite(folder, {**config, "transformer_layer_config": untyped})
    with pytest.raises(EagleError, match=r"missing \[.*q_norm.*\].*come with a qwen3 .*'untyped', qk_norm=True"):
        load_eagle(folder)
    # q/k norm weights under a llama layer: unexpected tensors, not silently dropped
    head_dim = config["transformer_layer_config"]["head_dim"]
    _rewrite(folder, config, {**state, **{k: torch.ones(head_dim) for k in QK}})
    with pytest.raises(EagleError, match=r"unexpected \[.*k_norm.*q_norm.*\].*this one is 'llama', qk_norm=False"):
        load_eagle(folder)


def test_every_variant_flag_is_read_or_refused_never_ignored(target, tmp_path):
    folder, config, state = _speculators_folder(target, tmp_path, "flags")
    for flag in VARIANT_FLAGS:  # a value that is not a bool: named, with the file
        _rewrite(folder, {**config, flag: "yes"})
        with pytest.raises(EagleError, match=rf"config.json'.*{flag}='yes'; expected true or false"):
            load_eagle(folder)
    _rewrite(folder, {**config, "norm_before_fc": True, "fc_norm": True}, state)
    with pytest.raises(EagleError, match="norm_before_fc and fc_norm are exclusive"):
        load_eagle(folder)
    H = target.config.hidden_size
    # vLLM reads target_hidden_size, speculators' Eagle3DraftModel ignores it: its fc over 3H is refused
    _rewrite(folder, {**config, "target_hidden_size": 2 * H})
    with pytest.raises(
        EagleError, match=rf"fc.weight is \[{H}, {3 * H}\].*target_hidden_size={2 * H}.*\[{H}, {6 * H}\]"
    ):
        load_eagle(folder)
    _rewrite(folder, {**config, "target_hidden_size": H})  # the draft's own width written out: loads
    assert load_eagle(folder).config.aux_hidden_size == H
    _rewrite(folder, {k: v for k, v in config.items() if k != "eagle_aux_hidden_state_layer_ids" and k != "draftsmith"})
    with pytest.raises(EagleError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle(folder)
    # every flag as written is the head's
    on = {"norm_before_residual": True, "fc_norm": True, "norm_output": True, "embed_requires_grad": True}
    _rewrite(folder, {**config, **on}, {**state, **{f"fc_norm.{i}.weight": torch.ones(H) for i in range(3)}})
    head = load_eagle(folder)
    assert all(getattr(head.config, k) == v for k, v in on.items()) and head.embed_tokens.weight.requires_grad
