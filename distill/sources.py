"""Prompt datasets for `draftsmith generate`: read a file, a saved dataset or a hub dataset, and
normalise every row to one plain prompt or one chat conversation.

    load_source("prompts.jsonl")                  # {"prompt": "..."} per line
    load_source("chats.parquet", limit=1000)      # "messages" (OpenAI) or "conversations" (ShareGPT)
    load_source("data/saved", split="test")       # a folder written by `datasets.save_to_disk`
    load_source("org/name", split="train")        # anything else: `datasets.load_dataset`

The format is decided by the columns, in this order:
  "messages"      -> "messages": OpenAI style, a list of {"role", "content"};
  "conversations" -> "sharegpt": a list of {"from", "value"};
  "turns"         -> "turns": MT-bench / Spec-Bench question.jsonl, a list of user messages;
  "input_ids"     -> "input_ids": a pre-tokenised prompt (a list of token ids);
  else the first of "prompt", "text", "instruction", "question" -> "prompt".
Chat rows are normalised to ({"role": "system"|"user"|"assistant", "content": str}, ...): other
keys of a turn (name, tool_calls, reasoning_content, ...) are dropped, so a chat template never
sees them. A chat cell may also hold the conversation as a JSON string (CSV files have no lists).
A "turns" row [q1, q2] becomes (user q1, assistant "", user q2): every assistant turn is answered
by the target itself (`assistant_turns`), so the empty one stands where its answer to q1 goes.

Each row may also name its task (`Record.task`, the per-task tables of `draftsmith eval`): the
string under `task_key`, by default "task", else "category" (MT-bench's column).

Bad rows are errors, never skipped: self-distillation regenerates every assistant turn, and a
silently dropped row would change the data behind a fingerprint. Error messages locate the row as
"FILE line N" (1-based) for JSONL and "SOURCE row N" (0-based, the same number as
`Record.index`) for everything else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
PROMPT_COLUMNS = ("prompt", "text", "instruction", "question")  # first one present wins
CHAT_COLUMNS = {"messages": "messages", "conversations": "sharegpt", "turns": "turns"}  # column -> format
TASK_COLUMNS = ("task", "category")  # the task of a row when no task_key is given: the first present
NO_TASK = "(no task)"  # the group of rows without a task in per-task tables (so no row may use it)

# ShareGPT dumps disagree on the speaker names; they are matched case-insensitively.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
# "developer" is the OpenAI API's newer name for the system role. Tool turns are refused: the
# target regenerates assistant turns, and a tool result written for another answer would not fit.
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class SourceError(ValueError):
    """A prompt source that cannot be used; the message names the source, the row and what was expected."""


@dataclass(frozen=True)
class Record:
    index: int  # 0-based row number in the source
    prompt: str | None  # "prompt" format: the prompt text
    messages: tuple[dict, ...] | None  # chat formats: ({"role": ..., "content": str}, ...)
    input_ids: tuple[int, ...] | None = None  # "input_ids" format: the prompt's token ids
    task: str | None = None  # what kind of prompt this is (per-task tables); not in the fingerprint
    where: str = field(default="", compare=False)  # "FILE line 7" / "SOURCE row 6": the row in error messages


@dataclass(frozen=True)
class Source:
    name: str  # what the user passed
    format: str  # "prompt" | "sharegpt" | "messages" | "turns" | "input_ids"
    records: tuple[Record, ...]
    fingerprint: str  # sha256 hex of the normalised records, order-sensitive (provenance, resume)


@dataclass
class _Table:
    """Raw rows before normalisation: `read(column, limit)` returns that column's first values."""

    columns: list[str]
    num_rows: int
    read: Callable[..., list[Any]]  # read(column, limit, optional=False); optional: None where a row lacks it
    where: Callable[[int], str]  # row index -> "FILE line 7" / "SOURCE row 6"


