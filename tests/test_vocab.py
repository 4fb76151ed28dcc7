"""EAGLE-3's reduced vocabulary: d2t/t2d from token counts, stored with the data hash."""

import pytest
import torch

from draftsmith.distill.data import DistillData
from draftsmith.distill.vocab import (
    VocabMap,
    VocabMapError,
    build_vocab_map,
    check_consistent,
    load_vocab_map,
    save_vocab_map,
)


def test_keeps_the_most_frequent_tokens_in_target_order():
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 3, 2])
    vmap = build_vocab_map(counts, 4, "h")
    assert vmap.target_ids().tolist() == [0, 2, 4, 6]  # counts 5, 9, 9, 3
    assert vmap.d2t.dtype == torch.int64 and vmap.t2d.dtype == torch.bool
    assert vmap.d2t.tolist() == [0, 1, 2, 3]  # target = i + d2t[i]
    assert vmap.t2d.tolist() == [True, False, True, False, True, False, True, False]
    assert vmap.coverage == pytest.approx(26 / 29)
    assert vmap.draft_to_target(torch.tensor([3, 0])).tolist() == [6, 0]
    check_consistent(vmap)


def test_ties_go_to_the_lower_id_and_unused_ids_fill_the_rest():
    vmap = build_vocab_map(torch.tensor([0, 2, 0, 2, 0, 0]), 3, "h")
    assert vmap.target_ids().tolist() == [0, 1, 3]  # both counted ids, then the lowest unused
    assert vmap.coverage == 1.0
    assert build_vocab_map(torch.tensor([1, 1, 1]), 2, "h").target_ids().tolist() == [0, 1]


def test_full_vocabulary_is_the_identity():
    vmap = build_vocab_map(torch.arange(10), 10, "h")
    assert vmap.d2t.eq(0).all() and vmap.t2d.all() and vmap.coverage == 1.0


@pytest.mark.parametrize("size", [0, 11])
def test_size_out_of_range(size):
    with pytest.raises(VocabMapError, match="expected 1..10"):
        build_vocab_map(torch.ones(10), size, "h")


def test_inconsistent_maps_are_caught():
    good = build_vocab_map(torch.tensor([3, 1, 4, 1, 5]), 3, "h")
    with pytest.raises(VocabMapError, match="same target id"):
        check_consistent(VocabMap(torch.tensor([0, -1, 0]), good.t2d, 1.0, "h"))
    t2d = good.t2d.clone()
    t2d[1] = True
    with pytest.raises(VocabMapError, match="t2d"):
        check_consistent(VocabMap(good.d2t, t2d, 1.0, "h"))


def test_round_trip_and_a_map_from_other_data_is_refused(tmp_path):
    vmap = build_vocab_map(torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), 5, "abc123")
    path = save_vocab_map(vmap, tmp_path / "map.safetensors")
    back = load_vocab_map(path, expected_data_hash="abc123", target_vocab_size=8)
    assert torch.equal(back.d2t, vmap.d2t) and torch.equal(back.t2d, vmap.t2d)
    assert back.coverage == pytest.approx(vmap.coverage)
    with pytest.raises(VocabMapError, match="built from data abc123.*rebuild"):
        load_vocab_map(path, expected_data_hash="ffff00")
    with pytest.raises(VocabMapError, match="covers 8 target tokens"):
        load_vocab_map(path, target_vocab_size=16)
    with pytest.raises(VocabMapError, match="does not exist"):
        load_vocab_map(tmp_path / "missing.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_vocab_map_command_on_generated_data(toy_data, tmp_path, run_cli):
    out = tmp_path / "map.safetensors"
    code, stdout, err = run_cli(["vocab-map", "--data", toy_data, "--draft-vocab-size", 64, "--out", out])
    assert code == 0, err
    data = DistillData(toy_data)
    vmap = load_vocab_map(out, expected_data_hash=data.data_hash)
    counts = data.token_counts()
    assert int(counts.sum()) == data.summary["trained_tokens"]
    assert vmap.coverage == pytest.approx(float(counts[vmap.target_ids()].sum()) / float(counts.sum()))
    assert f"{100 * vmap.coverage:.2f}%" in stdout
    code, _, err = run_cli(["vocab-map", "--data", toy_data, "--draft-vocab-size", 100000])
    assert code == 2 and "expected 1..320" in err
