"""`draftsmith generate` / `inspect-data`: the target's own answers, masks, shards, resume."""

import json

import pytest
import torch
from lifecycle_helpers import generate_cli_args, interrupt_call, toy_generate_args
from transformers import GenerationConfig

from draftsmith.distill import data as store
from draftsmith.distill import generate as gen
from draftsmith.distill.data import DataError, DistillData
from draftsmith.distill.generate import GenerateSettings
from draftsmith.distill.generate_run import generate_dataset
from draftsmith.distill.sources import load_source
from draftsmith.heads.models import load_causal_lm, load_tokenizer
from draftsmith.heads.toy import CHAT_TEMPLATE

TEMPLATE = CHAT_TEMPLATE  # Mistral-style, over the toy tokenizer's own <s> ... </s>


@pytest.fixture(scope="module")
def target(toy_dir):
    return load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(toy_dir):
    return load_tokenizer(toy_dir / "target")


def quiet(*args, **kwargs):
    pass


def test_plain_prompts_get_the_targets_own_greedy_answers(toy_data, target, tokenizer, toy_dir):
    data = DistillData(toy_data)
    assert len(data) == 6 and data.summary["num_shards"] == 2
    prompts = [json.loads(line)["prompt"] for line in (toy_dir / "prompts.jsonl").read_text().splitlines()[:6]]
    answers = []
    for i, prompt in enumerate(prompts):
        row = data[i]
        prompt_ids = tokenizer(prompt).input_ids
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids and row["prompt_length"] == len(prompt_ids)
        # batched, left-padded generation equals generating this prompt alone, unpadded
        alone = target.generate(
            torch.tensor([prompt_ids]),
            generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0),
        )[0, len(prompt_ids) :].tolist()
        if 2 in alone:  # generate pads after the stop token; the data ends with it
            alone = alone[: alone.index(2) + 1]
        assert row["input_ids"][len(prompt_ids) :] == alone
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * len(alone)
        assert row["finish_reason"] == ("stop" if alone[-1] == 2 else "length")
        assert row["num_trained"] == len(alone) and row["length"] == len(prompt_ids) + len(alone)
        answers.append(alone)
    s = data.summary
    trained = sum(map(len, answers))
    truncated = sum(a[-1] != 2 for a in answers)
    assert 0 < truncated < 6  # the toy target stops on some prompts: both finish reasons occur
    assert s["samples"] == 6 and s["trained_tokens"] == trained and s["truncated"] == truncated
    assert s["truncation_rate"] == pytest.approx(truncated / 6)
    assert s["tokens"] == sum(data[i]["length"] for i in range(6))
    assert int(data.token_counts().sum()) == trained
    data.verify_hash()
    prov = data.provenance
    assert prov["settings"]["temperature"] == 0.0 and prov["settings"]["max_new_tokens"] == 8
    assert prov["source"]["format"] == "prompt" and prov["chat_template"]["used"] is False
    assert len(prov["target"]["fingerprint"]) == 64 and prov["tokenizer_hash"]


def test_stop_token_ends_an_answer(target, tokenizer, toy_dir, tmp_path, monkeypatch):
    # Make the target say </s> after whatever it says first: the answer ends there, flagged "stop".
    source = load_source(str(toy_dir / "prompts.jsonl"), limit=2)
    settings = GenerateSettings(max_new_tokens=5, shard_size=8)

    def stop_after_one(model, prompts, budgets, settings, stop_ids, pad_id):
        assert stop_ids == [2]
        return [([7, 2], "stop") for _ in prompts]

    monkeypatch.setattr(gen, "_generate_batch", stop_after_one)
    summary = generate_dataset(
        target, tokenizer, source, tmp_path / "d", settings, template=None, progress=False, log=quiet
    )
    row = DistillData(tmp_path / "d")[0]
    assert row["input_ids"][-2:] == [7, 2] and row["loss_mask"][-2:] == [1, 1] and row["finish_reason"] == "stop"
    assert summary["truncated"] == 0


