"""Offline hidden states: values equal a fresh forward, padding does not leak, mismatches are errors."""

import pytest
import torch
from lifecycle_helpers import cache_hidden_args, interrupt_call
from safetensors.torch import load_file

from draftsmith.distill import hidden_cache
from draftsmith.distill.data import DistillData
from draftsmith.distill.hidden_cache import (
    CacheError,
    Estimate,
    HiddenStateCache,
    cache_hidden_states,
    extract,
    parse_size,
    resolve_layers,
)
from draftsmith.heads.models import load_causal_lm, target_fingerprint


def test_layer_names():
    assert resolve_layers("2,mid,-3", 8) == (2, 4, 5)  # EAGLE-3's (2, L//2, L-3)
    assert resolve_layers("last", 8) == (8,)
    assert resolve_layers("0,-1", 8) == (0, 7)
    assert resolve_layers("-8", 8) == (0,)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("9", "out of range .* 8 layers"),
        ("-9", "out of range"),
        ("two", "not a layer id"),
        ("1,,2", "comma-separated"),
        ("3,3", "repeats"),
    ],
)
def test_bad_layer_ids(spec, message):
    with pytest.raises(CacheError, match=message):
        resolve_layers(spec, 8)


def test_sizes():
    assert parse_size("50GB") == 50 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("1000") == 1000
    with pytest.raises(CacheError, match="--max-disk"):
        parse_size("lots")
    est = Estimate(tokens=1000, layers=3, hidden=64, bytes_per_value=2, topk=4)
    assert est.bytes_per_token == 3 * 64 * 2 + 4 * 8 + 4  # the tail: one float32 per token
    assert est.total == 1000 * est.bytes_per_token


@pytest.fixture(scope="module")
def target(toy_dir):
    return load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32)


def test_batched_extraction_equals_one_at_a_time(target):
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43]]
    layers = (0, 1, 2)
    batched = extract(target, rows, layers, topk=5)
    for row, got in zip(rows, batched):
        alone = extract(target, [row], layers, topk=5)[0]
        assert got["hidden"].shape == (3, len(row), 48)
        torch.testing.assert_close(got["hidden"], alone["hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["topk_values"], alone["topk_values"], atol=1e-5, rtol=1e-5)
        assert torch.equal(got["topk_ids"], alone["topk_ids"])


def test_cache_equals_a_fresh_forward(target, toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "cache"
    code, stdout, err = run_cli(
        cache_hidden_args(toy_dir, toy_data, out, "1,last", "--topk-logits", 4, "--shard-size", 4, "--batch-size", 3)
    )
    assert code == 0, err
    assert "disk estimate" in stdout and "B/token" in stdout
    assert "target forward alone:" in stdout  # the yardstick of the trainers' train_tokens_per_second
    data = DistillData(toy_data)
    cache = HiddenStateCache(out)
    cache.check(target_fingerprint=target_fingerprint(target), layers=(1, 2), data_hash=data.data_hash, hidden_size=48)
    assert len(cache) == len(data) == 6
    assert cache.manifest["bytes_per_token"] == 2 * 48 * 4 + 4 * 8 + 4
    run = cache.manifest["last_run"]
    assert run["forward_tokens_per_second"] >= run["tokens_per_second"] > 0
    assert 0 < run["forward_seconds"] <= run["seconds"]
    for index in (0, 3, 5):
        ids = torch.tensor([data[index]["input_ids"]])
        with torch.no_grad():
            fresh = target(input_ids=ids, output_hidden_states=True)
        item = cache[index]
        torch.testing.assert_close(item["hidden"][0], fresh.hidden_states[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(item["hidden"][1], fresh.hidden_states[2][0], atol=1e-5, rtol=1e-5)
        # "last" is what lm_head reads
        torch.testing.assert_close(target.lm_head(item["hidden"][1]), fresh.logits[0], atol=1e-4, rtol=1e-4)
        top = fresh.logits[0].topk(4, dim=-1)
        torch.testing.assert_close(item["topk_values"], top.values, atol=1e-5, rtol=1e-5)
        assert torch.equal(item["topk_ids"].long(), top.indices)
        rest = fresh.logits[0].scatter(-1, top.indices, float("-inf"))
        torch.testing.assert_close(item["topk_tail"], torch.logsumexp(rest, -1), atol=1e-5, rtol=1e-5)


def test_mismatches_are_errors(toy_data, target, tmp_path):
    data = DistillData(toy_data)
    cache_hidden_states(
        target, data, tmp_path / "c", layers_spec="mid", dtype=torch.bfloat16, progress=False, log=lambda *a: None
    )
    cache = HiddenStateCache(tmp_path / "c")
    assert cache[0]["hidden"].dtype == torch.bfloat16
    with pytest.raises(CacheError, match="holds layers \\[1\\], the trainer needs \\[2\\]"):
        cache.check(layers=(2,))
    with pytest.raises(CacheError, match="another target"):
        cache.check(target_fingerprint="0" * 64)
    with pytest.raises(CacheError, match="made from data"):
        cache.check(data_hash="f" * 64)
    with pytest.raises(CacheError, match="hidden size 48, expected 64"):
        cache.check(hidden_size=64)
    with pytest.raises(CacheError, match="other layers"):
        cache_hidden_states(
            target, data, tmp_path / "c", layers_spec="last", dtype=torch.bfloat16, progress=False, log=lambda *a: None
        )


def test_max_disk_refuses_before_writing(toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "cache"
    code, stdout, err = run_cli(cache_hidden_args(toy_dir, toy_data, out, "0,1,2", "--max-disk", "1KB", dtype=None))
    tokens = DistillData(toy_data).summary["tokens"]
    assert code == 2 and f"needs {hidden_cache.human_bytes(tokens * 3 * 48 * 2)} but --max-disk is 1.00 KB" in err
    assert "disk estimate" in stdout
    assert not out.exists()
    code, _, err = run_cli(cache_hidden_args(toy_dir, toy_data, out, "5", dtype=None))
    assert code == 2 and "'5' is out of range for a target of 2 layers" in err
    assert not out.exists()


def test_resume_after_an_interruption(toy_data, target, tmp_path, monkeypatch):
    data = DistillData(toy_data)
    whole = tmp_path / "whole"
    cache_hidden_states(
        target, data, whole, layers_spec="1", dtype=torch.float32, shard_size=2, progress=False, log=lambda *a: None
    )
    real = interrupt_call(monkeypatch, hidden_cache, "_write_safetensors_atomic", 2)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        cache_hidden_states(
            target, data, part, layers_spec="1", dtype=torch.float32, shard_size=2, progress=False, log=lambda *a: None
        )
    with pytest.raises(CacheError, match="incomplete"):
        HiddenStateCache(part)
    monkeypatch.setattr(hidden_cache, "_write_safetensors_atomic", real)
    manifest = cache_hidden_states(
        target, data, part, layers_spec="1", dtype=torch.float32, shard_size=2, progress=False, log=lambda *a: None
    )
    assert manifest["last_run"]["tokens"] < data.summary["tokens"]  # the first shard was kept
    for name in ("hidden-00000.safetensors", "hidden-00001.safetensors", "hidden-00002.safetensors"):
        a, b = load_file(whole / name), load_file(part / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p for p in part.iterdir() if p.name.startswith(".")]
