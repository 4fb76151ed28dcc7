# ruff: noqa: F811  (tests take the imported `setup` fixture by name)
"""The static-cache (and compiled) path of batched decoding against its default path.

- greedy: `generate_batch(..., static_cache=True)` gives the default path's tokens and per-row
  counters, and HF greedy, for every drafter kind, with a row stopped early by eos (it leaves
  the batch; with compiled steps it stays as a padding row), for a llama and a gpt_neox target;
- the KV store's moves: the compiled step's mask equals the live one on the live columns;
  compactions and tail cuts happen (pointer moves) and change no token; a sized store never
  overflows (forced compaction), and a write past the capacity reallocates it;
- sampling: row b draws what the default path draws; chi-square of the first two tokens;
- compiled (slow: inductor compiles C++): same tokens, compile time apart; the fallback when
  compilation is unavailable.
"""

from __future__ import annotations

import copy
import functools
import weakref

import pytest
import test_batched
import torch
from test_batched import N_NEW, PROMPTS, T1, K, _batch1, _drafters, _first_two_fits, _prompts, setup  # noqa: F401

from draftsmith.decoding import compiler as compiler_module
from draftsmith.decoding import generate_batch
from draftsmith.decoding import kv as kv_module
from draftsmith.decoding.drafters import DraftModelDrafter
from draftsmith.decoding.kv import KVStore
from draftsmith.decoding.masks import chain_attend, spans, static_mask
from draftsmith.decoding.medusa import MedusaDrafter

_forward = test_batched._forward  # what a model forward does to a KV store
OWN_CACHE = ("draft", "eagle3", "eagle-tree")  # drafters with a static KV cache of their own


def _eos_stopping_row_1(references) -> int:
    """A token of row 1's greedy output (past its first few) that no other row emits."""
    others = {t for b, ref in enumerate(references) if b != 1 for t in ref}
    return next(t for j, t in enumerate(references[1]) if j >= 4 and t not in references[1][:j] and t not in others)


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture
def spy(monkeypatch):
    """Records the KV stores' forwards (rows in use, width, pointer, physical rows), commits
    (pointer before, fed, pointer after) and compactions (pointer before, after)."""
    calls = {"forward": [], "append": [], "compact": []}
    forward, commit, compact = KVStore.forward, KVStore.commit, KVStore._compact

    def on_forward(self, model, ids, *args, **kwargs):
        calls["forward"].append([self, ids.shape[0], ids.shape[1], self.length, self._valid.shape[0]])
        return forward(self, model, ids, *args, **kwargs)

    def on_commit(self, keep):
        before = self.length
        commit(self, keep)
        calls["append"].append((self, before, keep.shape[1], self.length))

    def on_compact(self):
        before = self.length
        compact(self)
        calls["compact"].append((self, before, self.length))

    monkeypatch.setattr(KVStore, "forward", on_forward)
    monkeypatch.setattr(KVStore, "commit", on_commit)
    monkeypatch.setattr(KVStore, "_compact", on_compact)
    return calls


# ----------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("name", list(K))
def test_static_greedy_equals_default_and_hf(name, setup, spy):
    """Row 1 stops at an eos: it leaves the batch (no compiled step holds its shape), and no other
    row, and no counter, changes."""
    target, references = setup[0], setup[4]
    eos = _eos_stopping_row_1(references)
    kwargs = {"num_draft_tokens": K[name], "max_new_tokens": N_NEW, "eos_token_id": eos}
    default = generate_batch(target, PROMPTS, _drafters(name, setup)[0], **kwargs)
    for calls in spy.values():  # the static path's only
        calls.clear()
    static = generate_batch(target, PROMPTS, _drafters(name, setup)[0], static_cache=True, **kwargs)
    assert static.tokens == default.tokens == [_cut(r, eos) for r in references]
    assert static.stopped == default.stopped and static.stopped[1] == "eos"
    for row, ref in zip(static.rows, default.rows):
        assert (row.proposed, row.accepted, row.new_tokens) == (ref.proposed, ref.accepted, ref.new_tokens)
        assert (row.reached, row.accepted_at) == (ref.reached, ref.accepted_at)
    assert static.call_rows == default.call_rows and static.call_rows[-1] < len(PROMPTS)
    assert static.compile_seconds == static.stats.compile_seconds == 0.0
    # Finished rows left the buffers: no step computes them.
    target_kv = spy["forward"][0][0]
    assert sum(kv is target_kv for kv, *_ in spy["forward"]) == 1 + static.target_calls
    assert all(physical == rows for _, rows, *_, physical in spy["forward"])
    assert min(rows for _, rows, *_ in spy["forward"]) < len(PROMPTS)
    # The draft model and an EAGLE head commit to stores of their own.
    assert len({kv for kv, *_ in spy["append"]}) == (2 if name in OWN_CACHE else 1)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_static_greedy_families(family, pairs):
    target, draft = pairs(family)
    prompts = _prompts((4, 1, 9, 6), seed=3)
    alone = [_batch1(target, None, p, 0, max_new_tokens=16).tokens for p in prompts]
    eos = alone[2][3]
    for drafter in (None, DraftModelDrafter(draft)):
        kwargs = {"num_draft_tokens": 3, "max_new_tokens": 16, "eos_token_id": eos}
        static = generate_batch(target, prompts, drafter, static_cache=True, **kwargs)
        assert static.tokens == [_cut(a, eos) for a in alone]
        assert static.tokens == generate_batch(target, prompts, drafter, **kwargs).tokens
        assert "eos" in static.stopped and "length" in static.stopped


