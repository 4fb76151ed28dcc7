"""Every method's exporter through the registry (`Method.export`): each of its formats round-trips
(the folder written loads back with the same tensors, and converts back to the draftsmith layout),
the target is loaded only when a layout needs its weights, and bad input writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import tiny_model
from safetensors.torch import load_file

from draftsmith.heads.dflash import DFlashError, DFlashHead
from draftsmith.heads.dflash_formats import load_dflash, save_dflash
from draftsmith.heads.draft import DraftBuildError
from draftsmith.heads.eagle import EagleHead, PEagleHead, load_eagle, save_eagle
from draftsmith.heads.medusa import MedusaError, MedusaHeads, load_medusa, save_medusa
from draftsmith.heads.registry import METHODS, RegistryError, get_method
from draftsmith.heads.toy import VOCAB, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    """A 4-layer target: the server layouts capture three aux layers below the last."""
    return tiny_model("llama", layers=4).eval()


class Loader:
    """A zero-argument target loader that counts its calls."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self):
        self.calls += 1
        return self.model


def _perturbed(head):
    with torch.no_grad():  # off the init (norms at 1, zero blocks), so that a dropped or misread tensor shows
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_every_method_has_an_exporter_and_hf_is_among_its_formats():
    for method in METHODS.values():
        assert callable(method.part("exporter")) and "hf" in method.export_formats, method.kind
    with pytest.raises(RegistryError, match=r"format 'onnx': expected one of vllm, hf \(DFlash"):
        get_method("dflash").export("anywhere", "nowhere", "onnx")


@pytest.mark.parametrize("kind", ["eagle", "peagle"])
def test_eagle_and_peagle_round_trip(kind, target, tmp_path):
    if kind == "eagle":
        head = EagleHead.for_target(target, "eagle3", aux_layer_ids=[1, 2, 3])
    else:
        head = PEagleHead.for_target(target, mask_token_id=VOCAB - 1, num_depths=3, aux_layer_ids=[1, 2, 3])
    folder = save_eagle(_perturbed(head.eval()), tmp_path / "head")
    state, method, loader = head.state_dict(), get_method(kind), Loader(target)
    for fmt in method.export_formats:
        out = method.export(folder, tmp_path / fmt, fmt, num_speculative_tokens=3, target=loader)
        back = load_eagle(out, target=target)
        assert type(back) is type(head) and _same(back.state_dict(), state), fmt
        again = method.export(out, tmp_path / f"{fmt}-hf", "hf", target=loader)  # any layout -> draftsmith's
        assert _same(load_eagle(again).state_dict(), state)
    assert loader.calls == 0  # the head holds everything it writes
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["speculators_model_type"] == ("eagle3" if kind == "eagle" else "peagle")
    assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    if kind == "peagle":
        with pytest.raises(RegistryError, match="format 'sglang': expected one of vllm, hf"):
            method.export(folder, tmp_path / "sglang", "sglang")
        assert not (tmp_path / "sglang").exists()


def test_medusa_round_trip_loads_the_target_only_for_a_shared_lm_head(target, tmp_path):
    method = get_method("medusa")
    own = save_medusa(_perturbed(MedusaHeads.for_target(target, 2, 1, False)), tmp_path / "own")
    shared = save_medusa(_perturbed(MedusaHeads.for_target(target, 2, 1, True)), tmp_path / "shared")
    hidden = torch.randn(2, 3, target.config.hidden_size)
    for folder in (own, shared):
        reference = load_medusa(folder, target=target)
        for fmt in method.export_formats:
            loader = Loader(target)
            out = method.export(folder, tmp_path / f"{folder.name}-{fmt}", fmt, target=loader)
            with torch.no_grad():
                torch.testing.assert_close(load_medusa(out, target=target)(hidden), reference(hidden))
            # a server layout of shared heads holds the target's lm_head per head: the one load
            assert loader.calls == (1 if folder == shared and fmt != "hf" else 0), (folder.name, fmt)
    given = method.export(shared, tmp_path / "given", "medusa", target=target)  # the loaded target does too
    with torch.no_grad():
        torch.testing.assert_close(load_medusa(given)(hidden), load_medusa(shared, target=target)(hidden))
    with pytest.raises(MedusaError, match="share the target's lm_head, and the 'vllm' layout holds a copy"):
        method.export(shared, tmp_path / "no-target", "vllm")
    assert not (tmp_path / "no-target").exists()


