"""Bad input to the data commands: one line naming the file or value and what to do, exit 2,
and nothing half-written left behind (`generate`, the data shards, `verify-data`)."""

import json
import os
import shutil

import pytest
import torch

from draftsmith.distill import data as store
from draftsmith.distill.data import DataError, DistillData
from draftsmith.heads.models import load_causal_lm


def generate_args(target, out, prompts, *extra):
    return [
        "generate",
        "--target",
        target,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        4,
        "--chat-template",
        "none",
        "--no-progress",
        "--device",
        "cpu",
        *extra,
    ]


def one_error(err: str) -> str:
    """The command's one error line (progress bars of the test's own model loading aside)."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("draftsmith ") and "Traceback" not in err, err
    return lines[0]


def listing(folder):
    """Every file under `folder` with its size and content: what a failed command must not change."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def arrow_file(data_dir, shard=0):
    return data_dir / store.SHARDS / store.shard_name(shard) / "data-00000-of-00001.arrow"


def copy_data(toy_data, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(toy_data, out)
    return out


def without_checksums(data_dir):
    """What a folder written before shards carried checksums looks like."""
    for shard in store.complete_shards(data_dir):
        stats = json.loads((shard / store.SHARD_STATS).read_text())
        del stats["files"]
        (shard / store.SHARD_STATS).write_text(json.dumps(stats))


@pytest.mark.parametrize("broken", ["nan_weight", "overflowing_logits"])
@pytest.mark.parametrize("temperature", [0, 1])
def test_11_non_finite_target_is_an_error_before_any_data(toy_dir, tmp_path, run_cli, broken, temperature):
    target = tmp_path / "target"
    shutil.copytree(toy_dir / "target", target)
    model = load_causal_lm(target, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        if broken == "nan_weight":
            model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        else:  # finite weights whose logits overflow float32: only the forward shows it
            model.get_output_embeddings().weight.fill_(3e38)
    model.save_pretrained(target)
    out = tmp_path / "d"
    code, _, err = run_cli(
        generate_args(target, out, toy_dir / "prompts.jsonl", "--limit", 2, "--temperature", temperature)
    )
    assert code == 2
    err = one_error(err)
    if broken == "nan_weight":
        assert "non-finite weights" in err and "model.layers.0.mlp.down_proj.weight" in err and str(target) in err
    else:
        assert "logits are NaN or inf" in err and "shard-00000" in err and "float32" in err
    assert "nothing was written" in err and not out.exists()


def test_12_every_prompt_too_long_is_an_error_and_writes_nothing(toy_dir, tmp_path, run_cli):
    out = tmp_path / "deep" / "d"
    code, _, err = run_cli(
        generate_args(toy_dir / "target", out, toy_dir / "prompts.jsonl", "--limit", 3, "--max-length", 8)
    )
    assert code == 2
    err = one_error(err)
    assert (
        "prompts.jsonl" in err and "--max-length 8" in err and "3 too long" in err and "raise --max-length past" in err
    )
    assert not (tmp_path / "deep").exists()
    # A shard whose prompts are all skipped (while others fit) is an empty table, not a crash.
    prompts = tmp_path / "p.jsonl"
    rows = ["short one", "short two", "long " * 60, "long " * 70]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    code, _, err = run_cli(generate_args(toy_dir / "target", out, prompts, "--max-length", 40, "--shard-size", 2))
    assert code == 0, err
    data = DistillData(out)
    assert len(data) == 2 and data.summary["skipped"] == {"prompt_too_long": 2} and len(data.dataset) == 2


def test_14_a_flipped_byte_in_a_shard_is_found_on_load(toy_data, tmp_path, run_cli):
    data_dir = copy_data(toy_data, tmp_path)
    arrow = arrow_file(data_dir, 1)
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    arrow.write_bytes(bytes(raw))
    before = listing(data_dir)
    for command in (["inspect-data", data_dir], ["verify-data", data_dir]):
        code, _, err = run_cli(command)
        assert code == 2
        err = one_error(err)
        assert str(arrow) in err and "corrupt (crc32" in err and "rerun the same `draftsmith generate`" in err
    with pytest.raises(DataError, match="corrupt"):
        _ = DistillData(data_dir).dataset
    assert listing(data_dir) == before


def test_14_verify_data_recomputes_the_hash_and_old_folders_still_load(toy_data, tmp_path, run_cli):
    code, stdout, err = run_cli(["verify-data", toy_data])
    assert code == 0, err
    assert stdout.startswith("ok:") and "2 with file checksums" in stdout and DistillData(toy_data).data_hash in stdout
    # Rows rewritten with fresh checksums pass the load check; the recomputed hash catches them.
    data_dir = copy_data(toy_data, tmp_path)
    shard = data_dir / store.SHARDS / store.shard_name(0)
    rows = store.load_shard(shard).to_list()
    rows[0]["input_ids"][0] += 1
    stats = json.loads((shard / store.SHARD_STATS).read_text())
    shutil.rmtree(shard)
    store.write_shard(rows, stats, shard)
    assert len(DistillData(data_dir).dataset) == 6
    code, _, err = run_cli(["verify-data", data_dir])
    assert code == 2 and "rows hash to" in err and "summary.json says" in err
    counts = data_dir / store.TOKEN_COUNTS  # the token counts are checked too
    counts.write_bytes(counts.read_bytes()[:20])
    code, _, err = run_cli(["inspect-data", data_dir])
    assert code == 0, err
    code, _, err = run_cli(["vocab-map", "--data", data_dir, "--draft-vocab-size", 8])
    assert code == 2 and str(counts) in one_error(err) and "cannot be read" in err and "rerun" in err
    # A folder written before checksums: loads unchecked, said once per folder.
    old = tmp_path / "old"
    shutil.copytree(toy_data, old)
    without_checksums(old)
    store._UNCHECKED_NOTED.discard(str(old))
    code, stdout, err = run_cli(["verify-data", old])
    assert code == 0 and "2 written without checksums" in stdout
    assert err.count("without shard checksums") == 1 and str(old) in err
    assert len(DistillData(old).dataset) == 6


@pytest.mark.parametrize("case", ["parent_is_a_file", "read_only_folder"])
def test_21_unwritable_out_is_checked_before_the_model_loads(toy_dir, tmp_path, run_cli, monkeypatch, case):
    from draftsmith.heads import models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(models, "load_causal_lm", no_load)
    monkeypatch.setattr(models, "load_tokenizer", no_load)
    if case == "parent_is_a_file":
        (tmp_path / "file").write_text("x")
        out, blocker = tmp_path / "file" / "d", "is a file, not a folder"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        if os.access(locked, os.W_OK):  # root writes anywhere: no permission to take away
            pytest.skip("a read-only folder is writable for this user")
        out, blocker = locked / "d", "is not writable ("
    code, _, err = run_cli(generate_args(toy_dir / "target", out, toy_dir / "prompts.jsonl"))
    assert code == 2
    err = one_error(err)
    assert f"--out {str(out)!r}" in err and blocker in err
    assert not out.exists()


@pytest.mark.parametrize("with_checksums", [True, False])
def test_24_truncated_shard_names_the_file_and_the_way_back(toy_dir, toy_data, tmp_path, run_cli, with_checksums):
    data_dir = copy_data(toy_data, tmp_path)
    if not with_checksums:
        without_checksums(data_dir)
    arrow = arrow_file(data_dir, 0)
    arrow.write_bytes(arrow.read_bytes()[:1000])
    code, _, err = run_cli(["inspect-data", data_dir])
    assert code == 2
    err = one_error(err)
    shard = data_dir / store.SHARDS / store.shard_name(0)
    if with_checksums:
        assert str(arrow) in err and "truncated (1000 of" in err
    else:
        assert f"data shard {str(shard)!r} cannot be read" in err
    assert f"delete {str(shard)!r} and rerun the same `draftsmith generate` command" in err
    # What the message says works: the shard is remade, the data is what it was.
    shutil.rmtree(shard)
    args = generate_args(
        toy_dir / "target", data_dir, toy_dir / "prompts.jsonl", "--limit", 6, "--batch-size", 3, "--shard-size", 4
    )
    args[args.index("--max-new-tokens") + 1] = 8  # the toy_data fixture's command
    code, stdout, err = run_cli(args)
    assert code == 0, err
    assert "resuming: 1 of 2 shards" in stdout
    assert DistillData(data_dir).verify()["data_hash"] == DistillData(toy_data).data_hash


@pytest.mark.parametrize(
    "target, says",
    [
        ("{tmp}/no/such/target", "does not exist: expected the target's folder"),
        ("no-org/no-such-model", "does not exist: no such folder, and no hub model of that name"),
    ],
)
def test_26_missing_target_says_it_does_not_exist(toy_dir, tmp_path, run_cli, target, says):
    target = target.format(tmp=tmp_path)
    out = tmp_path / "d"
    code, _, err = run_cli(generate_args(target, out, toy_dir / "prompts.jsonl"))
    assert code == 2
    err = one_error(err)
    assert f"--target {target!r}" in err and says in err and "tokenizer" not in err
    assert not out.exists()
