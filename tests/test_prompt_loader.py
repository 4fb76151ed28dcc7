"""The one prompt loader (distill/sources.py + distill/prompts.py) behind eval, tune, check-lossless
and generate: every format, with and without the chat template, no double BOS, the task column,
multi-turn MT-bench prompts asked after the target's own answers, and bad input."""

import json

import pytest
import torch
from lifecycle_helpers import toy_eval_args
from tokenizers import processors

from draftsmith.decoding import generate
from draftsmith.decoding.drafters import DraftModelDrafter
from draftsmith.distill.prompts import Prompter, encode_text
from draftsmith.distill.sources import SourceError, load_source
from draftsmith.eval.evaluator import EvalSettings, load_prompt_file, prompt_turns
from draftsmith.heads.toy import CHAT_TEMPLATE, tiny_pair, tiny_tokenizer

MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 82, "category": "coding", "turns": ["def add(a, b):", "Add a docstring."]},
    {"question_id": 83, "category": "writing", "turns": ["Write a limerick.", "Shorter."]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rendered(tok, text):
    """What a templated prompt must be: the rendered text, tokenised without added specials."""
    return tok(text, add_special_tokens=False).input_ids


ROWS = {
    "prompt": ({"prompt": "x = 1"}, None),  # None: raw text
    "messages": (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
        "<s>Be brief.\n[INST] hi [/INST]",
    ),
    "sharegpt": (
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "recorded"}]},
        "<s>[INST] a [/INST]",
    ),
    "turns": ({"turns": ["q1", "q2"], "category": "writing"}, "<s>[INST] q1 [/INST]"),
    "input_ids": ({"input_ids": [5, 6, 7]}, None),
}


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_every_format_with_the_template(tmp_path, fmt, kind):
    row, text = ROWS[fmt]
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "p.parquet"
        pq.write_table(pa.Table.from_pylist([row]), path)
    tok = tiny_tokenizer()
    prompts, _ = load_prompt_file(path, tok, template=CHAT_TEMPLATE)
    expected = {"prompt": tok("x = 1").input_ids, "input_ids": [5, 6, 7]}.get(fmt) or rendered(tok, text)
    assert prompts[0].tolist() == expected and prompts[0].dtype == torch.long


def test_plain_prompts_raw_by_default_chat_on_request(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x = 1"}])
    tok = tiny_tokenizer()
    assert load_prompt_file(path, tok, template=CHAT_TEMPLATE)[0][0].tolist() == tok("x = 1").input_ids
    chat = load_prompt_file(path, tok, template=CHAT_TEMPLATE, plain="chat")[0][0].tolist()
    assert chat == rendered(tok, "<s>[INST] x = 1 [/INST]")


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "turns"])
def test_conversations_without_a_template_are_refused(tmp_path, fmt):
    path = write_jsonl(tmp_path / "c.jsonl", [ROWS[fmt][0]])
    with pytest.raises(SourceError, match=r"c\.jsonl line 1: a conversation needs a chat template"):
        load_prompt_file(path, tiny_tokenizer(), template=None)
    with pytest.raises(SourceError, match="needs a tokenizer"):
        load_prompt_file(path, None, template=CHAT_TEMPLATE)


def bos_tokenizer():
    """The toy tokenizer made to add BOS itself, as Llama's does."""
    tok = tiny_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok("x").input_ids[0] == 1
    return tok


def test_no_second_bos(tmp_path):
    tok = bos_tokenizer()
    assert encode_text(tok, "x = 1").count(1) == 1  # plain text: the tokenizer's BOS
    assert encode_text(tok, "<s>[INST] x [/INST]").count(1) == 1  # already rendered: none added
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "<s>[INST] x [/INST]"}, {"prompt": "y"}])
    for plain in ("raw", "chat"):
        for ids in load_prompt_file(path, tok, template=CHAT_TEMPLATE, plain=plain)[0]:
            assert ids[0] == 1 and ids.tolist().count(1) == 1, (plain, ids)
    turns = write_jsonl(tmp_path / "t.jsonl", MT_BENCH[:1])
    assert load_prompt_file(turns, tok, template=CHAT_TEMPLATE)[0][0].tolist().count(1) == 1


def test_task_column_from_category_task_or_task_key(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", MT_BENCH)
    assert load_prompt_file(path, tiny_tokenizer(), template=CHAT_TEMPLATE)[1] == ["writing", "coding", "writing"]
    both = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "task": "math", "category": "x"}, {"prompt": "b"}])
    assert [r.task for r in load_source(str(both)).records] == ["math", None]
    assert [r.task for r in load_source(str(both), task_key="category").records] == ["x", None]