def load_source(spec: str, *, split: str = "train", limit: int | None = None, task_key: str | None = None) -> Source:
    """Read `spec` (file, saved dataset folder or hub name) and normalise its first `limit` rows.
    `task_key`: the column naming each row's task (None: "task", else "category", if present)."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SourceError(f"{spec}: limit must be a positive number of rows or None, got {limit!r}")
    table = _open(str(spec), split)
    if table.num_rows == 0:
        raise SourceError(f"{spec} has no rows")
    fmt, column = _detect_format(str(spec), table.columns)
    values = table.read(column, limit)
    if task_key is None:
        task_key = next((c for c in TASK_COLUMNS if c in table.columns), None)
    tasks = [None] * len(values)
    if task_key is not None and task_key in table.columns:
        tasks = table.read(task_key, limit, optional=True)
    records = []
    for i, (value, task) in enumerate(zip(values, tasks)):
        where = table.where(i)
        prompt = messages = ids = None
        if fmt == "prompt":
            prompt = _prompt(value, column, where)
        elif fmt == "input_ids":
            ids = _token_ids(value, column, where)
        elif fmt == "turns":
            messages = _user_turns(value, column, where)
        else:
            messages = _conversation(value, column, fmt, where)
        records.append(Record(i, prompt, messages, ids, _task(task, task_key, where), where))
    records = tuple(records)
    return Source(name=str(spec), format=fmt, records=records, fingerprint=fingerprint(records))


def fingerprint(records) -> str:
    """sha256 of the normalised records in order. It depends on the content only, not on the file
    type or the column name, so the same data saved as JSONL or parquet has the same fingerprint."""
    digest = hashlib.sha256()
    for record in records:
        messages = None if record.messages is None else [[m["role"], m["content"]] for m in record.messages]
        fields = [record.prompt, messages] + ([list(record.input_ids)] if record.input_ids is not None else [])
        line = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def assistant_turns(messages) -> list[int]:
    """Indices of the turns the target must (re)generate.

    Every assistant message, plus len(messages) when the conversation ends with a user message (a
    new assistant turn to append). A conversation without any user message has nothing to answer:
    [] (the caller skips and counts it). An assistant message that comes before the first user
    message (a greeting) is still listed; note that the chat template cannot render the empty
    conversation before an assistant turn at index 0.
    """
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        return []
    turns = [i for i, role in enumerate(roles) if role == "assistant"]
    if roles[-1] == "user":
        turns.append(len(roles))
    return turns


# --- opening the source -------------------------------------------------------------------------


def _open(spec: str, split: str) -> _Table:
    path = Path(spec).expanduser()
    if path.is_dir():
        return _open_saved(spec, path, split)
    if path.is_file():
        suffix = path.suffix.lower()
        readers = {".jsonl": _open_jsonl, ".json": _open_json, ".parquet": _open_parquet, ".csv": _open_csv}
        if suffix not in readers:
            raise SourceError(
                f"{spec}: unsupported file type {path.suffix or '(no extension)'!r}; expected one of "
                f"{', '.join(SUPPORTED_EXTENSIONS)}, a folder written by datasets' save_to_disk, or a hub dataset name"
            )
        return readers[suffix](spec, path)
    # Something that is plainly a file path cannot be a hub name: fail now rather than spend a hub
    # round trip (about 20 s of retries on a machine without network) to say the same thing.
    if path.suffix.lower() in SUPPORTED_EXTENSIONS or spec.startswith(("/", "./", "../", "~")):
        raise SourceError(f"{spec} does not exist")
    return _open_hub(spec, split)


def _dataset_table(name: str, ds) -> _Table:
    """A `datasets.Dataset`: columns are read one at a time, so unused columns (images, long
    metadata) are never turned into Python objects."""

    def read(column, limit, optional=False):
        part = ds if limit is None else ds.select(range(min(limit, len(ds))))
        return part.select_columns([column]).to_dict()[column]

    return _Table(list(ds.column_names), len(ds), read, lambda i: f"{name} row {i}")


def _open_saved(spec: str, path: Path, split: str) -> _Table:
    import datasets  # imported here: it costs about a second and plain files do not need it

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise SourceError(
            f"{spec} is a folder but not a dataset written by datasets' save_to_disk ({_short(err)}); "
            f"give a {'/'.join(SUPPORTED_EXTENSIONS)} file or a saved dataset folder"
        ) from None
    except Exception as err:  # noqa: BLE001  (any failure becomes a message naming the folder)
        # datasets 5.2 cannot reload a saved dataset of zero rows (it has no Arrow shard, and
        # load_from_disk fails with an IndexError): say what the user needs to know.
        empty = _saved_without_shards(path)
        if empty is not None:
            raise SourceError(f"{spec} has no rows ({empty} of the saved dataset has no data files)") from None
        raise SourceError(f"{spec}: datasets.load_from_disk could not read this folder ({_short(err)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise SourceError(f"{spec} has no split {split!r}; available splits: {', '.join(ds)}")
        ds = ds[split]
    return _dataset_table(spec, ds)


def _saved_without_shards(path: Path) -> str | None:
    """The part of a save_to_disk folder ("the folder" or "split NAME") whose state.json lists no
    data files, or None."""
    for state in [path / "state.json", *sorted(path.glob("*/state.json"))]:
        try:
            if not json.loads(state.read_text(encoding="utf-8")).get("_data_files", [None]):
                return "the folder" if state.parent == path else f"split {state.parent.name!r}"
        except (OSError, ValueError):
            continue
    return None


def _open_hub(spec: str, split: str) -> _Table:
    import datasets

    try:
        ds = datasets.load_dataset(spec, split=split)
    except Exception as err:  # noqa: BLE001  (offline, unknown name, missing split, gated repo: one message)
        raise SourceError(
            f"{spec} does not exist locally (no such file or folder), and loading it as a Hugging Face "
            f"Hub dataset (split {split!r}) failed: {_short(err)}"
        ) from None
    return _dataset_table(spec, ds)


def _rows_table(rows: list[dict], where: Callable[[int], str]) -> _Table:
    """A list of row objects whose keys may differ: the columns are the union, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def read(column, limit, optional=False):
        part = rows if limit is None else rows[:limit]
        values = []
        for i, row in enumerate(part):
            if column not in row and optional:
                values.append(None)
                continue
            if column not in row:
                raise SourceError(f"{where(i)}: missing {column!r} (other rows have it); found keys {sorted(row)}")
            values.append(row[column])
        return values

    return _Table(columns, len(rows), read, where)


