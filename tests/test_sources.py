"""Prompt sources: every file type in every format, normalisation, and the errors users will hit."""

from __future__ import annotations

import csv
import json
import time

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith.distill.sources import Record, SourceError, assistant_turns, load_source

PROMPT_ROWS = [{"prompt": "Write a haiku."}, {"prompt": "Explain BPE, café ☕.\nBriefly."}]
SHAREGPT_ROWS = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
        ]
    },
    {"conversations": [{"from": "human", "value": "2+2?"}]},
]
MESSAGES_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ]
    },
    {"messages": [{"role": "user", "content": "2+2?"}]},
]
ROWS = {"prompt": PROMPT_ROWS, "sharegpt": SHAREGPT_ROWS, "messages": MESSAGES_ROWS}

# What both chat formats normalise to.
CHATS = (
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ),
    ({"role": "user", "content": "2+2?"},),
)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test may reach the Hub: a machine without network otherwise spends ~20 s in retries.
    `datasets` and `huggingface_hub` read these variables at import, hence the attributes too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def write(kind: str, tmp_path, rows, name: str = "data"):
    """Write `rows` as a source of `kind`; returns the spec to load."""
    if kind == "jsonl":
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)
    if kind == "json":
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
        return path
    if kind == "json-wrapped":
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"version": 2, "data": rows}), encoding="utf-8")
        return path
    if kind == "parquet":
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    if kind == "csv":  # CSV has no lists: conversations are stored as JSON text
        path = tmp_path / f"{name}.csv"
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                writer.writerow({k: v if isinstance(v, str) else json.dumps(v) for k, v in row.items()})
        return path
    if kind == "saved":
        path = tmp_path / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return path
    if kind == "saved-dict":
        path = tmp_path / name
        other = [dict(rows[0])]
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(other)}
        ).save_to_disk(str(path))
        return path
    raise AssertionError(kind)


KINDS = ["jsonl", "json", "json-wrapped", "parquet", "csv", "saved", "saved-dict"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_every_file_type_in_every_format(tmp_path, kind, fmt):
    spec = str(write(kind, tmp_path, ROWS[fmt]))
    src = load_source(spec)
    assert src.name == spec and src.format == fmt
    assert [r.index for r in src.records] == [0, 1]
    if fmt == "prompt":
        assert [r.prompt for r in src.records] == [row["prompt"] for row in PROMPT_ROWS]
        assert all(r.messages is None for r in src.records)
    else:
        assert tuple(r.messages for r in src.records) == CHATS
        assert all(r.prompt is None for r in src.records)
    # The fingerprint is the content's, not the file's: JSONL of the same rows gives the same.
    assert src.fingerprint == load_source(str(write("jsonl", tmp_path, ROWS[fmt], name="ref"))).fingerprint
    assert len(src.fingerprint) == 64 and int(src.fingerprint, 16) >= 0


def test_saved_dataset_dict_split(tmp_path):
    spec = str(write("saved-dict", tmp_path, PROMPT_ROWS))
    assert [r.prompt for r in load_source(spec, split="test").records] == [PROMPT_ROWS[0]["prompt"]]
    with pytest.raises(SourceError, match=r"has no split 'validation'; available splits: train, test"):
        load_source(spec, split="validation")


def test_sharegpt_role_mapping(tmp_path):
    speakers = ["system", "human", "gpt", "user", "chatgpt", "Human", "bard", "USER", "model", "assistant"]
    conv = [{"from": s, "value": f"turn {i}"} for i, s in enumerate(speakers)]
    src = load_source(str(write_jsonl(tmp_path / "s.jsonl", [{"conversations": conv}])))
    roles = [m["role"] for m in src.records[0].messages]
    user, bot = "user", "assistant"
    assert roles == ["system", user, bot, user, bot, user, bot, user, bot, bot]
    assert [m["content"] for m in src.records[0].messages] == [f"turn {i}" for i in range(len(speakers))]


def test_openai_content_parts_developer_role_and_extra_keys(tmp_path):
    row = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": "Hi", "name": "bot", "reasoning_content": "think"},
        ]
    }
    src = load_source(str(write_jsonl(tmp_path / "m.jsonl", [row])))
    assert src.records[0].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": "Hi"},
    )