def test_second_turn_follows_the_targets_own_answer(tmp_path):
    target, draft = tiny_pair("llama")
    tok = tiny_tokenizer()
    records = load_source(str(write_jsonl(tmp_path / "q.jsonl", MT_BENCH[:2]))).records
    prompter = Prompter(tok, CHAT_TEMPLATE)
    settings = EvalSettings(max_new_tokens=6)
    asked = prompt_turns(target, records, prompter, settings, stop_token_ids=2, progress=False)
    assert asked.turns == [1, 2, 1, 2] and asked.rows == [0, 0, 1, 1]
    assert asked.tasks == ["writing", "writing", "coding", "coding"]
    first = asked.prompts[0]
    answer = generate(target, None, first, max_new_tokens=6, eos_token_id=2).tokens
    # lossless (greedy): the draft model's decode gives the very answer turn 2 is asked after
    assert generate(target, DraftModelDrafter(draft), first, max_new_tokens=6, eos_token_id=2).tokens == answer
    text = tok.decode([t for t in answer if t != 2], skip_special_tokens=True)
    expected = f"<s>[INST] Write a haiku. [/INST]{text}</s>[INST] Now make it rhyme. [/INST]"
    assert asked.prompts[1].tolist() == rendered(tok, expected)


@pytest.fixture(scope="module")
def mt_bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("mt") / "question.jsonl", MT_BENCH)


def test_mt_bench_through_eval_reports_each_category_and_turn(toy_dir, mt_bench, tmp_path, run_cli):
    out = tmp_path / "e"
    args = toy_eval_args(
        "eval",
        toy_dir,
        *("--draft", toy_dir / "draft"),
        prompts=mt_bench,
        max_new_tokens=6,
        out=out,
        extra=["--no-distances"],
    )
    code, stdout, err = run_cli(args)
    assert code == 0, err
    assert "prompt 1 (row 0, turn 1) as the target reads it: '<s>[INST] Write a haiku. [/INST]'" in stdout
    assert "prompt 2 (row 0, turn 2) as the target reads it: '<s>[INST] Write a haiku. [/INST]" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 6
    assert report["prompts_source"]["format"] == "turns" and report["prompts_source"]["rows"] == 3
    draft = report["methods"][1]
    groups = [(t["task"], t["turn"], t["prompts"]) for t in draft["tasks"]]
    assert groups == [("writing", 1, 2), ("writing", 2, 2), ("coding", 1, 1), ("coding", 2, 1)]
    assert all(0.0 <= t["alpha"] <= 1.0 for t in draft["tasks"])
    assert sum(t["new_tokens"] for t in draft["tasks"]) == draft["new_tokens"]
    assert "| draft | writing | 2 | 2 |" in stdout and "| target-only | writing |" not in stdout
    assert "prompts: 6 (3 rows, up to 2 turns each)" in stdout
    assert "## Per task" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([MT_BENCH[0], {"question_id": 2, "category": "x"}], "q.jsonl line 2: missing 'turns' (other rows have it)"),
        ([MT_BENCH[0], {"turns": []}], "q.jsonl line 2: 'turns' must be a non-empty list of user messages"),
        ([{"turns": ["a", 3]}], "q.jsonl line 1, turns turn 1: expected a non-empty string (a user message), got int"),
        ([{"id": 1}], "q.jsonl: no usable column; found ['id']"),
        ([{"turns": ["a"], "category": 7}], 'q.jsonl line 1: "category" (the task) must be a non-empty string'),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_line(toy_dir, tmp_path, run_cli, rows, message):
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    for command in (["eval", "--out", tmp_path / "e"], ["check-lossless", "--samples", 100]):
        args = [*command, "--target", toy_dir / "target", "--prompt-lookup", "--prompts", path, "--no-progress"]
        code, _, err = run_cli(args)
        assert code == 2 and message in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "e").exists()


def test_generate_reads_mt_bench_turns_and_refuses_token_ids(toy_dir, mt_bench, tmp_path, run_cli):
    from draftsmith.distill.sources import assistant_turns

    record = load_source(str(mt_bench)).records[0]
    assert assistant_turns(record.messages) == [1, 3]  # the target answers both questions
    out = tmp_path / "data"
    args = ["generate", "--target", toy_dir / "target", "--max-new-tokens", 4, "--no-progress", "--device", "cpu"]
    code, _, err = run_cli([*args, "--prompts", mt_bench, "--limit", 1, "--out", out])
    assert code == 0, err
    from draftsmith.distill.data import DistillData

    first = DistillData(out)[0]
    prompt = first["input_ids"][: first["prompt_length"]]
    assert prompt == rendered(tiny_tokenizer(), "<s>[INST] Write a haiku. [/INST]")  # the eval prompt too
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6]}])
    code, _, err = run_cli([*args, "--prompts", ids, "--out", tmp_path / "d2"])
    assert code == 2 and "holds pre-tokenised input_ids: generation needs text prompts" in err, err


def test_serving_task_rows_name_the_turn():
    from draftsmith.eval.sweep.analysis import task_rows

    entry = {
        "task": "writing",
        "prompts": 1,
        "new_tokens": 4,
        "target_calls": 2,
        "alpha": 0.5,
        "tau": 2.0,
        "speedup": 1.1,
    }
    report = {"methods": [{"method": "draft", "tasks": [{**entry, "turn": 1}, {**entry, "turn": 2}, entry]}]}
    assert [r["task"] for r in task_rows(report)] == ["writing (turn 1)", "writing (turn 2)", "writing"]
