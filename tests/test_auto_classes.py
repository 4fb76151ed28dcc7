"""The heads load through transformers' auto classes once `draftsmith.heads` is imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fixtures import tiny_model
from transformers import AutoConfig, AutoModel

from draftsmith.heads.eagle import EagleConfig, EagleHead, save_eagle
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads, save_medusa


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A draftsmith-layout folder of every head kind, with weights moved off their init."""
    root = tmp_path_factory.mktemp("heads")
    target = tiny_model("llama", layers=4)
    heads = {
        "medusa": MedusaHeads.for_target(target, 2, 1, False, target_name_or_path="toy/target"),
        "eagle1": EagleHead.for_target(target, "eagle1", target_name_or_path="toy/target"),
        "eagle3": EagleHead.for_target(target, "eagle3", target_name_or_path="toy/target"),
    }
    gen = torch.Generator().manual_seed(0)
    folders = {}
    for name, model in heads.items():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        save = save_medusa if name == "medusa" else save_eagle
        folders[name] = save(model.eval(), root / name)
    return heads, folders


@pytest.mark.parametrize("name", ["medusa", "eagle1", "eagle3"])
def test_auto_model_loads_the_saved_weights(saved, name):
    heads, folders = saved
    config = AutoConfig.from_pretrained(folders[name])
    assert isinstance(config, MedusaConfig if name == "medusa" else EagleConfig)
    loaded = AutoModel.from_pretrained(folders[name])
    assert type(loaded) is type(heads[name])
    expected = heads[name].state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    if name != "medusa":
        assert loaded.config.version == name and loaded.config.target_name_or_path == "toy/target"


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~30 s on a busy 2-core machine
def test_a_fresh_interpreter_needs_only_the_package_import(saved):
    _, folders = saved
    code = (
        "import json, sys\n"
        "import draftsmith.heads\n"
        "from transformers import AutoModel\n"
        "print(json.dumps([type(AutoModel.from_pretrained(p)).__name__ for p in sys.argv[1:]]))\n"
    )
    paths = [str(folders[name]) for name in ("medusa", "eagle1", "eagle3")]
    run = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == ["MedusaHeads", "EagleHead", "EagleHead"]
