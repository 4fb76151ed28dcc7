"""`draftsmith eval` and `check-lossless` refuse bad input with one line, exit 2, and leave the file
system as it was; the numbers of a report (acceptance, KL of a reduced-vocabulary draft) say
what they are; report.json is strict JSON."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from lifecycle_helpers import toy_eval_args

from draftsmith.decoding import DraftModelDrafter
from draftsmith.decoding.sampling import kl_divergence, split_kl
from draftsmith.eval.evaluator import EvalSettings, evaluate
from draftsmith.eval.report import compact_table, summary_table, write_report


def eval_args(toy, out, *extra, target=None, draft=None):
    return toy_eval_args(
        "eval", toy, "--draft", draft or toy / "draft", target=target, limit=1, max_new_tokens=4, out=out, extra=extra
    )


def lossless_args(toy, *extra):
    return [
        "check-lossless",
        "--target",
        toy / "target",
        "--draft",
        toy / "draft",
        "--no-progress",
        "--device",
        "cpu",
        *extra,
    ]


def listing(folder) -> dict:
    """Every path under `folder` with its bytes: the file system to compare before and after."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("draftsmith")]
    assert len(lines) == 1 and "Traceback" not in err, err
    print(lines[0])  # the message, for `pytest -s`
    return lines[0]


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------ the cases


def test_6_an_earlier_report_is_not_overwritten(toy_dir, tmp_path, run_cli):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text('{"earlier": true}\n')
    before = listing(tmp_path)
    code, _, err = run_cli(eval_args(toy_dir, out))
    line = one_line(err)
    assert code == 2 and "already holds report.json from an earlier run" in line and "--overwrite" in line
    assert listing(tmp_path) == before


def test_6_overwrite_replaces_the_report(toy_dir, tmp_path, run_cli):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text('{"earlier": true}\n')
    code, _, err = run_cli(eval_args(toy_dir, out, "--overwrite", "--no-distances"))
    assert code == 0, err
    assert "earlier" not in json.loads((out / "report.json").read_text())


def test_8_a_prompt_past_the_targets_positions(toy_dir, tmp_path, run_cli):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5] * 600}) + "\n")
    args = eval_args(toy_dir, tmp_path / "eval")
    args[args.index("--prompts") + 1] = prompts
    before = listing(tmp_path)
    code, _, err = run_cli(args)
    line = one_line(err)
    assert code == 2 and str(prompts) in line and "prompt 1 has 600 tokens" in line
    assert "604 positions" in line and "max_position_embeddings=512" in line and "--max-new-tokens" in line
    assert listing(tmp_path) == before


def _nan_draft(toy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = copy_model(toy_dir / "draft", tmp_path / "nan-draft")
    model = AutoModelForCausalLM.from_pretrained(draft)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, :3] = float("nan")
    model.save_pretrained(draft)
    return draft


def test_9_nan_in_a_drafts_weights(toy_dir, tmp_path, run_cli):
    draft = _nan_draft(toy_dir, tmp_path)
    before = listing(tmp_path)
    code, _, err = run_cli(eval_args(toy_dir, tmp_path / "eval", draft=draft))
    line = one_line(err)
    assert code == 2 and f"draft model '{draft}'" in line and "the checkpoint is corrupt" in line
    assert "'model.layers.1.mlp.up_proj.weight' holds 3 NaN/inf" in line
    assert listing(tmp_path) == before


def _medusa_heads(toy_dir, folder, corrupt=None):
    from transformers import AutoModelForCausalLM

    from draftsmith.heads.medusa import MedusaHeads, save_medusa

    heads = MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(toy_dir / "target"), num_heads=2)
    if corrupt:
        corrupt(heads)
    return save_medusa(heads, folder)


def test_10_nan_in_medusa_heads(toy_dir, tmp_path, run_cli):
    def nan(heads):
        with torch.no_grad():
            heads.lm_heads[1].weight[5, 5] = float("inf")

    heads = _medusa_heads(toy_dir, tmp_path / "heads", nan)
    args = eval_args(toy_dir, tmp_path / "eval")
    args[args.index("--draft") : args.index("--draft") + 2] = ["--medusa", heads]
    before = listing(tmp_path)
    code, _, err = run_cli(args)
    line = one_line(err)
    assert code == 2 and f"Medusa heads '{heads}'" in line and "'lm_heads.1.weight' holds 1 NaN/inf" in line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("threshold", ["-1", "0", "1", "2"])
