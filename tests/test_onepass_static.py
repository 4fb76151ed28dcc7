"""DFlash and P-EAGLE (the one-pass drafters) on the sized store (static path) and the compiled path.

- greedy on the preallocated store: the target-only tokens at B = 1 and B = 4, and the same
  proposals as on the growing store, call for call;
- every proposal on the static store equals the head run from scratch on the row's context
  (the checks of tests/test_dflash.py and tests/test_peagle.py: ragged rows, rows leaving);
- sampling at T = 1 on the static store: the chi-square check of `check_lossless`;
- compiled (slow: inductor compiles C++): the same tokens and proposals, with the head's step
  compiled for every width a decode feeds after the prompt (no compiling mid-request);
- `draftsmith eval --dflash --peagle --compile`, `check-lossless --static-cache` and `tune` with
  these heads, end to end on the toy target.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import checking_drafter_class, first_line_prompts
from lifecycle_helpers import assert_fast_path_decodes_the_same
from test_dflash import BLOCK  # noqa: F401 (a fixture)
from test_dflash import _check_row as check_dflash_row
from test_dflash import fitted as dflash_fitted  # noqa: F401 (a fixture)
from test_peagle import DEPTHS  # noqa: F401 (a fixture)
from test_peagle import _check_row as check_peagle_row
from test_peagle import fitted as peagle_fitted  # noqa: F401 (a fixture)
from test_static import COMPILED
from test_tune_cli import flat_verify, tune_args  # noqa: F401 (a fixture)

from draftsmith.decoding import generate, generate_batch
from draftsmith.decoding import kv as kv_module
from draftsmith.decoding.dflash import DFlashDrafter
from draftsmith.decoding.peagle import PEagleDrafter
from draftsmith.eval.lossless import check_lossless
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dflash_formats import save_dflash
from draftsmith.heads.eagle import PEagleHead, save_eagle
from draftsmith.heads.models import load_causal_lm

#: kind -> (drafter class, its from-scratch checking subclass, K: every position it drafts)
KINDS = {
    kind: (drafter, checking_drafter_class(drafter, check_row, raw_logits=True), k)
    for kind, drafter, check_row, k in (
        ("dflash", DFlashDrafter, check_dflash_row, BLOCK - 1),
        ("peagle", PEagleDrafter, check_peagle_row, DEPTHS),
    )
}


@pytest.fixture(params=list(KINDS))
def setup(request):
    """(kind, target, fitted head, prompts) of one kind of one-pass head."""
    target, head, prompts = request.getfixturevalue(f"{request.param}_fitted")
    return request.param, target, head, prompts


def _recorded(drafter):
    """`drafter`, recording each proposal's tokens (row b's first counts[b]) in `drafter.seen`."""
    propose, drafter.seen = drafter.propose, []

    def record(contexts, num_tokens, sampling, generators):
        proposal = propose(contexts, num_tokens, sampling, generators)
        drafter.seen.append([t[:c] for t, c in zip(proposal.tokens.tolist(), proposal.counts)])
        return proposal

    drafter.propose = record
    return drafter


def _check_greedy(kind, target, head, prompts, k, **fast):
    """B = 1 (two prompts) and B = 4 at K = k on the path of `fast`: the target-only tokens, and
    the proposals of the growing store; returns the drafter of the last decode."""
    make = KINDS[kind][0]
    references = [generate(target, None, p, max_new_tokens=24).tokens for p in prompts[:4]]
    accepted = 0
    for p, reference in zip(prompts[:2], references):
        eager, quick = _recorded(make(head)), _recorded(make(head))
        a = generate(target, eager, p, max_new_tokens=24, num_draft_tokens=k)
        b = generate(target, quick, p, max_new_tokens=24, num_draft_tokens=k, **fast)
        assert b.tokens == a.tokens == reference
        assert quick.seen == eager.seen and b.stats.accepted == a.stats.accepted
        accepted += sum(b.stats.accepted)
    eager, quick = _recorded(make(head)), _recorded(make(head))
    a = generate_batch(target, prompts[:4], eager, num_draft_tokens=k, max_new_tokens=24)
    b = generate_batch(target, prompts[:4], quick, num_draft_tokens=k, max_new_tokens=24, **fast)
    assert b.tokens == a.tokens == references and quick.seen == eager.seen
    assert accepted >= 10, accepted  # drafts are accepted, so the cache moves are exercised
    return quick


def test_static_greedy_equals_target_only_and_the_growing_store(setup):
    kind, target, head, prompts = setup
    drafter = _check_greedy(kind, target, head, prompts, KINDS[kind][2], static_cache=True)
    assert drafter.kv in kv_module._STORES[drafter.head].values() and drafter.kv.owner == f"the {drafter.role}"


def test_static_proposals_equal_the_heads_from_scratch(setup):
    """Ragged rows (prompts of 4, 6 and 1 tokens), a row leaving early (a padding row of the
    static store), accepted and rejected drafts: every proposal equals the head's from-scratch
    forward on that row's context."""
    kind, target, head, prompts = setup
    _, checked, k = KINDS[kind]
    drafter = checked(head, target)
    rows = [prompts[0], prompts[1], prompts[2][:1]]
    out = generate_batch(
        target, rows, drafter, num_draft_tokens=k, max_new_tokens=16, eos_token_id=rows[1][0].item(), static_cache=True
    )
    assert drafter.calls >= 5 and sum(sum(r.accepted) for r in out.rows) > 0


