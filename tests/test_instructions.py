"""Instruction prompts made offline (distill/instructions.py): the files and their rows, splits
that share no source, determinism, the mix of tasks, multi-turn rows, the length bound, the
project's prompt loader reading them, the stdlib-only fallback, and the not-enough error."""

import json

import pytest

from draftsmith.distill import instructions
from draftsmith.distill.instructions import (
    KINDS,
    MAX_PROMPT_CHARS,
    NotEnoughSourcesError,
    _quotas,
    build_instruction_prompts,
)
from draftsmith.distill.prompts import Prompter
from draftsmith.distill.sources import load_source
from draftsmith.eval.evaluator import load_prompt_file
from draftsmith.heads.toy import CHAT_TEMPLATE, tiny_tokenizer

TRAIN, HELDOUT = 60, 20


def read_rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts")
    summary = build_instruction_prompts(out, num_train=TRAIN, num_heldout=HELDOUT, seed=0)
    return out, summary


def test_files_rows_and_summary(built):
    out, summary = built
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "train.jsonl"]  # no temporary left
    for split, count in (("train", TRAIN), ("heldout", HELDOUT)):
        rows = read_rows(out / f"{split}.jsonl")
        assert len(rows) == count == summary[split]["rows"]
        for row in rows:
            assert set(row) == {"messages", "task", "source"} and row["task"] in KINDS
            assert row["source"].split(":")[0] in ("stdlib", "shakespeare")
            assert all(set(m) == {"role", "content"} and m["content"].strip() for m in row["messages"])
        assert summary[split]["tasks"] == {kind: sum(r["task"] == kind for r in rows) for kind in KINDS}
        assert sum(summary[split]["source_kinds"].values()) == count
        assert summary[split]["sources"] == sorted({r["source"] for r in rows})


def test_splits_share_no_source(built):
    out, summary = built
    train, heldout = ({r["source"] for r in read_rows(out / f"{s}.jsonl")} for s in ("train", "heldout"))
    assert train and heldout and not train & heldout
    assert not set(summary["train"]["sources"]) & set(summary["heldout"]["sources"])


def test_same_seed_same_files_another_seed_others(built, tmp_path):
    out, _ = built
    build_instruction_prompts(tmp_path / "same", num_train=TRAIN, num_heldout=HELDOUT, seed=0)
    build_instruction_prompts(tmp_path / "other", num_train=TRAIN, num_heldout=HELDOUT, seed=1)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "same" / name).read_bytes() == (out / name).read_bytes()
        assert (tmp_path / "other" / name).read_bytes() != (out / name).read_bytes()


def test_kinds_are_mixed_as_asked(built):
    _, summary = built
    assert summary["train"]["tasks"] == {"code": 24, "explain": 18, "writing": 12, "multi-turn": 6}
    assert summary["heldout"]["tasks"] == {"code": 8, "explain": 6, "writing": 4, "multi-turn": 2}
    assert _quotas(1024, 0.1) == {"code": 410, "explain": 307, "writing": 205, "multi-turn": 102}
    assert sum(_quotas(7, 0.25).values()) == 7 and _quotas(10, 0.0)["multi-turn"] == 0


def test_multi_turn_rows_alternate_and_end_with_a_user_turn(built):
    out, _ = built
    rows = [r for s in ("train", "heldout") for r in read_rows(out / f"{s}.jsonl")]
    multi = [r for r in rows if r["task"] == "multi-turn"]
    assert multi
    for row in multi:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user"]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows if r not in multi)


def test_prompts_are_within_the_length_bound(built):
    out, _ = built
    for split in ("train", "heldout"):
        for row in read_rows(out / f"{split}.jsonl"):
            assert sum(len(m["content"]) for m in row["messages"]) <= MAX_PROMPT_CHARS


def test_the_projects_prompt_loader_reads_them(built):
    out, _ = built
    path = out / "heldout.jsonl"
    source = load_source(str(path))
    assert source.format == "messages" and len(source.records) == HELDOUT
    tok = tiny_tokenizer()
    prompts, tasks = load_prompt_file(path, tok, template=CHAT_TEMPLATE)
    assert tasks == [r["task"] for r in read_rows(path)]
    assert all(len(p) > 0 for p in prompts)
    prompter = Prompter(tok, CHAT_TEMPLATE)
    # a multi-turn row is two prompts to the target: its recorded assistant turn is regenerated
    assert [prompter.num_turns(r) for r in source.records] == [2 if t == "multi-turn" else 1 for t in tasks]


def test_stdlib_only_when_shakespeare_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(instructions, "shakespeare_dir", lambda: None)
    summary = build_instruction_prompts(tmp_path, num_train=TRAIN, num_heldout=HELDOUT, seed=0)
    assert summary["shakespeare"] is None and "shakespeare" in summary["note"]
    for split in ("train", "heldout"):
        assert summary[split]["source_kinds"] == {"stdlib": summary[split]["rows"]}
        assert summary[split]["tasks"]["writing"] > 0
    rows = read_rows(tmp_path / "train.jsonl")
    assert all(r["source"].startswith("stdlib:") for r in rows)


def test_not_enough_sources_is_one_clear_line_and_writes_nothing(monkeypatch, tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    for name in ("alpha", "beta"):
        (root / f"{name}.py").write_text(
            f'"""The {name} module, for tests."""\n\n\ndef {name}_twice(x):\n    """Return x twice, as a list."""\n'
            "    y = [x, x]\n    return y\n",
            encoding="utf-8",
        )
    monkeypatch.setattr(instructions, "stdlib_dir", lambda: root)
    monkeypatch.setattr(instructions, "shakespeare_dir", lambda: None)
    out = tmp_path / "out"
    with pytest.raises(NotEnoughSourcesError) as err:
        build_instruction_prompts(out, num_train=TRAIN, num_heldout=HELDOUT)
    message = str(err.value)
    assert "\n" not in message and "not enough code prompts for the train split" in message
    assert f"num_train={TRAIN}" in message and isinstance(err.value, ValueError)
    assert not out.exists()


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="num_train"):
        build_instruction_prompts(tmp_path, num_train=0, num_heldout=1)
    with pytest.raises(ValueError, match="multi_turn_share"):
        build_instruction_prompts(tmp_path, num_train=1, num_heldout=1, multi_turn_share=1.0)


def test_make_prompts_command(run_cli, tmp_path):
    code, out, err = run_cli(["make-prompts", "--out", tmp_path / "p", "--train", TRAIN, "--heldout", HELDOUT])
    assert code == 0, err
    assert f"{TRAIN} prompts" in out and "held-out sources:" in out
    assert len(read_rows(tmp_path / "p" / "train.jsonl")) == TRAIN
    code, out, err = run_cli(["make-prompts", "--out", tmp_path / "q", "--train", 100_000])
    assert code == 2 and err.count("\n") == 1 and "not enough" in err
    assert not (tmp_path / "q").exists()
