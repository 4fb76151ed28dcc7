"""The decoder's CPU linears (`decoding/linears.py`): a few rows computed as (W Xᵀ)ᵀ give F.linear's
values, the swap covers the target's and the drafter's float32 linears for the decode only, and it
is undone whatever happens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.decoding import DraftModelDrafter, generate, generate_batch
from draftsmith.decoding import linears as linears_module
from draftsmith.decoding.linears import MAX_ROWS, cpu_linears, few_rows_linear
from draftsmith.heads.toy import tiny_pair


@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 16), (2, 16), (3, 4, 16), (1, MAX_ROWS, 16), (2, MAX_ROWS, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_give_f_linear_values(shape, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(24, 16, generator=gen)
    b = torch.randn(24, generator=gen) if bias else None
    out = few_rows_linear(x, w, b)
    assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_swapped_only_inside_and_undone_after_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    hooked = torch.nn.Linear(8, 8)
    hooked.forward = lambda x: x  # e.g. accelerate's offloading hook: left alone
    x = torch.randn(3, 8)
    before = model(x)
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_linears(model, half, hooked, None, model) as swapped:
            assert swapped == 2  # the two float32 linears of `model`, once each
            assert "forward" in vars(model[0]) and "forward" not in vars(half)
            torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
            raise RuntimeError("an error inside")
    assert all("forward" not in vars(m) for m in model.modules())
    assert "forward" in vars(hooked)


def test_aten_turns_it_off_and_a_bad_value_is_named(monkeypatch):
    model = torch.nn.Linear(8, 8)
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEARS", "aten")
    with cpu_linears(model) as swapped:
        assert swapped == 0 and "forward" not in vars(model)
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEARS", "fast")
    with pytest.raises(ValueError, match="DRAFTSMITH_CPU_LINEARS='fast'.*transposed, aten"):
        with cpu_linears(model):
            pass


def _counting(monkeypatch) -> list[tuple[int, int]]:
    calls = []  # (id of the weight, rows)

    def counted(x, weight, bias):
        calls.append((id(weight), x.numel() // x.shape[-1]))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linears_module, "few_rows_linear", counted)
    return calls


def test_a_decode_runs_the_target_and_the_draft_through_it_and_leaves_them_as_they_were(monkeypatch):
    target, draft = tiny_pair("llama")
    prompt = torch.tensor([5, 9, 2, 7])
    calls = _counting(monkeypatch)
    generate(target, DraftModelDrafter(draft), prompt, max_new_tokens=6, num_draft_tokens=3)
    lm_heads = {id(target.lm_head.weight): "target", id(draft.lm_head.weight): "draft"}
    rows = {(lm_heads[w], n) for w, n in calls if w in lm_heads}
    assert {("target", 4), ("draft", 1)} <= rows  # the target's K + 1 columns, the draft's one-token steps
    linears = [m for model in (target, draft) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)


def test_greedy_decoding_is_the_same_either_way(monkeypatch):
    target, draft = tiny_pair("llama")
    prompts = [torch.tensor([5, 9, 2, 7]), torch.tensor([3, 1, 4, 1, 5, 9])]
    runs = {}
    for choice in ("aten", "transposed"):
        monkeypatch.setenv("DRAFTSMITH_CPU_LINEARS", choice)
        plain = generate_batch(target, prompts, None, max_new_tokens=12)
        speculative = generate_batch(target, prompts, DraftModelDrafter(draft), max_new_tokens=12, num_draft_tokens=3)
        runs[choice] = (plain.tokens, speculative.tokens)
    assert runs["aten"][0] == runs["aten"][1] == runs["transposed"][0] == runs["transposed"][1]


def test_reports_name_the_linears_in_force(monkeypatch):
    from draftsmith.decoding.linears import in_force
    from draftsmith.eval.evaluator import describe_target

    model = torch.nn.Linear(4, 4)
    assert describe_target("t", model, torch.device("cpu"), torch.float32)["linears"] == "W Xᵀ"
    assert in_force("cpu", torch.bfloat16) == in_force("cuda", torch.float32) == "F.linear"
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEARS", "aten")
    assert in_force("cpu", torch.float32) == "F.linear"