def test_dflash_round_trip_without_its_target(target, tmp_path):
    method = get_method("dflash")
    head = _perturbed(
        DFlashHead.for_target(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, aux_layer_ids=[1]).eval()
    )
    folder = save_dflash(head, tmp_path / "head")
    frozen = head.frozen_keys()  # the target's tensors: taken from it on load, never written
    state = {k: v for k, v in head.state_dict().items() if k not in frozen}
    vllm = method.export(folder, tmp_path / "vllm", "vllm")  # both layouts hold the same tensors: no target
    config = json.loads((vllm / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert set(load_file(str(vllm / "model.safetensors"))) == set(load_file(str(folder / "model.safetensors")))
    assert _same({k: v for k, v in load_dflash(vllm, target=target).state_dict().items() if k not in frozen}, state)
    loader = Loader(target)
    hf = method.export(vllm, tmp_path / "hf", "hf", target=loader)  # with a target: checked against it
    assert loader.calls == 1 and json.loads((hf / "config.json").read_text())["model_type"] == "draftsmith_dflash"
    assert _same({k: v for k, v in load_dflash(hf, target=target).state_dict().items() if k not in frozen}, state)
    with pytest.raises(DFlashError, match="hidden size"):
        method.export(folder, tmp_path / "wrong", "vllm", target=lambda: tiny_model("llama", hidden=32))
    assert not (tmp_path / "wrong").exists()


def test_draft_exports_as_the_model_it_is(target, tmp_path):
    from transformers import AutoModelForCausalLM

    method = get_method("draft")
    folder = tmp_path / "draft"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text("the run's own notes")
    out = method.export(folder, tmp_path / "hf", "hf")
    assert {p.name for p in out.iterdir()} == {p.name for p in folder.iterdir()} - {"README.md"}
    assert _same(AutoModelForCausalLM.from_pretrained(out).state_dict(), target.state_dict())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(DraftBuildError, match="has no tokenizer files: save the target's tokenizer beside it"):
        method.export(folder, tmp_path / "x", "hf")
    tiny_tokenizer().save_pretrained(folder)
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(DraftBuildError, match=r"holds pickle weights \(pytorch_model.bin\)"):
        method.export(folder, tmp_path / "x", "hf")
    assert not (tmp_path / "x").exists()
    with pytest.raises(RegistryError, match="format 'vllm': expected one of hf"):
        method.export(folder, tmp_path / "x", "vllm")


def test_dflash_serving_commands_and_the_printed_export(target, tmp_path, run_cli):
    import shlex

    from draftsmith.publish.serve import serving_commands

    head = DFlashHead.for_target(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, aux_layer_ids=[1])
    folder = save_dflash(head, tmp_path / "head")
    served = serving_commands(folder, target="toy-org/target")
    export, vllm = (shlex.split(c) for c in served.vllm)
    assert served.k == 3 and not served.sglang and "no DFlash head layout" in served.text()  # block_size - 1
    code, stdout, err = run_cli(export[1:])  # the printed conversion runs, without the target
    assert code == 0, err
    assert f"in the vllm layout to {tmp_path / 'head-vllm'}" in stdout and '"method": "dflash"' in stdout
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": export[export.index("--out") + 1], "num_speculative_tokens": 3}
    assert json.loads((tmp_path / "head-vllm" / "config.json").read_text())["speculators_model_type"] == "dflash"
    assert serving_commands(tmp_path / "head-vllm", num_speculative_tokens=9).k == 3  # one block at most
