"""The contract every registered drafter method keeps (heads/registry.py), checked for each entry
of `METHODS`: a method added to the table is tested here without editing this file.

For each kind, on a 4-layer toy target (three hidden states below its last, as the server layouts
of the heads that read several need) and its self-distillation data: `draftsmith train KIND` runs two
steps from the entry's `smoke_recipe`; the trained drafter decodes greedy-identical to target-only
decoding (through `--drafter KIND=DIR`'s loader); its draftsmith layout ("hf") saves and loads back
to the same weights; every export format re-imports and decodes the same tokens; the memory
estimate counts its trainable parameters; and it pushes to a local stand-in of the Hub.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from lifecycle_helpers import smoke_recipe
from test_push import hub  # noqa: F401  (the local stand-in of the Hub, a fixture)

from draftsmith.heads.registry import METHODS, get_method, method_of_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deep(toy_dir, tmp_path_factory):
    """(target folder, its self-distillation data): a 4-layer toy target answering 6 toy prompts."""
    from draftsmith.heads.toy import tiny_model, tiny_tokenizer
    from draftsmith.scripts.cli import main

    root = tmp_path_factory.mktemp("contract")
    target = root / "target"
    tiny_model("llama", layers=4).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    data = root / "data"
    args = [
        "generate",
        "--target",
        target,
        "--prompts",
        toy_dir / "prompts.jsonl",
        "--limit",
        6,
        "--max-new-tokens",
        12,
        "--batch-size",
        3,
        "--chat-template",
        "none",
        "--out",
        data,
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main([str(a) for a in args]) == 0
    return target, data


def _recipe(method, target, data, out) -> dict:
    return smoke_recipe(method, target, data, out)


def _state(module) -> dict:
    return {k: v.detach().float() for k, v in module.state_dict().items()}


def _greedy(target, drafter, prompts):
    from draftsmith.decoding import generate

    return [generate(target, drafter, p, max_new_tokens=12, num_draft_tokens=3).tokens for p in prompts]


@pytest.mark.parametrize("kind", list(METHODS))
def test_every_method_keeps_the_contract(kind, deep, tmp_path, hub, run_cli):  # noqa: F811
    from draftsmith.eval.drafter_specs import chain_drafter
    from draftsmith.heads.models import load_causal_lm
    from draftsmith.publish import push
    from draftsmith.train.sharding import estimate_memory

    method = get_method(kind)
    target_folder, data = deep
    values = _recipe(method, target_folder, data, tmp_path / "run")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(values), encoding="utf-8")

    # two training steps through the command line
    code, _, err = run_cli(["train", kind, "--recipe", recipe_file, "--no-progress"])
    assert code == 0, err
    folder = tmp_path / "run" / method.run_folder
    assert method_of_folder(folder) is method, f"{folder} is not recognised as {kind}"

    # greedy decoding with the drafter is the target's own
    target = load_causal_lm(target_folder, device=torch.device("cpu"), dtype=torch.float32, role="target")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.config.vocab_size, (1, n), generator=gen) for n in (5, 9)]
    alone = _greedy(target, None, prompts)
    drafter = chain_drafter(kind, folder, target, torch.device("cpu"), torch.float32)
    assert _greedy(target, drafter, prompts) == alone

    # the draftsmith layout round trip, then every export format re-imported
    trained = method.load(folder, target=target, device=torch.device("cpu"), dtype=torch.float32)
    for fmt in method.export_formats:
        out = tmp_path / f"export-{fmt}"
        method.export(folder, out, fmt, num_speculative_tokens=3, target=target)
        assert method_of_folder(out) is method, f"the {fmt} export of {kind} is not recognised as {kind}"
        again = method.load(out, target=target, device=torch.device("cpu"), dtype=torch.float32)
        if fmt == "hf":
            a, b = _state(trained), _state(again)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "hf layout changed weights"
        reimported = chain_drafter(kind, out, target, torch.device("cpu"), torch.float32)
        assert _greedy(target, reimported, prompts) == alone, f"{kind} exported as {fmt} decodes differently"

    # the memory estimate counts what is trained
    recipe = method.part("recipe")(**values)
    estimate = estimate_memory(recipe, kind, shards=1)
    assert estimate.trainable_params > 0

    # a push to the local stand-in of the Hub arrives with weights and a card
    url = push(tmp_path / "run", f"toy-org/{kind}", endpoint=hub.url)
    assert url.endswith(f"toy-org/{kind}")
    files = hub.files(f"toy-org/{kind}")
    assert "README.md" in files and any(name.endswith(".safetensors") for name in files), sorted(files)


@pytest.mark.parametrize("kind", list(METHODS))
def test_every_method_trains_a_bf16_target_with_fp32_master_weights(kind, deep, tmp_path, monkeypatch):
    """A bf16 target (the serving precision, and the demo's on CPUs with native bf16): the drafter
    trains under bf16 autocast with its trainable weights in fp32 (bf16 weights lose AdamW's small
    updates), its losses finite, and its serve check decodes."""
    import importlib
    import json

    from draftsmith.train import run as run_module

    method = get_method(kind)
    target_folder, data = deep
    values = _recipe(method, target_folder, data, tmp_path / "run") | {"dtype": "bfloat16", "serve_check_prompts": 2}
    seen = {}
    prepare = run_module.TrainingRun.prepare

    def watch(self, model, optimizer):
        wrapped = prepare(self, model, optimizer)
        seen["trainable"] = {p.dtype for group in optimizer.param_groups for p in group["params"]}
        seen["autocast"] = self.accelerator.mixed_precision
        return wrapped

    monkeypatch.setattr(run_module.TrainingRun, "prepare", watch)
    summary = importlib.import_module(method.trainer).train(method.part("recipe")(**values), progress=False)
    assert seen == {"trainable": {torch.float32}, "autocast": "bf16"}, seen
    losses = [
        r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
    assert "tau_decoded" in summary["serve_check"], summary["serve_check"]