def test_column_priority(tmp_path):
    both = [{"prompt": "ignored", "messages": [{"role": "user", "content": "chat wins"}]}]
    assert load_source(str(write_jsonl(tmp_path / "a.jsonl", both))).format == "messages"
    plain = [{"question": "q", "instruction": "i", "text": "t", "id": 7}]
    assert load_source(str(write_jsonl(tmp_path / "b.jsonl", plain))).records[0].prompt == "t"


def test_limit_keeps_the_first_rows_and_reads_no_further(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(5)] + [{"prompt": 3}])
    src = load_source(str(path), limit=2)
    assert [r.prompt for r in src.records] == ["p0", "p1"]
    first_two = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "p0"}, {"prompt": "p1"}])
    assert src.fingerprint == load_source(str(first_two)).fingerprint
    for kind in ("parquet", "saved"):
        assert len(load_source(str(write(kind, tmp_path, PROMPT_ROWS)), limit=1).records) == 1
    with pytest.raises(SourceError, match="limit must be a positive"):
        load_source(str(path), limit=0)


def test_fingerprint_follows_content(tmp_path):
    base = load_source(str(write_jsonl(tmp_path / "a.jsonl", MESSAGES_ROWS)))
    assert load_source(str(write_jsonl(tmp_path / "a.jsonl", MESSAGES_ROWS))).fingerprint == base.fingerprint
    assert load_source(str(write("parquet", tmp_path, SHAREGPT_ROWS))).fingerprint == base.fingerprint
    changed = json.loads(json.dumps(MESSAGES_ROWS))
    changed[1]["messages"][0]["content"] = "2+3?"
    assert load_source(str(write_jsonl(tmp_path / "b.jsonl", changed))).fingerprint != base.fingerprint
    swapped = load_source(str(write_jsonl(tmp_path / "c.jsonl", MESSAGES_ROWS[::-1])))
    assert swapped.fingerprint != base.fingerprint  # order-sensitive
    role = json.loads(json.dumps(MESSAGES_ROWS))
    role[0]["messages"][0]["role"] = "user"
    assert load_source(str(write_jsonl(tmp_path / "d.jsonl", role))).fingerprint != base.fingerprint


def test_json_file_holding_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "p.json", PROMPT_ROWS)  # one object per line under a .json name
    assert [r.prompt for r in load_source(str(path)).records] == [row["prompt"] for row in PROMPT_ROWS]


def test_hub_dataset_is_loaded_with_the_split(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"text": "a", "image": [1, 2]}, {"text": "b", "image": [3]}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = load_source("some-org/some-prompts", split="test", limit=1)
    assert calls == [("some-org/some-prompts", "test")]
    assert src.format == "prompt" and src.records == (Record(0, "a", None),)


# --- errors ----------------------------------------------------------------------------------


def test_missing_column_lists_found_and_expected(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"foo": "a", "bar": "b"}])
    with pytest.raises(SourceError) as info:
        load_source(str(path))
    message = str(info.value)
    assert str(path) in message and "['foo', 'bar']" in message
    for expected in ("'messages'", "'conversations'", "'prompt'", "'text'", "'instruction'", "'question'"):
        assert expected in message


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved"])
def test_empty_source(tmp_path, kind):
    if kind == "jsonl":
        spec = tmp_path / "e.jsonl"
        spec.write_text("\n\n", encoding="utf-8")
    elif kind == "json":
        spec = tmp_path / "e.json"
        spec.write_text("[]", encoding="utf-8")
    elif kind == "csv":
        spec = tmp_path / "e.csv"
        spec.write_text("prompt\n", encoding="utf-8")
    elif kind == "parquet":
        spec = tmp_path / "e.parquet"
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), spec)
    else:
        spec = tmp_path / "e"
        datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(spec))
    with pytest.raises(SourceError, match="has no rows"):
        load_source(str(spec))


def test_empty_files_of_zero_bytes(tmp_path):
    for name in ("z.jsonl", "z.json", "z.csv"):
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(SourceError, match="has no rows"):
            load_source(str(tmp_path / name))


