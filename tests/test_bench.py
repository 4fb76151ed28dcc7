"""The decoder benchmark's pure parts (eval/bench.py, eval/bench_report.py) and its flags."""

import pytest
import torch

from draftsmith.decoding import DecodeStats
from draftsmith.eval.bench import BenchConfig, CostCurves, Method, build_methods, random_target
from draftsmith.eval.bench_report import analytic_speedup, first_difference, report, spec_costs
from draftsmith.heads.draft import draft_by_truncation
from draftsmith.scripts.bench_decoder import parse_args

VERIFY = {1: 0.010, 2: 0.012, 4: 0.016}  # seconds: v(3) = 0.014 by interpolation


def spec_stats() -> DecodeStats:
    # 4 calls, 3 drafts each (fed = 4 tokens), 2 accepted per call: tau = 3; 0.012 s of drafting
    return DecodeStats(
        num_draft_tokens=3,
        proposed=[3] * 4,
        accepted=[2] * 4,
        reached=[4, 4, 4],
        accepted_at=[4, 4, 0],
        drafter_seconds=0.012,
        target_seconds=0.06,
    )


def test_analytic_speedup_is_tau_v1_over_the_cost_of_a_call():
    assert analytic_speedup(3.0, 0.010, 0.003, 0.017) == pytest.approx(1.5)
    assert analytic_speedup(1.0, 0.010, 0.0, 0.010) == 1.0  # no drafting, one token: plain decoding


def test_spec_costs_read_the_curve_at_the_tokens_fed():
    sc = spec_costs(spec_stats(), VERIFY)
    assert sc["fed_per_call"] == 4 and sc["verify_ratio"] == pytest.approx(1.6)
    assert sc["draft_ms_per_call"] == pytest.approx(3.0)
    assert sc["c"] == pytest.approx(0.1)  # 1 ms per drafted token / v(1) = 10 ms
    assert sc["analytic_speedup"] == pytest.approx(3 * 0.010 / (0.003 + 0.016))
    assert spec_costs(DecodeStats(proposed=[0, 0], accepted=[0, 0]), VERIFY) is None  # target-only
    assert spec_costs(None, VERIFY) is None


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def fake_method(name, draft, tok_per_s, stats=None, outputs=None, **kw):
    m = Method(name, draft, run=None, stats=stats, outputs=outputs or {0: [5, 6, 7]}, target_forwards=9, **kw)
    m.tokens, m.seconds = [100, 100, 100], [100 / t for t in tok_per_s]
    return m


def test_report_of_a_fake_result(capsys):
    cfg = BenchConfig(paths="eager", no_hf=True, no_self_draft=True, curve="1,2,4", device="cpu")
    methods = [
        fake_method("draftsmith", "-", [99, 100, 101], path="eager", baseline="draftsmith"),
        fake_method(
            "draftsmith", "trunc-1", [150, 160, 170], spec_stats(), {0: [5, 9, 7]}, path="eager", baseline="draftsmith"
        ),
    ]
    costs = {
        "verify": {"eager": VERIFY},
        "draft_step": {"eager": 0.002},
        "compile_seconds": {},
        "rounds": 3,
        "context": 20,
    }
    summary = report(cfg, methods, costs, "## header", top1=0.5)
    out = capsys.readouterr().out
    assert "| method | draft | tok/s | vs HF counterpart | vs target-only | vs eager target-only |" in out
    analytic = 3 * 0.010 / (0.003 + 0.016)
    row = f"| draftsmith | trunc-1 | 160.0 |  | 1.60x | 1.60x | 0.667 | 3.00 | 0.10 | {analytic:.2f}x (" in out
    assert row, out
    assert "| WARNING | draftsmith (trunc-1) | greedy output differs from draftsmith on 1/1 prompts" in out
    assert "| eager | 10.00 | 1.20 | 1.60 | 2.00 | 0.20 | 0 |" in out
    entry = summary["results"]["draftsmith (trunc-1)"]
    assert entry["ratio_vs_target_only"] == pytest.approx(1.6) and entry["first_difference"] == {0: 1}
    assert entry["analytic_speedup"] == pytest.approx(analytic) and entry["tau_counting_bonus"] == 3
    goal = summary["goals"]["best drafter draftsmith (trunc-1) / its path's target-only"]
    assert goal["met"] and goal["value"] == pytest.approx(1.6)
    assert summary["results"]["draftsmith"]["greedy_equal_to_reference"]


def test_flags_keep_their_names_and_bad_values_are_refused(capsys):
    cfg = parse_args(["-k", "3", "--no-hf", "--paths", "eager", "--device", "cpu", "--dtype", "fp32"])
    assert (cfg.num_draft_tokens, cfg.no_hf, cfg.dtype, cfg.curve_repeats) == (3, True, "float32", 7)
    for argv, message in (
        (["--repeats", "2"], "--repeats must be >= 3"),
        (["--paths", "fast"], "--paths must"),
        (["--curve", "2,4"], "--curve must"),
        (["--tree", "draft=3"], "--tree"),
        (["--tree", "nope=3"], "unknown drafter kind"),
        (["--tree", "medusa=auto"], "give a drafter of that kind"),
        (["--drafter", "eagle"], "--drafter"),
        (["--drafter", "eagle=/nowhere"], "needs --target"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--device", "cpu"])
        assert message in capsys.readouterr().err


def test_drafter_flags_and_their_kind_aliases(tmp_path):
    target, heads = tmp_path / "target", tmp_path / "heads"
    target.mkdir(), heads.mkdir()
    argv = ["--target", str(target), "--medusa", str(heads), "--drafter", f"eagle={heads}", "--device", "cpu"]
    cfg = parse_args([*argv, "--tree", "eagle=", "--tree", "medusa=auto"])
    assert cfg.drafter == (f"medusa={heads}", f"eagle={heads}")
    assert cfg.tree_specs() == {"eagle": None, "medusa": "auto"}


def test_cost_curves_and_methods_on_a_tiny_random_pair():
    cfg = BenchConfig(
        hidden=32,
        layers=2,
        vocab=64,
        max_new_tokens=4,
        prompts=1,
        prompt_len=6,
        curve="1,2",
        curve_repeats=1,
        paths="eager,static",
        no_hf=True,
        no_self_draft=True,
        device="cpu",
    )
    target = random_target(cfg)
    draft = draft_by_truncation(target, 1)
    prompts = [torch.arange(3, 9)]
    curves = CostCurves(cfg, target, draft, prompts, room=32)
    curves.measure()
    costs = curves.result()
    assert costs["context"] == 6 + 2 and costs["rounds"] == 1
    assert set(costs["verify"]) == {"eager", "static"} and all(v > 0 for v in costs["verify"]["static"].values())
    methods = build_methods(cfg, target, draft, None, {})
    assert [m.key for m in methods] == [
        "draftsmith",
        "draftsmith (trunc-1)",
        "draftsmith-static",
        "draftsmith-static (trunc-1)",
    ]
    tokens, stats = methods[1].run(prompts[0])
    assert len(tokens) == 4 and stats.target_calls >= 1