def _open_jsonl(spec: str, path: Path) -> _Table:
    # Parsed here rather than by `datasets`, which reports a broken line without its number.
    rows, lines = [], []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, hand-edited files) hold no row
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{spec} line {lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise SourceError(f"{spec} line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            lines.append(lineno)
    return _rows_table(rows, lambda i: f"{spec} line {lines[i]}")


def _open_json(spec: str, path: Path) -> _Table:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise SourceError(f"{spec} has no rows (the file is empty)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # one object per line under a .json name: read it as JSONL
            return _open_jsonl(spec, path)
        raise SourceError(f"{spec}: malformed JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(data, dict):
        lists = [key for key, value in data.items() if isinstance(value, list)]
        if len(lists) != 1:
            raise SourceError(
                f"{spec}: expected a list of row objects, or an object holding exactly one list; "
                f"got an object whose list-valued keys are {lists}"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise SourceError(f"{spec}: expected a list of row objects, got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise SourceError(f"{spec} row {i}: expected a JSON object, got {type(row).__name__}")
    return _rows_table(data, lambda i: f"{spec} row {i}")


def _open_parquet(spec: str, path: Path) -> _Table:
    # pyarrow directly (it comes with `datasets`): no copy into the datasets cache, and only the
    # chosen column is read from disk.
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001  (pyarrow raises several types for a broken file)
        raise SourceError(f"{spec}: not a readable parquet file ({_short(err)})") from None

    def read(column, limit, optional=False):
        table = pq.read_table(path, columns=[column])
        if limit is not None:
            table = table.slice(0, limit)
        return table.column(column).to_pylist()

    return _Table(list(meta.schema_arrow.names), meta.metadata.num_rows, read, lambda i: f"{spec} row {i}")


def _open_csv(spec: str, path: Path) -> _Table:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    if path.stat().st_size == 0:
        raise SourceError(f"{spec} has no rows (the file is empty)")
    try:
        # Prompts are multi-line text: quoted newlines must not end a row (pyarrow's default
        # assumes they never occur, which is only faster).
        table = pcsv.read_csv(path, parse_options=pcsv.ParseOptions(newlines_in_values=True))
    except pa.ArrowInvalid as err:
        raise SourceError(f"{spec}: not a readable CSV file ({_short(err)})") from None

    def read(column, limit, optional=False):
        part = table if limit is None else table.slice(0, limit)
        return part.column(column).to_pylist()

    return _Table(list(table.column_names), table.num_rows, read, lambda i: f"{spec} row {i}")


# --- normalising rows ---------------------------------------------------------------------------


def _detect_format(spec: str, columns: list[str]) -> tuple[str, str]:
    for column, fmt in CHAT_COLUMNS.items():
        if column in columns:
            return fmt, column
    if "input_ids" in columns:
        return "input_ids", "input_ids"
    for column in PROMPT_COLUMNS:
        if column in columns:
            return "prompt", column
    raise SourceError(
        f"{spec}: no usable column; found {columns}, expected 'messages' (OpenAI chat), "
        f"'conversations' (ShareGPT), 'turns' (MT-bench user turns), 'input_ids' (token ids) "
        f"or a prompt column ({', '.join(repr(c) for c in PROMPT_COLUMNS)})"
    )


def _task(value, key: str | None, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or value == NO_TASK:
        raise SourceError(
            f'{where}: "{key}" (the task) must be a non-empty string naming the kind of prompt '
            f'(e.g. "math"), got {_show(value)}'
        )
    return value


def _token_ids(value, column: str, where: str) -> tuple[int, ...]:
    value = _json_list(value, column, where, "a JSON list of token ids")
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, int) and t >= 0 for t in value):
        return tuple(value)
    raise SourceError(f"{where}: {column!r} must be a non-empty list of token ids (integers >= 0), got {_show(value)}")


def _user_turns(value, column: str, where: str) -> tuple[dict, ...]:
    """MT-bench turns [q1, q2, ...] -> (user q1, assistant "", user q2, ...): the target answers."""
    value = _json_list(value, column, where, "a JSON list of user messages")
    if not isinstance(value, (list, tuple)) or not value:
        raise SourceError(
            f"{where}: {column!r} must be a non-empty list of user messages (strings), got {_show(value)}"
        )
    messages = []
    for j, turn in enumerate(value):
        if not isinstance(turn, str) or not turn.strip():
            raise SourceError(
                f"{where}, {column} turn {j}: expected a non-empty string (a user message), got {_show(turn)}"
            )
        if j:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": turn})
    return tuple(messages)


def _json_list(value, column: str, where: str, expected: str):
    """A cell holding a list as JSON text (CSV files have no lists) -> the list; other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise SourceError(
            f"{where}: {column!r} holds a string that is not {expected} ({err.msg}); got {_show(value)}"
        ) from None


def _prompt(value, column: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"{where}: {column!r} must be a non-empty string, got {_show(value)}")
    return value


def _conversation(value, column: str, fmt: str, where: str) -> tuple[dict, ...]:
    value = _json_list(value, column, where, "a JSON list of turns")
    if not isinstance(value, (list, tuple)):
        raise SourceError(f"{where}: {column!r} must be a list of turns, got {_show(value)}")
    if not value:
        raise SourceError(f"{where}: {column!r} is an empty conversation")
    if fmt == "sharegpt":
        role_key, content_key, roles = "from", "value", SHAREGPT_ROLES
    else:
        role_key, content_key, roles = "role", "content", OPENAI_ROLES
    turns = []
    for j, turn in enumerate(value):
        here = f"{where}, {column} turn {j}"
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise SourceError(f"{here}: expected an object with {role_key!r} and {content_key!r}, got {_show(turn)}")
        raw_role = turn[role_key]
        role = None
        if isinstance(raw_role, str):
            role = roles.get(raw_role.lower() if fmt == "sharegpt" else raw_role)
        if role is None:
            raise SourceError(f"{here}: unknown {role_key!r} value {raw_role!r}; expected one of {sorted(roles)}")
        turns.append({"role": role, "content": _content(turn[content_key], content_key, here)})
    return tuple(turns)


def _content(content, key: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and content and all(isinstance(part, dict) for part in content):
        # OpenAI content parts. Joined with no separator, as chat templates that loop over parts do.
        texts = []
        for k, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise SourceError(
                    f"{where}: content part {k} has type {part.get('type')!r}; only text parts "
                    f'({{"type": "text", "text": "..."}}) can be rendered by a text chat template'
                )
            texts.append(part["text"])
        return "".join(texts)
    raise SourceError(f"{where}: {key!r} must be a string (or a list of text parts), got {_show(content)}")


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    reason = text[0] if text else type(err).__name__
    return reason[:300]
