"""Bad input to the trainers and to `eval --medusa/--eagle`: each case is one line naming the file,
key or value and what to do, exit status 2, and nothing left behind in `out`. Target provenance
(heads/provenance.py) is checked the same way by every trainer (the data's target) and by eval
(the heads' target); `allow_target_mismatch` / `--allow-target-mismatch` lets a fine-tune pass."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from lifecycle_helpers import METHODS, main_of, recipe_values, toy_eval_args, write_recipe

from draftsmith.heads.provenance import ProvenanceError, TargetRecord, check_target_provenance
from draftsmith.heads.toy import tiny_model, tiny_tokenizer
from draftsmith.train.run_folder import checkpoints

FINGERPRINT = re.compile(r"fingerprint [0-9a-f]{12}\b.*fingerprint [0-9a-f]{12}\b")


@pytest.fixture(scope="module")
def other_target(tmp_path_factory):
    """A target of the toy's shape with other weights: what a fine-tune (or a mix-up) looks like."""
    folder = tmp_path_factory.mktemp("other") / "target"
    tiny_model("llama", seed=1).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def train_cli(method, toy_dir, toy_data, tmp_path, capsys, *args, **extra) -> tuple[int, str, str, Path]:
    """(exit status, stdout, stderr, out) of train/<method>.py on a tiny recipe."""
    out = Path(extra.pop("out", tmp_path / "run"))
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_values(method, toy_dir, toy_data, out, **extra))
    capsys.readouterr()
    code = main_of(method)(["--recipe", str(recipe), "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err, out


def one_error_line(err: str, script: str) -> str:
    """The single `SCRIPT: error: ...` line of stderr (no traceback)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"{script}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def save_heads_of(target_dir: Path, kind: str, out: Path) -> Path:
    """Untrained heads made for the target at `target_dir` (their provenance is all that matters)."""
    from draftsmith.heads.models import load_causal_lm

    target = load_causal_lm(str(target_dir), device="cpu", dtype=torch.float32, role="target")
    if kind == "medusa":
        from draftsmith.heads.medusa import MedusaHeads, save_medusa

        return save_medusa(MedusaHeads.for_target(target, 2, 1), out)
    from draftsmith.heads.eagle import EagleHead, save_eagle

    return save_eagle(EagleHead.for_target(target, "eagle3"), out)


def eval_args(toy_dir, flag, heads, out, *extra):
    return toy_eval_args(
        "eval", toy_dir, flag, heads, limit=1, max_new_tokens=4, k=2, out=out, extra=("--no-distances", *extra)
    )


# --------------------------------------------------------------------------- 1-3: data of another target


@pytest.mark.parametrize("method", ["eagle", "draft", "medusa"])  # cases 1, 2, 3
def test_data_of_another_target_is_refused(method, toy_dir, toy_data, other_target, tmp_path, capsys):
    code, _, err, out = train_cli(method, toy_dir, toy_data, tmp_path, capsys, target=str(other_target))
    line = one_error_line(err, METHODS[method][0])
    assert code == 2
    assert f"data {str(toy_data)!r} was made from target" in line and str(other_target) in line
    assert FINGERPRINT.search(line) and "set allow_target_mismatch=true" in line
    assert not out.exists()


def test_allow_target_mismatch_trains_on_a_fine_tunes_data_with_one_warning(
    toy_dir, toy_data, other_target, tmp_path, capsys
):
    code, stdout, err, out = train_cli(
        "medusa",
        toy_dir,
        toy_data,
        tmp_path,
        capsys,
        "allow_target_mismatch=true",
        target=str(other_target),
        max_steps=1,
        heldout_fraction=0,
    )
    assert code == 0, err
    warning = [line for line in stdout.splitlines() if line.startswith("warning: ")]
    assert (
        len(warning) == 1 and "used anyway, as allowed for a fine-tune" in warning[0] and FINGERPRINT.search(warning[0])
    )
    assert (out / "heads" / "config.json").is_file()
    assert json.loads((out / "recipe.json").read_text())["allow_target_mismatch"] is True


# --------------------------------------------------------------------------- 4-5: eval heads of another target


@pytest.mark.parametrize("kind", ["medusa", "eagle"])  # cases 4, 5
def test_eval_heads_of_another_target_is_refused(kind, toy_dir, other_target, tmp_path, run_cli):
    heads = save_heads_of(other_target, kind, tmp_path / "heads")
    code, _, err = run_cli(eval_args(toy_dir, f"--{kind}", heads, tmp_path / "ev"))
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    what = "Medusa heads" if kind == "medusa" else "EAGLE head"
    assert f"{what} {str(heads)!r} was made from target {str(other_target)!r}" in line
    assert FINGERPRINT.search(line) and "pass --allow-target-mismatch" in line
    assert not (tmp_path / "ev").exists()


def test_eval_allow_target_mismatch_runs_with_one_warning(toy_dir, other_target, tmp_path, run_cli):
    heads = save_heads_of(other_target, "medusa", tmp_path / "heads")
    code, _, err = run_cli(eval_args(toy_dir, "--medusa", heads, tmp_path / "ev", "--allow-target-mismatch"))
    assert code == 0, err
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert str(heads) in warning and "used anyway" in warning
    assert (tmp_path / "ev" / "report.json").is_file()


def test_eval_heads_without_provenance_get_one_note(toy_dir, tmp_path, run_cli):
    """Heads of another toolkit (here: a vLLM export with draftsmith's provenance key removed)."""
    from draftsmith.heads.medusa import export_medusa, load_medusa

    heads = export_medusa(
        load_medusa(save_heads_of(toy_dir / "target", "medusa", tmp_path / "h")), tmp_path / "vllm", "vllm"
    )
    config = json.loads((heads / "config.json").read_text())
    config.pop("draftsmith")
    (heads / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(eval_args(toy_dir, "--medusa", heads, tmp_path / "ev"))
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if line.startswith("note: ")]
    assert note == (
        f"note: Medusa heads {str(heads)!r} carries no draftsmith provenance (no target fingerprint); "
        "compared only hidden size, vocabulary: they agree"
    )


def test_the_provenance_rule(toy_dir):
    """Shapes must agree whatever the flag; no fingerprint (an imported head): one note saying what
    was compared; another fingerprint: an error, or a warning when allowed."""
    from draftsmith.heads.models import load_causal_lm

    target = load_causal_lm(str(toy_dir / "target"), device="cpu", dtype=torch.float32, role="target")
    ours = TargetRecord.of_model(target)
    args = dict(allow_mismatch=False, flag="pass --allow-target-mismatch")
    assert check_target_provenance("heads H", ours, target, **args) is None
    imported = TargetRecord(hidden_size=ours.hidden_size, vocab_size=ours.vocab_size)
    note = check_target_provenance("heads H", imported, target, **args)
    assert (
        note
        == "note: heads H carries no draftsmith provenance (no target fingerprint); compared only hidden size, vocabulary: they agree"
    )
    for field, value, shown in (
        ("hidden_size", 64, "hidden size 64"),
        ("num_layers", 5, "layers 5"),
        ("architectures", ("GPT2LMHeadModel",), "architecture GPT2LMHeadModel"),
    ):
        wrong = TargetRecord(**{**vars(ours), field: value})
        with pytest.raises(ProvenanceError, match=f"{shown}, but target .* has .*: it cannot serve this target"):
            check_target_provenance("heads H", wrong, target, **{**args, "allow_mismatch": True})
    other = TargetRecord(**{**vars(ours), "fingerprint": "f" * 64, "name_or_path": "base"})
    with pytest.raises(ProvenanceError, match="made from target 'base' .fingerprint ffffffffffff."):
        check_target_provenance("heads H", other, target, **args)
    assert check_target_provenance("heads H", other, target, **{**args, "allow_mismatch": True}).startswith(
        "warning: heads H"
    )


# --------------------------------------------------------------------------- 7: a finished run without checkpoints


def test_a_finished_run_folder_without_checkpoints_is_not_replaced(toy_dir, toy_data, tmp_path, capsys):  # case 7
    code, _, err, out = train_cli("medusa", toy_dir, toy_data, tmp_path, capsys, max_steps=1, heldout_fraction=0)
    assert code == 0, err
    assert not checkpoints(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for args in ((), ("--resume",)):  # a resume finds no checkpoint: the same refusal
        code, _, err, _ = train_cli(
            "medusa", toy_dir, toy_data, tmp_path, capsys, *args, max_steps=1, heldout_fraction=0
        )
        line = one_error_line(err, "train/medusa.py")
        assert (
            code == 2
            and f"out {str(out)!r} already holds a run (metrics.jsonl, training_summary.json, recipe.json)" in line
        )
        assert "choose another out" in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# --------------------------------------------------------------------------- 13: nothing to train


@pytest.mark.parametrize("method", METHODS)  # case 13
def test_max_length_below_every_prompt_trains_nothing_and_is_refused(method, toy_dir, toy_data, tmp_path, capsys):
    code, _, err, out = train_cli(method, toy_dir, toy_data, tmp_path, capsys, max_length=20)
    line = one_error_line(err, METHODS[method][0])
    assert code == 2
    assert f"max_length = 20 cuts every training row of data {str(toy_data)!r} before its first trained token" in line
    assert re.search(r"the earliest is at position (\d+)\): nothing would be trained; set max_length above \1", line)
    assert not out.exists()


# --------------------------------------------------------------------------- 19: a truncated checkpoint


def test_resume_past_a_truncated_checkpoint(toy_dir, toy_data, tmp_path, capsys):  # case 19
    code, _, err, out = train_cli("medusa", toy_dir, toy_data, tmp_path, capsys, max_steps=5, save_every=2)
    assert code == 0, err
    assert [p.name for p in checkpoints(out)] == ["step-0000002", "step-0000004"]
    weights = out / "checkpoints" / "step-0000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    # the very checkpoint given: named, with the good one before it
    code, _, err, _ = train_cli(
        "medusa", toy_dir, toy_data, tmp_path, capsys, "--resume", str(weights.parent), max_steps=5, save_every=2
    )
    line = one_error_line(err, "train/medusa.py")
    assert code == 2 and f"{weights} (" in line and "is truncated or corrupt" in line
    assert f"resume from {out / 'checkpoints' / 'step-0000002'}, the one before it" in line
    # the latest: named, and the run resumes from the last good one
    code, stdout, err, _ = train_cli(
        "medusa", toy_dir, toy_data, tmp_path, capsys, "--resume", max_steps=5, save_every=2
    )
    assert code == 0, err
    (skipped,) = [line for line in stdout.splitlines() if line.startswith("resume: skipped")]
    assert str(weights) in skipped and "took " + str(out / "checkpoints" / "step-0000002") in skipped
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # one run's lines: 3 and 4 not twice
    assert (out / "heads" / "config.json").is_file()


# --------------------------------------------------------------------------- 22-23: values the recipe checks cannot


def test_a_nan_lr_is_refused(toy_dir, toy_data, tmp_path, capsys):  # case 22
    code, _, err, out = train_cli("eagle", toy_dir, toy_data, tmp_path, capsys, "lr=nan")
    line = one_error_line(err, "train/eagle.py")
    assert code == 2 and line.endswith("error: command line: lr = nan must be a finite number")
    assert not out.exists()


def test_a_draft_vocabulary_larger_than_the_target_s_is_refused(toy_dir, toy_data, tmp_path, capsys):  # case 23
    code, _, err, out = train_cli("eagle", toy_dir, toy_data, tmp_path, capsys, draft_vocab_size=100000)
    line = one_error_line(err, "train/eagle.py")
    assert code == 2 and "draft_vocab_size = 100000 is larger than the target's vocabulary (320 tokens)" in line
    assert "give at most 320" in line
    assert not out.exists()


# --------------------------------------------------------------------------- 24: a truncated shard


@pytest.mark.parametrize("method", METHODS)  # case 24
def test_a_truncated_shard_stops_every_trainer_before_it_writes(method, toy_dir, toy_data, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(toy_data, data)
    (arrow,) = (data / "shards" / "shard-00001").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    code, _, err, out = train_cli(method, toy_dir, data, tmp_path, capsys)
    line = one_error_line(err, METHODS[method][0])
    assert code == 2 and str(data) in line
    assert not out.exists()  # no recipe.json, no run_info.json


# --------------------------------------------------------------------------- errors after start-up


def test_an_error_after_start_leaves_out_as_it_was_found(toy_dir, toy_data, tmp_path, capsys, monkeypatch):
    import draftsmith.train.medusa as medusa

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(medusa, "train_loop", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        train_cli("medusa", toy_dir, toy_data, tmp_path, capsys, out=str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()  # the run made the folder: it goes
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="device lost"):
        train_cli("medusa", toy_dir, toy_data, tmp_path, capsys, out=str(kept))
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]  # what was there stays, nothing else
