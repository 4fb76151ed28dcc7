"""Medusa heads: identity at init, parameter counts, save/load, the two export layouts, checks."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from fixtures import tiny_model
from safetensors.torch import load_file, save_file

from draftsmith.heads.medusa import MedusaConfig, MedusaError, MedusaHeads, export_medusa, load_medusa, save_medusa
from draftsmith.heads.provenance import ProvenanceError, TargetRecord, check_target_provenance

H, V = 48, 320


@pytest.fixture(scope="module")
def targets():
    cache = {}

    def get(family: str = "llama", seed: int = 0):
        if (family, seed) not in cache:
            cache[family, seed] = tiny_model(family, seed=seed)
        return cache[family, seed]

    return get


def hidden(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, H, generator=torch.Generator().manual_seed(seed))


def trained(heads: MedusaHeads, seed: int = 1) -> MedusaHeads:
    """Move every own parameter off its init, so that round trips compare something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return heads.eval()


def make(target, num_heads=3, num_layers=2, share=False) -> MedusaHeads:
    return MedusaHeads.for_target(
        target, num_heads, num_layers, share, target_name_or_path="toy/target", data_hash="d" * 8
    )


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
def test_every_head_equals_the_target_lm_head_at_init(targets, family, share):
    target = targets(family)
    heads = make(target, share=share)
    with torch.no_grad():  # the target's real last (post-norm) hidden states
        ids = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(0))
        out = target(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1])
    assert logits.shape == (3, 2, 6, V)
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
def test_parameter_counts_and_the_shared_weight_stays_outside(targets, share):
    K, L = 3, 2
    heads = make(targets(), K, L, share)
    n = sum(p.numel() for p in heads.parameters())
    assert n == K * (L * (H * H + H) + (0 if share else V * H))
    assert all(p.requires_grad for p in heads.parameters())
    # each layer is its own module (the original Medusa shared one module across layers)
    assert heads.blocks[0][0].linear.weight is not heads.blocks[0][1].linear.weight
    keys = set(heads.state_dict())
    assert any(k.startswith("lm_heads.") for k in keys) != share
    if share:
        shared = heads.lm_head_weight(0)
        assert not shared.requires_grad
        assert shared.data_ptr() == targets().get_output_embeddings().weight.data_ptr()  # borrowed, not copied
        assert all(p.data_ptr() != shared.data_ptr() for p in heads.parameters())
        with pytest.raises(MedusaError, match="own their lm_heads"):
            make(targets(), share=False).attach_lm_head(shared)
        with pytest.raises(MedusaError, match=r"shape \(320, 40\)"):
            heads.attach_lm_head(torch.zeros(V, 40))
        assert heads.to(torch.bfloat16).lm_head_weight(0).dtype == torch.bfloat16  # moves with the heads
        assert targets().get_output_embeddings().weight.dtype == torch.float32  # the target is untouched


def test_save_pretrained_round_trip_keeps_outputs_and_provenance(targets, tmp_path):
    heads = trained(make(targets()))
    heads.config.head_accuracies = [[0.6, 0.7], [0.4, 0.5], [0.3, 0.35]]
    heads.save_pretrained(tmp_path / "hf")
    back = MedusaHeads.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(hidden()), heads(hidden()), rtol=0, atol=0)
    for key in ("target_name_or_path", "target_fingerprint", "target_num_layers", "data_hash", "head_accuracies"):
        assert getattr(back.config, key) == getattr(heads.config, key), key
    assert back.config.target_name_or_path == "toy/target" and back.config.target_num_layers == 2
    assert len(back.config.target_fingerprint) == 64


def test_save_medusa_shared_needs_the_target_lm_head(targets, tmp_path):
    target = targets()
    heads = trained(make(target, share=True))
    out = save_medusa(heads, tmp_path / "heads")
    assert not any(k.startswith("lm_heads") for k in load_file(out / "model.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]  # no temp folder left behind
    bare = load_medusa(out)
    with pytest.raises(MedusaError, match=r"attach_lm_head.*load_medusa\(path, target=target\)"):
        bare(hidden())
    with pytest.raises(MedusaError, match="not attached"):
        export_medusa(bare, tmp_path / "x", "vllm")
    back = load_medusa(out, target=target)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden()), heads(hidden()), rtol=0, atol=0)
    assert back.config.data_hash == "d" * 8
    save_medusa(back, out)  # re-saving over draftsmith heads (a re-run) replaces them


EXPECTED_KEYS = {
    "medusa": {
        *(f"{h}.{l}.linear.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")),
        *(f"{h}.2.weight" for h in range(3)),
    },
    "vllm": {
        *(f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")),
        *(f"lm_heads.{h}.weight" for h in range(3)),
    },
}
WEIGHTS = {"medusa": "medusa_lm_head.safetensors", "vllm": "model.safetensors"}