def test_unknown_extension_lists_supported(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n", encoding="utf-8")
    expected = r"prompts\.txt: unsupported file type '\.txt'; expected one of \.jsonl, \.json, \.parquet, \.csv"
    with pytest.raises(SourceError, match=expected):
        load_source(str(path))


def test_malformed_jsonl_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"bad\.jsonl line 4: malformed JSON"):
        load_source(str(path))
    path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"bad\.jsonl line 2: expected a JSON object, got list"):
        load_source(str(path))


def test_unknown_roles(tmp_path):
    call = {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{}"}]}
    sharegpt = [SHAREGPT_ROWS[0], call]
    with pytest.raises(SourceError, match=r"line 2, conversations turn 1: unknown 'from' value 'function_call'"):
        load_source(str(write_jsonl(tmp_path / "s.jsonl", sharegpt)))
    openai = [{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}]
    with pytest.raises(SourceError, match=r"row 0, messages turn 1: unknown 'role' value 'tool'"):
        load_source(str(write("parquet", tmp_path, openai)))


@pytest.mark.parametrize("bad", [5, None, "", "   ", ["a"]])
def test_prompt_must_be_a_non_empty_string(tmp_path, bad):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": bad}])
    with pytest.raises(SourceError, match=r"p\.jsonl line 2: 'prompt' must be a non-empty string"):
        load_source(str(path))


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "is an empty conversation"),
        ("not json", "holds a string that is not a JSON list of turns"),
        ({"role": "user"}, "must be a list of turns"),
        ([{"role": "user", "content": None}], "'content' must be a string"),
        ([{"role": "user"}], "expected an object with 'role' and 'content'"),
        ([{"role": ["user"], "content": "x"}], "unknown 'role' value ['user']"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "content part 0 has type 'image_url'",
        ),
    ],
)
def test_bad_conversations(tmp_path, messages, expected):
    path = write_jsonl(tmp_path / "m.jsonl", [MESSAGES_ROWS[0], {"messages": messages}])
    with pytest.raises(SourceError, match=r"m\.jsonl line 2") as info:
        load_source(str(path))
    assert expected in str(info.value)


def test_missing_key_in_a_later_row_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"text": "b"}\n', encoding="utf-8")  # blank lines still count
    with pytest.raises(SourceError, match=r"p\.jsonl line 3: missing 'prompt'"):
        load_source(str(path))


def test_json_object_with_several_lists(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"train": PROMPT_ROWS, "test": PROMPT_ROWS}), encoding="utf-8")
    expected = r"exactly one list; got an object whose list-valued keys are \['train', 'test'\]"
    with pytest.raises(SourceError, match=expected):
        load_source(str(path))


def test_folder_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(SourceError, match="is a folder but not a dataset written by datasets' save_to_disk"):
        load_source(str(tmp_path / "notes"))


def test_missing_file_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(SourceError, match=r"nope\.jsonl does not exist"):
        load_source(str(tmp_path / "nope.jsonl"))


def test_unknown_name_offline_fails_fast():
    started = time.perf_counter()
    with pytest.raises(SourceError) as info:
        load_source("no-such-org/no-such-dataset-xyz")
    assert time.perf_counter() - started < 10
    message = str(info.value)
    assert message.startswith("no-such-org/no-such-dataset-xyz does not exist locally")
    assert "Hugging Face Hub" in message and "failed:" in message and "split 'train'" in message


# --- assistant_turns -------------------------------------------------------------------------


def msgs(*roles):
    return tuple({"role": role, "content": str(i)} for i, role in enumerate(roles))


@pytest.mark.parametrize(
    "roles, turns",
    [
        (("user",), [1]),
        (("system", "user"), [2]),
        (("user", "assistant"), [1]),
        (("system", "user", "assistant", "user"), [2, 4]),
        (("user", "assistant", "user", "assistant"), [1, 3]),
        (("assistant", "user", "assistant"), [0, 2]),
        (("system", "assistant"), []),
        (("system",), []),
        (("assistant",), []),
    ],
)
def test_assistant_turns(roles, turns):
    assert assistant_turns(msgs(*roles)) == turns
    assert assistant_turns(list(msgs(*roles))) == turns