# ------------------------------------------------------------------------ the static cache


def _step_mask(kv: KVStore, attend: torch.Tensor) -> torch.Tensor:
    """The mask a compiled step builds (`static_mask`) for the rows in use: [rows, 1, W, capacity]."""
    kv._write_valid()  # the host's bookkeeping into the buffer the step reads
    positions = torch.zeros(kv._valid.shape[0], attend.shape[1], dtype=torch.long)
    return kv._in_use(static_mask(kv._valid, kv._slots, kv._start(), kv._attend(attend), positions, torch.float32))


def test_step_mask_equals_the_live_one(setup):
    """Same moves on two stores, one holding a compiled step (never run: a finished row then
    stays as a padding row): on the live columns and the fed ones the step's mask is the live
    one; every later column is blocked."""
    static, dynamic = KVStore.for_model(setup[0], 3, 16), KVStore.for_model(setup[0], 3, 16)
    static._compiled[("never run", 16)] = (0, None)

    def both(fed, lo=None, hi=None, keep=None):
        live = static.length + fed
        rows = len(static.rows)
        attend = chain_attend(fed, lo, hi, rows, static.device)
        a, b = _step_mask(static, attend), dynamic.mask(attend, torch.float32)
        assert a.shape == (rows, 1, fed, 16)
        assert torch.equal(a[..., :live], b), (fed, lo, hi)
        assert bool((a[..., live:] == torch.finfo(torch.float32).min).all())
        for kv in (static, dynamic):
            _forward(kv, [[0] * fed] * len(kv.counts))
        for kv in (static, dynamic):
            kv.commit(spans(fed, lo, hi if keep is None else keep, rows, kv.device))
        assert holes_from_the_pointer(static)

    def holes_from_the_pointer(kv):  # what `static_mask` relies on: no slot from the pointer on is real
        return not bool(kv._valid[:, kv.length :].any())

    both(4, [0, 3, 1])  # a right-aligned prompt block
    both(3, None, [3, 1, 0], keep=[2, 1, 0])  # row 2 a padding row; the third column is cut
    assert static.length == dynamic.length == 6 and static.counts == dynamic.counts == [6, 2, 3]
    for kv in (static, dynamic):  # row 1 leaves: a padding row of the store with a compiled step
        kv.select(torch.tensor([0, 2]), [0, 2])
    assert static.rows == [0, 2] and dynamic.rows == [0, 1] and static.counts == dynamic.counts == [6, 3]
    assert static._valid.shape[0] == 3 and dynamic._valid.shape[0] == 2
    both(2, None, [2, 1], keep=[1, 2])
    assert torch.equal(static.valid, dynamic.valid) and static.counts == dynamic.counts == [7, 5]
    # A tree block (ancestor masks; row 0 keeps `last` and its second node, row 1 `last` only).
    from draftsmith.decoding.masks import tree_attend

    attend, _ = tree_attend([[-1, -1], [-1]], 3, static.device)
    live = static.length + 3
    assert torch.equal(_step_mask(static, attend)[..., :live], dynamic.mask(attend, torch.float32))
    for kv in (static, dynamic):
        _forward(kv, [[0] * 3] * 2)
    keep = torch.tensor([[True, False, True], [True, False, False]])
    for kv in (static, dynamic):
        kv.commit(keep)
    assert torch.equal(static.valid, dynamic.valid) and static.counts == dynamic.counts == [9, 6]
    assert holes_from_the_pointer(static)
    both(3)  # three columns every row keeps (a draft model's drafts), then its rollback:
    for kv in (static, dynamic):  # of them row 0 keeps 1, row 1 none
        kv.retain(kv.length - 3, [1, 0])
    assert static.counts == dynamic.counts == [10, 6]
    assert torch.equal(static.valid, dynamic.valid) and holes_from_the_pointer(static)
    static.reserve(static.capacity - static.length + 1)  # no room left: compacts
    assert static.length == max(static.counts) and holes_from_the_pointer(static)


