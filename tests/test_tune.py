"""The autotuner: the chain K against hand-computed tables and against a Monte Carlo run of the
chain acceptance, a verify-cost jump that makes the longest chain lose, the Medusa tree size on
an injected accuracy table, EAGLE tree points, prediction vs measurement, and recording the
choice into the artifacts' config.json (draftsmith, vLLM speculators, SGLang layouts)."""

from __future__ import annotations

import json
import random
import re

import pytest

from draftsmith.eval.tune import compare_prediction, tune_chain, tune_measured_trees, tune_medusa_tree, write_setting

ALPHAS = [0.8] * 7
FLAT = {1: 1.0, 8: 1.0}  # verifying up to 8 tokens costs one target step
JUMP = {1: 1.0, 4: 1.0, 5: 1.6, 8: 1.6}  # past 4 tokens the verify forward costs 1.6 steps


def _monte_carlo_tokens_per_s(alphas, k, draft_per_token, verify, calls=4000, seed=0):
    """Decode `calls` steps of a chain of k drafts: draft i is accepted with alpha_i given the
    earlier ones were; a step emits the accepted drafts + 1 and costs k x draft + v(k + 1)."""
    rng = random.Random(seed)
    tokens = 0
    for _ in range(calls):
        accepted = 0
        while accepted < k and rng.random() < alphas[accepted]:
            accepted += 1
        tokens += accepted + 1
    return tokens / (calls * (k * draft_per_token + verify(k + 1)))


def test_chain_table_matches_hand_computation():
    tuning = tune_chain([0.8, 0.5], draft_seconds=0.1, verify_seconds={1: 1.0, 3: 1.2})
    k2 = tuning.candidates[2]
    # tau: 1; 1 + 0.8; 1 + 0.8 + 0.4.  time: v(1); 0.1 + v(2) = 0.1 + 1.1; 0.2 + v(3)
    assert [c.tau for c in tuning.candidates] == pytest.approx([1.0, 1.8, 2.2])
    assert [c.seconds for c in tuning.candidates] == pytest.approx([1.0, 1.2, 1.4])
    assert [c.speedup for c in tuning.candidates] == pytest.approx([1.0, 1.5, 2.2 / 1.4])
    assert tuning.best is k2 and tuning.setting()["num_speculative_tokens"] == 2
    assert tuning.setting()["predicted_speedup"] == pytest.approx(2.2 / 1.4)
    assert "(chosen)" in tuning.table().splitlines()[4] and "counts the bonus token" in tuning.table()


def test_a_verify_cost_jump_beats_the_longest_chain():
    """With a flat verify cost K = 7 (the most tokens per step) is fastest; with the jump past 4
    verified tokens K = 3 is (2.95 tokens in 1.15 s against 4.16 in 1.95 s)."""
    flat = tune_chain(ALPHAS, 0.05, FLAT)
    jump = tune_chain(ALPHAS, 0.05, JUMP)
    assert flat.best.setting["num_speculative_tokens"] == 7
    assert jump.best.setting["num_speculative_tokens"] == 3
    assert jump.best.speedup == pytest.approx((1 + 0.8 + 0.64 + 0.512) / 1.15)
    # the tau-maximising K is the same in both: only the cost curve moved the choice
    assert max(jump.candidates, key=lambda c: c.tau).setting["num_speculative_tokens"] == 7


@pytest.mark.parametrize("verify", [FLAT, JUMP], ids=["flat", "jump"])
def test_the_chosen_k_is_the_fastest_in_a_simulated_decode(verify):
    from draftsmith.eval.serving import CostCurve

    alphas = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    tuning = tune_chain(alphas, 0.05, verify)
    curve = CostCurve(verify)
    measured = {k: _monte_carlo_tokens_per_s(alphas, k, 0.05, curve) for k in range(8)}
    assert max(measured, key=measured.get) == tuning.best.setting["num_speculative_tokens"]
    for c in tuning.candidates:  # and every prediction matches the simulation
        assert c.tokens_per_s == pytest.approx(measured[c.setting["num_speculative_tokens"]], rel=0.03)


def test_chain_may_choose_not_to_speculate():
    tuning = tune_chain([0.3, 0.2], draft_seconds=0.6, verify_seconds=FLAT)
    assert tuning.best.setting["num_speculative_tokens"] == 0
    assert any("serve without speculation" in n for n in tuning.notes)
    with pytest.raises(ValueError, match="no speculation beats target-only"):
        write_setting(".", tuning)