def test_multi_turn_regenerates_every_assistant_turn(target, tokenizer, tmp_path, monkeypatch):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "first question"},
                {"from": "gpt", "value": "OLD ANSWER ONE"},
                {"from": "human", "value": "second question"},
                {"from": "gpt", "value": "OLD ANSWER TWO"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "OLD GREETING"}, {"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "gpt", "value": "nobody asked"}]},
    ]
    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    answers = iter(["new one", "new two", "new three"])
    seen_prompts = []

    def fake(model, prompts, budgets, settings, stop_ids, pad_id):
        seen_prompts.extend(tokenizer.decode(p) for p in prompts)
        return [(tokenizer(next(answers)).input_ids + [2], "stop") for _ in prompts]

    monkeypatch.setattr(gen, "_generate_batch", fake)
    settings = GenerateSettings(max_new_tokens=16, batch_size=1)
    summary = generate_dataset(
        target, tokenizer, load_source(str(src)), tmp_path / "d", settings, template=TEMPLATE, progress=False, log=quiet
    )
    assert summary["samples"] == 2 and summary["skipped"] == {"no_user_turn": 1}
    assert not any("OLD" in p for p in seen_prompts)  # every turn sees regenerated history only
    data = DistillData(tmp_path / "d")
    by_record = {data[i]["record_index"]: data[i] for i in range(2)}
    two_turns = by_record[0]
    text = tokenizer.decode(two_turns["input_ids"])
    assert text.startswith("<s>[INST] first question [/INST]") and "OLD" not in text
    trained = tokenizer.decode([t for t, m in zip(two_turns["input_ids"], two_turns["loss_mask"]) if m])
    assert trained in ("new one</s>new three</s>", "new one</s>new two</s>")
    assert two_turns["num_turns"] == 2 and two_turns["finish_reason"] == "stop"
    one_turn = by_record[1]  # the greeting before the first user turn is dropped
    assert "OLD" not in tokenizer.decode(one_turn["input_ids"]) and one_turn["num_turns"] == 1
    assert tokenizer.decode([t for t, m in zip(one_turn["input_ids"], one_turn["loss_mask"]) if m]).endswith("</s>")
    assert data.provenance["source"]["format"] == "sharegpt" and data.provenance["chat_template"]["used"]


def test_long_prompts_are_skipped_and_counted(toy_dir, tmp_path, run_cli):
    out = tmp_path / "d"
    code, stdout, err = run_cli(
        generate_cli_args(
            toy_dir, "--limit", 4, "--max-length", 40, "--max-new-tokens", 4, "--chat-template", "none", out=out
        )
    )
    assert code == 0, err
    summary = DistillData(out).summary
    lengths = [
        len(load_tokenizer(toy_dir / "target")(json.loads(l)["prompt"]).input_ids)
        for l in (toy_dir / "prompts.jsonl").read_text().splitlines()[:4]
    ]
    too_long = sum(n >= 40 for n in lengths)
    assert too_long > 0 and summary["skipped"].get("prompt_too_long", 0) == too_long
    assert summary["samples"] == 4 - too_long
    assert "prompt too long" in stdout
    # answers are capped so that prompt + answer fits in --max-length
    assert all(DistillData(out)[i]["length"] <= 40 for i in range(summary["samples"]))


def test_interrupted_run_resumes_to_the_same_dataset(target, tokenizer, toy_dir, tmp_path, monkeypatch):
    source = load_source(str(toy_dir / "prompts.jsonl"), limit=5)
    settings = GenerateSettings(
        max_new_tokens=6, temperature=1.0, top_p=0.9, num_samples=2, batch_size=3, shard_size=3, seed=7
    )

    def run(out):
        return generate_dataset(target, tokenizer, source, out, settings, template=None, progress=False, log=quiet)

    whole = run(tmp_path / "whole")
    real = interrupt_call(monkeypatch, store, "write_shard", 3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "part")
    with pytest.raises(DataError, match="incomplete.*rerun"):
        DistillData(tmp_path / "part")
    (tmp_path / "part" / "shards" / ".shard-00002.stale").mkdir()  # what a killed run leaves behind
    monkeypatch.setattr(store, "write_shard", real)
    resumed = run(tmp_path / "part")
    assert resumed["data_hash"] == whole["data_hash"] and resumed["samples"] == whole["samples"] == 10
    a, b = DistillData(tmp_path / "whole"), DistillData(tmp_path / "part")
    assert [a[i] for i in range(10)] == [b[i] for i in range(10)]
    assert len({tuple(a[i]["input_ids"]) for i in range(10)}) > 5  # sampling: answers differ
    assert not [p for p in (tmp_path / "part" / "shards").iterdir() if p.name.startswith(".")]