@pytest.mark.parametrize("fmt", ["medusa", "vllm"])
@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
def test_export_layout_and_round_trip(targets, tmp_path, fmt, share):
    target = targets()
    heads = trained(make(target, 3, 2, share))
    out = export_medusa(heads, tmp_path / fmt, fmt)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", WEIGHTS[fmt]])
    state = load_file(out / WEIGHTS[fmt])
    assert set(state) == EXPECTED_KEYS[fmt]
    config = json.loads((out / "config.json").read_text())
    proj = "{h}.2.weight" if fmt == "medusa" else "lm_heads.{h}.weight"
    for h in range(3):
        expected = target.get_output_embeddings().weight if share else heads.lm_heads[h].weight
        torch.testing.assert_close(state[proj.format(h=h)], expected.detach(), rtol=0, atol=0)
    block = "1.1.linear.bias" if fmt == "medusa" else "blocks.1.layers.1.bias"
    torch.testing.assert_close(state[block], heads.blocks[1][1].linear.bias.detach(), rtol=0, atol=0)
    if fmt == "medusa":
        assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
        assert config["base_model_name_or_path"] == "toy/target"
    else:
        assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
        assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
        assert config["truncated_vocab_size"] == V and config["medusa_fc_bias"] is True
        assert config["original_lm_head"] is False and {"max_paths", "topk"} <= set(config)
        # vLLM renames any top-level key holding "num" and "heads"/"layers": none but these two
        assert [k for k in config if "num" in k and ("heads" in k or "layers" in k)] == [
            "num_heads",
            "num_hidden_layers",
        ]
    assert (config["hidden_size"], config["vocab_size"]) == (H, V)
    assert config["draftsmith"]["target_fingerprint"] == heads.config.target_fingerprint
    assert config["draftsmith"]["data_hash"] == "d" * 8

    back = load_medusa(out)
    assert not back.config.share_lm_head  # the exported projections are the heads' own now
    assert back.config.target_fingerprint == heads.config.target_fingerprint
    assert back.config.target_name_or_path == "toy/target"
    with torch.no_grad():
        torch.testing.assert_close(back(hidden()), heads(hidden()), rtol=0, atol=0)


def test_hub_layouts_without_sizes_or_biases_load(targets, tmp_path):
    heads = trained(make(targets(), 2, 1))
    out = export_medusa(heads, tmp_path / "medusa", "medusa")
    (out / "config.json").write_text(
        json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"})
    )
    back = load_medusa(out)  # sizes read off the weights, as in hub configs
    assert (back.config.hidden_size, back.config.vocab_size, back.config.target_name_or_path) == (H, V, "x")
    with torch.no_grad():
        torch.testing.assert_close(back(hidden()), heads(hidden()), rtol=0, atol=0)

    out = export_medusa(heads, tmp_path / "vllm", "vllm")
    config = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    # no biases (medusa_fc_bias false) and one projection for all heads (original_lm_head)
    save_file(
        {k: v for k, v in state.items() if not k.endswith("bias") and k != "lm_heads.1.weight"},
        str(out / "model.safetensors"),
    )
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False, "original_lm_head": True}))
    back = load_medusa(out)
    assert all(b.linear.bias.abs().sum() == 0 for blocks in back.blocks for b in blocks)
    torch.testing.assert_close(back.lm_heads[1].weight, state["lm_heads.0.weight"], rtol=0, atol=0)
    assert back.lm_heads[1].weight.data_ptr() != back.lm_heads[0].weight.data_ptr()  # copies, not tied


def test_check_target_sizes_raise_and_another_fingerprint_is_refused(targets, tmp_path):
    target = targets()
    with pytest.raises(MedusaError, match=r"hidden size 64.*hidden size 48"):
        MedusaHeads(MedusaConfig(num_heads=2, hidden_size=64, vocab_size=V)).check_target(target)
    with pytest.raises(MedusaError, match=r"vocab size 400.*outputs 320"):
        MedusaHeads(MedusaConfig(num_heads=2, hidden_size=H, vocab_size=400)).check_target(target)
    heads = make(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heads.check_target(target)  # same target: silent
    other = targets("llama", seed=1)
    fp_heads, fp_other = heads.config.target_fingerprint[:12], make(other).config.target_fingerprint[:12]
    out = save_medusa(heads, tmp_path / "heads")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = load_medusa(out, target=other)  # the sizes fit; which target it was trained on is provenance's
    with pytest.raises(ProvenanceError, match=f"{fp_heads}.*{fp_other}"):
        check_target_provenance(
            "heads", TargetRecord.of_head_config(back.config), other, allow_mismatch=False, flag="f"
        )


def test_bad_inputs_are_refused_with_clear_messages(targets, tmp_path):
    heads = make(targets(), 2, 1)
    with pytest.raises(MedusaError, match="nowhere.*does not exist"):
        load_medusa(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MedusaError, match="no config.json"):
        load_medusa(tmp_path / "empty")
    targets().config.save_pretrained(tmp_path / "llama")
    with pytest.raises(MedusaError, match=r"not a Medusa config \(model_type='llama'\)"):
        load_medusa(tmp_path / "llama")
    with pytest.raises(MedusaError, match="'onnx'.*'medusa', 'vllm'"):
        export_medusa(heads, tmp_path / "onnx", "onnx")
    assert not (tmp_path / "onnx").exists()
    # a non-empty folder is left untouched unless overwrite=True; save_medusa refuses it too
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(MedusaError, match="busy.*not empty.*overwrite=True"):
        export_medusa(heads, busy, "vllm")
    with pytest.raises(MedusaError, match="not empty"):
        save_medusa(heads, busy)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    export_medusa(heads, busy, "vllm", overwrite=True)
    assert sorted(p.name for p in busy.iterdir()) == ["config.json", "model.safetensors"]
    # weights that do not match their config
    broken = export_medusa(heads, tmp_path / "broken", "medusa")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3}))
    with pytest.raises(MedusaError, match=r"medusa_lm_head.safetensors.*3 heads.*missing \['2.0.linear.bias'"):
        load_medusa(broken)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