def test_15_check_lossless_threshold_out_of_range(toy_dir, run_cli, threshold):
    code, stdout, err = run_cli(lossless_args(toy_dir, "--threshold", threshold))
    line = one_line(err)
    assert code == 2 and "--threshold" in line and "must be in (0, 1)" in line and f"got {float(threshold):g}" in line
    assert "samples" not in stdout  # refused before a single decode


def test_16_a_missing_relative_target_is_not_a_hub_error(toy_dir, tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(eval_args(toy_dir, "eval", target="runs/target"))
    line = one_line(err)
    assert code == 2 and "'runs/target' is neither a local folder nor a model on the Hugging Face Hub" in line
    assert "check the path" in line and "OSError" not in err
    assert list(tmp_path.iterdir()) == []


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_17_a_truncated_target(toy_dir, tmp_path, run_cli):
    target = copy_model(toy_dir / "target", tmp_path / "target")
    _truncate(target / "model.safetensors")
    before = listing(tmp_path)
    code, _, err = run_cli(eval_args(toy_dir, tmp_path / "eval", target=target))
    line = one_line(err)
    assert code == 2 and f"the target file '{target / 'model.safetensors'}' is truncated" in line
    assert "download it again" in line
    assert listing(tmp_path) == before


def test_18_truncated_medusa_heads(toy_dir, tmp_path, run_cli):
    heads = _medusa_heads(toy_dir, tmp_path / "heads")
    (weights,) = heads.glob("*.safetensors")
    _truncate(weights)
    args = eval_args(toy_dir, tmp_path / "eval")
    args[args.index("--draft") : args.index("--draft") + 2] = ["--medusa", heads]
    before = listing(tmp_path)
    code, _, err = run_cli(args)
    line = one_line(err)
    assert code == 2 and f"the Medusa heads file '{weights}' is truncated" in line
    assert listing(tmp_path) == before


def _no_loading(monkeypatch):
    """Make loading a model fail the test: the check must come before it."""
    from draftsmith.eval import jobs

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before --out was checked")

    monkeypatch.setattr(jobs, "load_drafters", refuse)


def test_20_out_under_a_file_is_refused_before_loading(toy_dir, tmp_path, run_cli, monkeypatch):
    _no_loading(monkeypatch)
    (tmp_path / "notes.txt").write_text("a file\n")
    before = listing(tmp_path)
    code, _, err = run_cli(eval_args(toy_dir, tmp_path / "notes.txt" / "eval"))
    line = one_line(err)
    assert code == 2 and f"'{tmp_path / 'notes.txt'}' is a file, not a folder" in line
    assert listing(tmp_path) == before


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_20_unwritable_out_is_refused_before_loading(toy_dir, tmp_path, run_cli, monkeypatch):
    _no_loading(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, _, err = run_cli(eval_args(toy_dir, locked / "runs" / "eval"))
        line = one_line(err)
        assert code == 2 and "is not writable" in line and str(locked) in line
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_20_a_refused_write_is_reported_before_loading(toy_dir, tmp_path, run_cli, monkeypatch):
    """As root the folder above cannot be made read-only: the probe's refusal is simulated."""
    from draftsmith.heads import artifacts

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    _no_loading(monkeypatch)
    monkeypatch.setattr(artifacts.tempfile, "mkstemp", denied)
    code, _, err = run_cli(eval_args(toy_dir, tmp_path / "runs" / "eval"))
    line = one_line(err)
    assert code == 2 and f"is not writable ('{tmp_path}': Permission denied)" in line
    assert list(tmp_path.iterdir()) == []


def test_25_check_lossless_with_too_few_samples(toy_dir, run_cli):
    code, stdout, err = run_cli(lossless_args(toy_dir, "--samples", "10"))
    line = one_line(err)
    assert code == 2 and "--samples must be an integer >= 100" in line and "got 10" in line
    assert "samples:" not in stdout


# ------------------------------------------------------------------------------ the numbers


def test_split_kl_full_and_reduced_vocabulary():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 10), -1)
    q_logits = torch.randn(3, 10)
    m, kl = split_kl(p, q_logits)
    torch.testing.assert_close(m, torch.zeros(3))
    torch.testing.assert_close(kl, kl_divergence(p, torch.softmax(q_logits, -1)))
    reduced = q_logits.clone()
    reduced[:, 6:] = float("-inf")  # a draft vocabulary of 6 tokens
    m, kl = split_kl(p, reduced)
    torch.testing.assert_close(m, p[:, 6:].sum(-1))
    p_v = p[:, :6] / p[:, :6].sum(-1, keepdim=True)
    torch.testing.assert_close(kl, kl_divergence(p_v, torch.softmax(reduced[:, :6], -1)))
    assert bool(torch.isinf(kl_divergence(p, torch.softmax(reduced, -1))).all())  # what the full KL says


