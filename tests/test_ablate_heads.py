"""The head-loss ablation end to end on the toy target: heads per (loss, seed), one
interleaved evaluation, the table and its JSON; and its answers to bad settings."""

import json
import math
import shutil

import pytest
import torch

from draftsmith.demo.ablate_heads import HeadAblationSettings, ablate_heads, head_recipes


@pytest.fixture
def toy_ctx(toy_dir, tmp_path):
    """A DemoContext on the toy target, laid out as a demo build (target/, prompts/heldout.jsonl)."""
    from draftsmith.demo.run import DemoContext, DemoSettings
    from draftsmith.demo.target import DemoTarget
    from draftsmith.heads.models import load_causal_lm, load_tokenizer

    build = tmp_path / "build"
    (build / "prompts").mkdir(parents=True)
    (build / "target").symlink_to(toy_dir / "target")
    shutil.copy(toy_dir / "prompts.jsonl", build / "prompts" / "heldout.jsonl")
    cpu = torch.device("cpu")
    target = load_causal_lm(build / "target", device=cpu, dtype=torch.float32, role="target")
    tokenizer = load_tokenizer(build / "target")
    settings = DemoSettings(target="micro")
    return DemoContext(target, tokenizer, DemoTarget(build), cpu, torch.float32, settings, progress=False)


@pytest.mark.slow  # ~25 s on 2 loaded cores: 4 trainings and an interleaved evaluation
def test_two_losses_by_two_seeds_end_to_end(toy_ctx, toy_data, tmp_path):
    from draftsmith.demo.heads import BUDGETS

    out = tmp_path / "ablation"
    settings = HeadAblationSettings(
        losses="soft_ce,lk_hybrid",
        seeds="0,1",
        steps=2,
        prompts=2,
        max_new_tokens=6,
        target="micro",
        out=str(out),
        device="cpu",
    )
    logs = []
    record = ablate_heads(toy_ctx, BUDGETS["micro", "default"], toy_data, None, settings, log=logs.append)
    assert record["num_draft_tokens"] == 3  # the demo's block of K + 1 = 4 slots
    assert [r["loss"] for r in record["rows"]] == ["soft_ce", "lk_hybrid"]
    for row in record["rows"]:
        for metric in ("alpha", "tau", "speedup", "tau_simulated"):
            values = row[metric]["values"]
            assert len(values) == 2 and all(math.isfinite(v) for v in values), (row["loss"], metric)
            assert row[metric]["min"] <= row[metric]["mean"] <= row[metric]["max"]
        assert 1.0 <= row["tau"]["mean"] <= 4.0 and 0.0 <= row["alpha"]["mean"] <= 1.0
    names = ("soft_ce-seed0", "lk_hybrid-seed1")
    recipes = {name: json.loads((out / "runs" / name / "recipe.json").read_text()) for name in names}
    assert recipes["soft_ce-seed0"]["loss"] == "soft_ce" and recipes["lk_hybrid-seed1"]["seed"] == 1
    assert recipes["soft_ce-seed0"]["max_steps"] == 2 and recipes["soft_ce-seed0"]["block_size"] == 4
    saved = json.loads((out / "heads_ablation.json").read_text())
    runs = {f"{loss}/seed{seed}" for loss in ("soft_ce", "lk_hybrid") for seed in (0, 1)}
    assert saved["rows"] == record["rows"] and set(saved["runs"]) == runs
    md = (out / "heads_ablation.md").read_text()
    assert "| soft_ce |" in md and "| lk_hybrid |" in md and "K = 3" in md and "best alpha: " in md
    assert not list(out.glob("*.tmp*"))
    # A second call reuses every trained head (a head with a training summary is not retrained).
    logs.clear()
    ablate_heads(toy_ctx, BUDGETS["micro", "default"], toy_data, None, settings, log=logs.append)
    assert not any(line.startswith("== dflash") for line in logs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "medusa"}, f"method = 'medusa': expected one of {', '.join(head_recipes('smollm2'))}"),
        ({"losses": "soft_ce,kl"}, "losses = 'soft_ce,kl': expected comma-separated names from forward_kl"),
        ({"seeds": "0,x"}, "seeds = '0,x': expected comma-separated integers"),
        ({"steps": 0}, "steps must be >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeadAblationSettings(**kwargs)


def test_the_script_exits_2_on_a_bad_flag(capsys):
    from draftsmith.scripts.ablate_heads import main

    with pytest.raises(SystemExit) as exc:
        main(["--losses", "soft_ce,nope"])
    assert exc.value.code == 2 and "losses = 'soft_ce,nope'" in capsys.readouterr().err