@pytest.mark.parametrize("name", ["draft", "eagle3"])
def test_compaction_and_tail_cuts_keep_rows_exact(name, setup, spy, monkeypatch):
    """Compacting at every hole: the pointers move back (tail cuts, compactions) and no token
    changes."""
    monkeypatch.setattr(kv_module, "COMPACT_WHEN", 0.0)
    result = generate_batch(
        setup[0], PROMPTS, _drafters(name, setup)[0], num_draft_tokens=K[name], max_new_tokens=N_NEW, static_cache=True
    )
    assert result.tokens == setup[4]
    caches = {kv for kv, *_ in spy["compact"]}
    assert len(caches) == (2 if name in OWN_CACHE else 1)  # the target's, and the draft's or the EAGLE head's
    assert len(spy["compact"]) >= 3 and all(after < before for _, before, after in spy["compact"])
    assert any(after < before + fed for _, before, fed, after in spy["append"])  # a common tail was cut


@pytest.mark.parametrize("name", ["draft", "medusa"])  # target-only leaves no holes past the prefill's
def test_capacity_never_overflows(name, setup, spy, monkeypatch):
    """With no voluntary compaction and an unrounded capacity (longest prompt + max_new_tokens
    + K + 1), the pointer reaches the end; `reserve` compacts and decoding goes on exactly."""
    monkeypatch.setattr(kv_module, "COMPACT_WHEN", 1.0)  # holes never reach 100%: never compacts by itself
    monkeypatch.setattr(kv_module, "CAPACITY_STEP", 1)
    monkeypatch.setattr(kv_module, "_STORES", weakref.WeakKeyDictionary())  # no larger cache to reuse
    result = generate_batch(
        setup[0], PROMPTS, _drafters(name, setup)[0], num_draft_tokens=K[name], max_new_tokens=N_NEW, static_cache=True
    )
    assert result.tokens == setup[4]
    capacity = max(p.numel() for p in PROMPTS) + N_NEW + K[name] + 1
    target_kv = spy["forward"][0][0]
    assert target_kv.capacity == capacity
    assert any(kv is target_kv for kv, *_ in spy["compact"])  # forced: the pointer got to the end
    assert all(pointer + width <= capacity for _, _, width, pointer, _ in spy["forward"])