def test_resume_with_other_settings_is_refused(toy_dir, toy_data, run_cli):
    code, _, err = run_cli(toy_generate_args(toy_dir, toy_data, max_new_tokens=9))
    assert code == 2 and "other settings" in err


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("rows.jsonl", '{"question_text": "hi"}\n', "prompt"),
        ("rows.jsonl", "", "no rows"),
        ("rows.txt", "hello\n", ".jsonl"),
    ],
)
def test_bad_sources_are_clear_errors_and_write_nothing(toy_dir, tmp_path, run_cli, name, content, message):
    src = tmp_path / name
    src.write_text(content)
    out = tmp_path / "out"
    code, _, err = run_cli(generate_cli_args(toy_dir, prompts=src, out=out, device=None))
    assert code == 2 and str(src) in err and message in err
    assert not out.exists()


def test_bad_template_and_settings(toy_dir, tmp_path, run_cli):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    out = tmp_path / "out"
    base = generate_cli_args(toy_dir, out=out, device=None)
    code, _, err = run_cli([*base, "--chat-template", bad])
    assert code == 2 and "template" in err.lower()
    assert not out.exists()
    code, _, err = run_cli([*base, "--chat-template", tmp_path / "missing.jinja"])
    assert code == 2 and "missing.jinja" in err
    code, _, err = run_cli([*base, "--num-samples", 2])
    assert code == 2 and "temperature > 0" in err
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, _, err = run_cli(generate_cli_args(toy_dir, "--chat-template", "none", prompts=chats, out=out, device=None))
    assert code == 2 and "no chat template" in err
    assert not out.exists()


def test_inspect_data_shows_trained_spans_and_provenance(toy_data, run_cli):
    code, stdout, err = run_cli(["inspect-data", toy_data, "--index", "-1", "--color", "never"])
    assert code == 0, err
    row = DistillData(toy_data)[5]
    assert "sample 5:" in stdout and f"finish: {row['finish_reason']}" in stdout
    assert stdout.count("\u27e6") == 2 and "hash" in stdout and "T = 0" in stdout  # legend + the one answer span
    code, _, err = run_cli(["inspect-data", toy_data, "--index", 6])
    assert code == 2 and "out of range" in err and "0..5" in err
    code, _, err = run_cli(["inspect-data", toy_data.parent / "nope"])
    assert code == 2 and "does not exist" in err
    assert f"{row['num_trained']} trained" in stdout


def test_toy_chats_through_the_command(toy_dir, tmp_path, run_cli):
    """make-toy's chats.jsonl with the toy tokenizer's own template (auto): the answer of the
    first turn is the target's; a turn cut at --max-new-tokens ends its conversation."""
    out = tmp_path / "chat-data"
    code, stdout, err = run_cli(
        generate_cli_args(toy_dir, "--limit", 3, "--max-new-tokens", 6, prompts=toy_dir / "chats.jsonl", out=out)
    )
    assert code == 0, err
    data = DistillData(out)
    assert data.provenance["chat_template"]["used"] and data.provenance["source"]["format"] == "sharegpt"
    tok = load_tokenizer(toy_dir / "target")
    for i in range(len(data)):
        row = data[i]
        text = tok.decode(row["input_ids"])
        assert text.startswith("<s>[INST] Continue:") and "[/INST]" in text
        if row["finish_reason"] == "length":  # cut: one turn, its 6 tokens trained, no end token
            assert row["num_turns"] == 1 and row["num_trained"] == 6 and row["input_ids"][-1] != 2