def test_chain_inputs_from_a_report_row_and_per_k_draft_costs():
    row = {"method": "draft", "tree": False, "alpha_per_position": [0.9, 0.5, None, None]}
    tuning = tune_chain(row, draft_seconds={1: 0.1, 2: 0.3}, verify_seconds=FLAT)
    assert [c.setting["num_speculative_tokens"] for c in tuning.candidates] == [0, 1, 2]
    assert tuning.candidates[2].draft_seconds == pytest.approx(0.3)
    assert any("position 3 was never reached" in n for n in tuning.notes)
    with pytest.raises(ValueError, match="tree drafter"):
        tune_chain({"method": "medusa-tree", "tree": True, "alpha_per_position": [0.9]}, 0.1, FLAT)
    assert len(tune_chain(ALPHAS, 0.0, FLAT, k_max=4).candidates) == 5


def test_medusa_tree_budget_on_an_injected_accuracy_table():
    """Path probabilities (head 0 ranks x head 1 ranks x head 2): (0) .7, (0,0) .42, (0,0,0) .21,
    (1) .2, (1,0) .12, ... Verify costs 1 step up to 4 tokens (3 nodes + root), 1.5 past that;
    the heads cost 0.1 per step. N = 3: tau 1 + 1.33 in 1.1 s = 2.12x; N = 8: 2.815 in 1.6 s."""
    acc = [[0.7, 0.2], [0.6, 0.1], [0.5]]
    tuning = tune_medusa_tree(acc, [1, 3, 4, 8], verify_seconds={1: 1.0, 4: 1.0, 5: 1.5, 9: 1.5}, draft_seconds=0.1)
    by_n = {c.setting["num_nodes"]: c for c in tuning.candidates}
    assert by_n[1].tau == pytest.approx(1.7) and by_n[3].tau == pytest.approx(2.33)
    assert by_n[4].tau == pytest.approx(2.53) and by_n[8].tau == pytest.approx(2.815)
    assert by_n[3].speedup == pytest.approx(2.33 / 1.1) and by_n[8].speedup == pytest.approx(2.815 / 1.6)
    best = tuning.best.setting
    assert best["num_nodes"] == 3 and best["tree"] == [[0], [0, 0], [0, 0, 0]] and best["num_speculative_tokens"] == 3
    # budgets past the 10 nodes the table allows collapse into one candidate
    capped = tune_medusa_tree(acc, [10, 50], verify_seconds=FLAT)
    assert [c.setting["num_nodes"] for c in capped.candidates] == [10] and "skipped" in capped.notes[0]


def test_measured_tree_points():
    """A tree decoded per setting (EAGLE-2's): its N draft nodes are verified with the last committed
    token (v(N + 1)); its setting, with the depth it reaches as K, is recorded as measured."""
    points = [
        {
            "label": "tree 5,8,48",
            "setting": {"num_speculative_tokens": 6, "depth": 5, "top_k": 8, "total_tokens": 48},
            "num_nodes": 48,
            "tau": 4.0,
            "draft_seconds": 0.5,
        },
        {
            "label": "tree 4,4,16",
            "setting": {"num_speculative_tokens": 5, "depth": 4, "top_k": 4, "total_tokens": 16},
            "num_nodes": 16,
            "tau": 3.4,
            "draft_seconds": 0.4,
        },
    ]
    verify = {1: 1.0, 17: 1.1, 49: 1.9}
    tuning = tune_measured_trees(points, verify)
    assert [c.speedup for c in tuning.candidates] == pytest.approx([4.0 / 2.4, 3.4 / 1.5])
    assert [c.label for c in tuning.candidates] == ["tree 5,8,48", "tree 4,4,16"]
    assert tuning.setting() == {
        "num_speculative_tokens": 5,
        "depth": 4,
        "top_k": 4,
        "total_tokens": 16,
        "num_nodes": 16,
        "kind": "tree",
        "predicted_tau": 3.4,
        "predicted_speedup": pytest.approx(3.4 / 1.5),
    }
    with pytest.raises(ValueError, match=re.escape("points[0].tau = 8.0")):
        tune_measured_trees([dict(points[0], tau=8.0)], verify)  # past K + 1 = 7
    with pytest.raises(ValueError, match="lacks draft_seconds"):
        tune_measured_trees([{k: v for k, v in points[0].items() if k != "draft_seconds"}], verify)
    with pytest.raises(ValueError, match=re.escape("points[0].num_nodes = 0")):
        tune_measured_trees([dict(points[0], num_nodes=0)], verify)
    with pytest.raises(ValueError, match="expected a mapping with num_speculative_tokens >= 1"):
        tune_measured_trees([dict(points[0], setting={"depth": 5})], verify)