def test_a_write_past_the_capacity_grows_the_store(setup):
    """Ragged rows: the columns (holes included) move to the larger buffers as they were, and
    the logits are those of a store sized for them."""
    target = setup[0]
    small, sized = KVStore.for_model(target, 2, 8), KVStore.for_model(target, 2, 64)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2]])
    more, at = torch.tensor([[14, 15, 16], [17, 18, 19]]), torch.tensor([[6, 7, 8], [3, 4, 5]])
    logits = []
    for kv in (small, sized):
        kv.forward(target, ids, positions, chain_attend(6, [0, 3], None, 2, kv.device))
        kv.commit_spans(6, [0, 3], None)
        logits.append(kv.forward(target, more, at).logits)
        kv.commit_spans(3)
    assert small.capacity > 8 and small.length == 9 and small.counts == sized.counts == [9, 6]
    assert torch.equal(small.valid, sized.valid)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_bad_compile_mode_and_chunked_attention_raise(setup):
    from fixtures import tiny_config
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="compile must be"):
        generate_batch(setup[0], PROMPTS, max_new_tokens=2, compile="fastest")
    config = tiny_config("qwen2")
    config.layer_types, config.attention_chunk_size = ["full_attention", "chunked_attention"], 4
    chunked = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="runs full-attention, sliding-window .*but the target has chunked_attention"):
        generate_batch(chunked, PROMPTS, max_new_tokens=4, static_cache=True)


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("name", ["draft", "medusa", "eagle3"])
def test_static_sampled_rows_equal_the_default_path(name, setup):
    """The static path makes the very draws of the default path (row b: generator row_seed(7, b)),
    with a row that finishes early at an eos."""
    target = setup[0]
    kwargs = {"num_draft_tokens": K[name], "max_new_tokens": N_NEW, "sampling": T1, "seed": 7}
    free = generate_batch(target, PROMPTS, _drafters(name, setup)[0], **kwargs).tokens
    kwargs["eos_token_id"] = free[2][len(free[2]) // 3]
    default = generate_batch(target, PROMPTS, _drafters(name, setup)[0], **kwargs)
    static = generate_batch(target, PROMPTS, _drafters(name, setup)[0], static_cache=True, **kwargs)
    assert static.tokens == default.tokens and "eos" in static.stopped
    assert [r.accepted for r in static.rows] == [r.accepted for r in default.rows]


def test_static_sampling_is_lossless_per_row_quick(setup, monkeypatch):
    """`test_batched`'s chi-square (250 samples per prompt, draft model, one batch of 1000 rows)
    on the static path: every prompt fits the target's law; the draft's law is rejected somewhere."""
    monkeypatch.setattr(test_batched, "generate_batch", functools.partial(generate_batch, static_cache=True))
    fits = _first_two_fits(setup, copies=250)
    for p, (target_fit, _) in enumerate(fits):
        assert target_fit.bins >= 5 and target_fit.p_value > 1e-3, (p, target_fit)
    assert min(draft_fit.p_value for _, draft_fit in fits) < 1e-6, fits


# ------------------------------------------------------------------------------ compiled


def test_unavailable_compiler_falls_back_with_a_message(setup, monkeypatch):
    target = copy.deepcopy(setup[0])  # a model of its own: no compiled cache of an earlier test
    monkeypatch.setattr(compiler_module, "compile_unavailable", lambda device: "no C++ compiler here (test)")
    with pytest.warns(UserWarning, match=r"torch.compile is off.*no C\+\+ compiler here"):
        result = generate_batch(
            target, PROMPTS, DraftModelDrafter(setup[1]), num_draft_tokens=3, max_new_tokens=N_NEW, compile=True
        )
    assert result.tokens == setup[4]
    assert result.compile_seconds == result.stats.compile_seconds == 0.0


@pytest.mark.slow
def test_compiled_greedy_is_identical(setup, spy, monkeypatch):
    """Target only (width 1), a draft model (target width K + 1, narrower calls near the end
    padded to it; the draft's steps at widths 1 and 2) and Medusa (the target's hidden states
    out of the compiled step): the default path's tokens, with a row that finishes early;
    compile time apart, paid once per model and shape."""
    target, draft = copy.deepcopy(setup[0]), copy.deepcopy(setup[1])  # compiled graphs of their own
    references = setup[4]
    eos = _eos_stopping_row_1(references)
    heads = MedusaDrafter(setup[2], target.config.num_hidden_layers)
    for drafter, k in ((None, 0), (DraftModelDrafter(draft), 3), (heads, 3)):
        kwargs = {"num_draft_tokens": k, "max_new_tokens": N_NEW, "eos_token_id": eos}
        result = generate_batch(target, PROMPTS, drafter, compile=True, **kwargs)
        assert result.tokens == [_cut(r, eos) for r in references]
        assert result.compile_seconds > 0 and result.stats.compile_seconds == result.compile_seconds
        assert result.compile_seconds > result.total_seconds  # compilation is not in the decoding time
        caches = [kv_module._STORES[target]["target", "default", len(PROMPTS)]]
        layers = drafter.target_layers if drafter is not None else ()
        assert (layers, k + 1) in caches[0]._compiled
        if isinstance(drafter, DraftModelDrafter):
            caches.append(kv_module._STORES[draft]["draft", "default", len(PROMPTS)])
            assert {(1, k, False), (2, k, False)} <= set(caches[1]._chains)  # greedy: chains
        # Warm: nothing compiles, and every verification and draft step runs compiled (a call
        # narrower than a compiled width padded to it); only prefills and first catch-ups, wider
        # than every compiled width, run live (the draft model's first catch-up with its drafts).
        for kv in caches:
            assert kv.compiler.enabled and kv.compiler.error is None
        live = []
        with monkeypatch.context() as patch:
            _count_live(patch, live)
            again = generate_batch(target, PROMPTS, drafter, compile=True, **kwargs)
        assert again.tokens == result.tokens and again.compile_seconds == 0.0
        target_widths = [width for owner, width in live if owner == "the target"]
        assert target_widths and min(target_widths) > k + 1, live
        assert len(live) - len(target_widths) <= k, live  # one catch-up and its k - 1 drafts, once


def _count_live(patch, live: list) -> None:
    """Record (store owner, width) of every live (uncompiled) forward."""
    original = KVStore._run_live

    def counted(self, call, ids, *args):
        live.append((self.owner, ids.shape[1]))
        return original(self, call, ids, *args)

    patch.setattr(KVStore, "_run_live", counted)


def test_the_batched_benchmark_script(toy_dir, capsys):
    """scripts/bench_batched.py end to end on the toy pair: every path decodes the same tokens."""
    from draftsmith.scripts.bench_batched import main

    code = main(
        [
            "--target",
            str(toy_dir / "target"),
            "--draft",
            str(toy_dir / "draft"),
            "--prompt-lookup",
            "--prompt-file",
            str(toy_dir / "prompts.jsonl"),
            "--batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--paths",
            "static",
        ]
    )  # compiling is tested above
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith(("| target-only", "| draft", "| prompt-lookup"))]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), out