def test_split_kl_when_the_target_puts_almost_nothing_on_the_draft_vocabulary():
    # a 16-candidate support (DFlash2) the target gives ~1e-7 of its mass: 1 - m cancels in float32
    logits = torch.full((1, 1000), -30.0)
    logits[0, 500] = 0.0
    logits[0, :16] = torch.linspace(-16.0, -17.0, 16)
    p = torch.softmax(logits, -1)
    q_logits = torch.full((1, 1000), float("-inf"))
    q_logits[0, :16] = torch.linspace(0.0, -3.0, 16)
    m, kl = split_kl(p, q_logits)
    p_v = p[:, :16].double() / p[:, :16].double().sum(-1, keepdim=True)
    expected = (p_v * (p_v.log() - torch.log_softmax(q_logits[:, :16].double(), -1))).sum(-1)
    assert float(1 - m) < 1e-5
    torch.testing.assert_close(kl.double(), expected, rtol=1e-4, atol=1e-4)


class ReducedVocabDraft(DraftModelDrafter):
    """A draft that can only propose the first `size` tokens (EAGLE-3's reduced vocabulary)."""

    size = 200

    def _aligned(self, logits):
        logits = super()._aligned(logits).clone()
        logits[..., self.size :] = float("-inf")
        return logits


def _report(pairs, temperature=0.0):
    target, draft = pairs("llama")
    methods = {"full": DraftModelDrafter(draft, name="full"), "reduced": ReducedVocabDraft(draft, name="reduced")}
    settings = EvalSettings(num_draft_tokens=3, max_new_tokens=8, temperature=temperature, repeats=1)
    return evaluate(target, methods, [torch.tensor([1, 5, 77, 140])], settings, progress=False)


def test_reduced_vocabulary_kl_columns(pairs, tmp_path):
    report = _report(pairs)
    rows = {row["method"]: row for row in report["methods"]}
    full, reduced = rows["full"], rows["reduced"]
    assert full["oov_mass_mean"] == 0.0 and full["kl_draft_vocab_mean"] == pytest.approx(full["kl_mean"], rel=1e-5)
    assert math.isinf(reduced["kl_mean"])  # correct but useless: the reason for the two columns
    assert 0 < reduced["oov_mass_mean"] < 1 and math.isfinite(reduced["kl_draft_vocab_mean"])
    per_position = reduced["oov_mass_per_position"]
    assert 0 < per_position[0] < 1 and all(m is None or 0 < m < 1 for m in per_position)
    line = next(line for line in summary_table(report).splitlines() if line.startswith("| reduced"))
    assert f"| {reduced['oov_mass_mean']:.3f} | {reduced['kl_draft_vocab_mean']:.3f} |" in line and "inf" not in line
    assert "| alpha | acc. rate |" in summary_table(report) and "| OOV | KL |" in compact_table(report)
    json_path, md_path = write_report(report, tmp_path)

    def no_constant(name):
        raise ValueError(f"report.json holds {name}: not strict JSON")

    written = json.loads(json_path.read_text(), parse_constant=no_constant)
    row = next(r for r in written["methods"] if r["method"] == "reduced")
    assert row["kl_mean"] is None and row["kl_draft_vocab_mean"] == pytest.approx(reduced["kl_draft_vocab_mean"])
    assert "Leviathan's conditional acceptance" in md_path.read_text()


def test_alpha_and_acceptance_rate_are_both_reported(pairs):
    report = _report(pairs, temperature=1.0)
    for row in report["methods"][1:]:
        assert 0 <= row["acceptance_rate"] <= row["alpha"] <= 1  # alpha conditions on reaching a position
        line = next(line for line in summary_table(report).splitlines() if line.startswith(f"| {row['method']} "))
        assert f"| {row['alpha']:.2f} | {row['acceptance_rate']:.2f} |" in line