def test_static_sampling_is_lossless(setup):
    """check_lossless at T = 1 on the static store: chi-square of t1 and (t1, t2)."""
    kind, target, head, prompts = setup
    result = check_lossless(
        target,
        KINDS[kind][0](head),
        prompts[0],
        num_draft_tokens=2,
        samples=300,
        progress=False,
        batch_size=4,
        static_cache=True,
    )
    assert 0.05 < result.acceptance_rate < 0.95, result.describe()
    assert result.passed, result.describe()


@pytest.mark.slow
@COMPILED
def test_compiled_greedy_equals_target_only_and_the_growing_store(setup):
    kind, target, head, prompts = setup
    k = 3  # both kinds: the target's compiled steps (width K + 1) are shared
    drafter = _check_greedy(kind, target, head, prompts, k, compile=True)
    kv = drafter.kv
    assert kv.compiler.enabled and kv.compiler.error is None and kv.compiler.seconds > 0
    # one width: K + 1 new context columns, then the block (DFlash) or the K - 1 placeholders (P-EAGLE)
    assert kv.compiled_widths(drafter.role) == [k + 1 + drafter._suffix]
    # Warm: the same request again compiles nothing.
    out = generate(target, KINDS[kind][0](head), prompts[0], max_new_tokens=24, num_draft_tokens=k, compile=True)
    assert out.stats.compile_seconds < 0.5


# ------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def toy_heads(toy_dir, tmp_path_factory):
    """Folders of an untrained DFlash head and an untrained P-EAGLE head of the toy target."""
    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    out = tmp_path_factory.mktemp("toy-heads")
    torch.manual_seed(0)
    mask = target.config.vocab_size - 1
    save_dflash(
        DFlashHead.for_target(target, block_size=4, mask_token_id=mask, aux_layer_ids=[0, 1, 2]), out / "dflash"
    )
    save_eagle(PEagleHead.for_target(target, mask_token_id=mask, num_depths=3, aux_layer_ids=[0, 1, 2]), out / "peagle")
    return out / "dflash", out / "peagle"


@pytest.mark.slow
@COMPILED
def test_eval_command_compiles_the_one_pass_heads(toy_dir, toy_heads, tmp_path, run_cli):
    """`draftsmith eval --dflash --peagle --compile` decodes what the default path decodes."""
    prompts = first_line_prompts(toy_dir, tmp_path / "prompts.jsonl", 2)
    heads = ("--dflash", toy_heads[0], "--peagle", toy_heads[1])
    plain, _, stdout = assert_fast_path_decodes_the_same(
        run_cli, toy_dir, "--compile", tmp_path, *heads, prompts=prompts, max_new_tokens=10, k=3
    )
    assert "compiled (default): compile time" in stdout
    assert {"dflash", "peagle"} <= {r["method"] for r in plain["methods"]}


def test_check_lossless_takes_the_one_pass_heads(toy_dir, toy_heads, run_cli):
    args = [
        "check-lossless",
        "--target",
        toy_dir / "target",
        "--dflash",
        toy_heads[0],
        "--peagle",
        toy_heads[1],
        "--samples",
        100,
        "-k",
        2,
        "--batch-size",
        4,
        "--static-cache",
        "--no-progress",
        "--device",
        "cpu",
    ]
    code, stdout, err = run_cli(args)
    assert code == 0, err
    assert stdout.count("static cache path") == 2 and stdout.count("PASS") == 2, stdout


@pytest.mark.parametrize("flag, name", [("--dflash", "dflash"), ("--peagle", "peagle")])
def test_tune_takes_the_one_pass_heads(flag, name, toy_dir, toy_heads, tmp_path, run_cli, flat_verify):  # noqa: F811
    """One forward drafts every position, so the draft cost is per step; K is searched up to
    what the head drafts (DFlash: block_size - 1 = 3, P-EAGLE: num_depths = 3)."""
    folder = toy_heads[0] if name == "dflash" else toy_heads[1]
    code, out, err = run_cli(tune_args(toy_dir, flag, folder, tmp_path / "tune", "--k-max", 5))
    assert code == 0, err
    assert "K is searched up to 3, not 5" in out and f"== {name}: K = 3 on 3 prompts" in out, out
    assert "ms per step" in out and flat_verify == [[1, 2, 3, 4]]
    record = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert record["drafter"]["name"] == name and record["chosen"]["num_speculative_tokens"] >= 0