def test_compare_prediction():
    ratio, sentence = compare_prediction(2.0, 1.5)
    assert ratio == pytest.approx(0.75)
    assert "measured 1.50x vs predicted 2.00x (75% of the prediction)" in sentence and "misses 25%" in sentence
    assert "holds within 10%" in compare_prediction(2.0, 1.9).sentence
    assert "beats the model" in compare_prediction(1.5, 2.0).sentence


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: tune_chain([0.8, 1.2], 0.1, FLAT), "alpha_per_position[1] = 1.2"),
        (lambda: tune_chain([None], 0.1, FLAT), "no measured position"),
        (lambda: tune_chain([0.8], -0.1, FLAT), "draft_seconds = -0.1"),
        (lambda: tune_chain([0.8], 0.1, {2: 1.0, 4: 1.1}), "not at n = 1"),
        (lambda: tune_chain([0.8], 0.1, {1: 1.0, 2: -1.0}), "-1.0 seconds"),
        (lambda: tune_chain([0.8], 0.1, FLAT, k_max=3), "k_max = 3"),
        (lambda: tune_medusa_tree([[0.5]], [0], FLAT), "node budget 0"),
        (lambda: tune_medusa_tree([[1.5]], [2], FLAT), "head_accuracies[0]"),
        (lambda: compare_prediction(0.0, 1.0), "predicted_speedup = 0.0"),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ---------------------------------------------------------------------- write_setting
SPECULATORS = {
    "architectures": ["Eagle3DraftModel"],
    "speculators_model_type": "eagle3",
    "speculators_config": {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}],
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"},
    },
    "draftsmith": {"target_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"},
}


def _folder(tmp_path, name, config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_write_setting_into_a_speculators_export(tmp_path):
    folder = _folder(tmp_path, "vllm", SPECULATORS)
    tuning = tune_chain(ALPHAS, 0.05, JUMP)
    path = write_setting(folder, tuning)
    config = json.loads(path.read_text())
    assert config["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 3,
        "verifier_accept_k": 1,
    }
    speculation = config["draftsmith"]["speculation"]
    assert speculation["num_speculative_tokens"] == 3 and speculation["kind"] == "chain"
    assert config["draftsmith"]["target_name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"  # provenance kept
    assert {k: v for k, v in config.items() if k not in ("speculators_config", "draftsmith")} == {
        k: v for k, v in SPECULATORS.items() if k not in ("speculators_config", "draftsmith")
    }
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]  # no temporary left


def test_write_setting_into_sglang_and_draftsmith_layouts(tmp_path):
    from draftsmith.heads.medusa import MedusaConfig

    sglang = _folder(tmp_path, "sglang", {"architectures": ["LlamaForCausalLMEagle3"], "num_speculative_tokens": 3})
    write_setting(sglang, {"num_speculative_tokens": 5})
    assert json.loads((sglang / "config.json").read_text())["num_speculative_tokens"] == 5

    heads = tmp_path / "medusa"
    MedusaConfig(num_heads=3, hidden_size=8, vocab_size=16).save_pretrained(heads)
    tuning = tune_medusa_tree([[0.7, 0.2], [0.6, 0.1], [0.5]], [3], FLAT)
    write_setting(heads, tuning)
    loaded = MedusaConfig.from_pretrained(heads)  # the extra key does not disturb loading
    assert loaded.num_heads == 3
    assert loaded.draftsmith["speculation"]["tree"] == [[0], [0, 0], [0, 0, 0]]
    assert "speculators_config" not in json.loads((heads / "config.json").read_text())


def test_write_setting_refuses_bad_folders_and_settings(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        write_setting(tmp_path / "empty", {"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="does not exist"):
        write_setting(tmp_path / "missing", {"num_speculative_tokens": 3})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        write_setting(broken, {"num_speculative_tokens": 3})
    assert (broken / "config.json").read_text() == "{not json"
    bad_spec = _folder(tmp_path, "bad", {"speculators_config": {"proposal_methods": []}})
    with pytest.raises(ValueError, match="proposal_methods is \\[\\]"):
        write_setting(bad_spec, {"num_speculative_tokens": 3})
    ok = _folder(tmp_path, "ok", {"model_type": "draftsmith_eagle"})
    with pytest.raises(ValueError, match="unknown keys \\['k'\\]"):
        write_setting(ok, {"k": 3})
    with pytest.raises(ValueError, match="3 deep but num_speculative_tokens = 2"):
        write_setting(ok, {"num_speculative_tokens": 2, "tree": [[0], [0, 0], [0, 0, 0]]})
    assert json.loads((ok / "config.json").read_text()) == {"model_type": "draftsmith_eagle"}


def test_speedup_plot(tmp_path):
    from draftsmith.eval.plots import plot_speedup_vs_k

    png = plot_speedup_vs_k(
        {"jump": tune_chain(ALPHAS, 0.05, JUMP), "flat": tune_chain(ALPHAS, 0.05, FLAT)},
        tmp_path / "k.png",
        measured={"jump": {3: 2.3}},
    )
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="one kind"):
        plot_speedup_vs_k(
            {"a": tune_chain(ALPHAS, 0.05, FLAT), "b": tune_medusa_tree([[0.5]], [1], FLAT)}, tmp_path / "x.png"
        )
    with pytest.raises(ValueError, match="no tuning"):
        plot_speedup_vs_k({"a": tune_chain(ALPHAS, 0.05, FLAT)}, tmp_path / "y.png", measured={"b": {1: 1.0}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.png"]
