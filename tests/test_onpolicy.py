"""On-policy post-training (train/onpolicy.py, train/draft_opd.py, decoding/recorder.py).

The recorder is checked against the decoder it wraps (the same tokens and counts as a plain decode,
every call's anchor, drafts, accepted count and correction consistent with what was emitted); the
Draft-OPD terms against hand computations; the replay of every supported kind against the decoder
(at the recorded calls the head's teacher-forced law drafts what the decoder drafted); and the whole
run, two rounds of two steps, through its command line for DFlash and EAGLE-3.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from fixtures import VOCAB, greedy_answers_batch

from draftsmith.decoding import SamplingConfig, generate_batch
from draftsmith.decoding.recorder import RecordingDrafter
from draftsmith.heads.registry import get_method
from draftsmith.train.draft_opd import (
    OPDWeights,
    bernoulli_forward_kl,
    draft_opd_terms,
    k3,
    rejected_weights,
    replay_batch,
    replay_losses,
)
from draftsmith.train.onpolicy import KINDS, OnPolicyRecipe, heldout_tau, main, method_recipe, rollout
from draftsmith.train.recipe import RecipeError, load_recipe

BLOCK = 4
AUX = [0, 1, 2]


def _build(kind: str, target):
    """A small head of `kind` for `target`, its corrections (if any) not zero."""
    from draftsmith.heads.dflash import DFlashHead
    from draftsmith.heads.dflash2 import DFlash2Head
    from draftsmith.heads.domino import DominoHead
    from draftsmith.heads.dspark import DSparkHead
    from draftsmith.heads.eagle import EagleHead

    torch.manual_seed(0)
    block = {"block_size": BLOCK, "mask_token_id": VOCAB - 1, "aux_layer_ids": AUX}
    head = {
        "dflash": lambda: DFlashHead.for_target(target, **block),
        "dspark": lambda: DSparkHead.for_target(target, **block, markov_rank=8),
        "domino": lambda: DominoHead.for_target(target, **block, gru_hidden=16, proj_dim=8),
        "dflash2": lambda: DFlash2Head.for_target(target, **block, selector_rank=8, selector_top_k=4),
        "eagle": lambda: EagleHead.for_target(target, "eagle3", aux_layer_ids=AUX),
        "eagle1": lambda: EagleHead.for_target(target, "eagle1"),
    }[kind]()
    with torch.no_grad():
        if kind == "dspark":
            head.markov_head.markov_w2.weight.normal_(0, 0.5)
        if kind == "domino":
            head.embed_proj[2].weight.normal_(0, 0.5)
    return head


def _method(kind: str):
    """The registry entry of a test kind (eagle1: an EAGLE-1 head, of kind eagle)."""
    return get_method("eagle" if kind == "eagle1" else kind)


def _fit(kind: str, head, target, steps: int = 20):
    """`steps` of the method's own loss on the target's greedy answers, so that the head drafts right often."""
    from draftsmith.train.blocks import sample_anchors

    _, batch, states = greedy_answers_batch(target)
    feats = torch.cat([states.hidden_states[i] for i in head.config.aux_layer_ids], -1)
    recipe = method_recipe(OnPolicyRecipe(target="t", head="h", data="d", out="o"), _method(kind), head)
    losses = _method(kind).part("replay").losses
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        if kind.startswith("eagle"):
            per_step, _, _ = losses(head, batch, feats, states.logits, recipe, None, train=True, steps=3)
            loss = sum(per_step)
        else:
            gen = torch.Generator().manual_seed(step)
            trained = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))  # anchors before trained tokens
            anchors, valid = sample_anchors(trained, batch["attention_mask"], BLOCK, 32, gen)
            loss = losses(head, batch, feats, states.logits, anchors, valid, recipe, None)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def _drafter(kind, head, target):
    return next(iter(_method(kind).rows(head, target, _method(kind).kind).values()))


@pytest.fixture(scope="module")
def fitted(pairs):
    """kind -> (target, a head of that kind fitted to the target's greedy answers), built on first use."""
    target, _ = pairs("llama")
    heads = {}

    def get(kind):
        if kind not in heads:
            heads[kind] = _fit(kind, _build(kind, target), target)
        return target, heads[kind]

    return get


def _prompts(target):
    """Three prompts the heads were fitted on (`greedy_answers_batch`'s), and a one-token prompt."""
    fitted = greedy_answers_batch(target)[0]
    return [*fitted[:3], fitted[3][:1]]


# ------------------------------------------------------------------------- the recorder


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_recorder_captures_exactly_what_the_decoder_did(fitted, temperature):
    target, head = fitted("dflash")
    prompts, sampling = _prompts(target), SamplingConfig(temperature=temperature)
    settings = {"num_draft_tokens": BLOCK - 1, "max_new_tokens": 20, "sampling": sampling, "seed": 3}
    plain = generate_batch(target, prompts, _drafter("dflash", head, target), **settings)
    recorder = RecordingDrafter(_drafter("dflash", head, target))
    result = generate_batch(target, prompts, recorder, **settings)
    assert result.tokens == plain.tokens  # the recorder changes nothing the decoder does
    assert [r.accepted for r in result.rows] == [r.accepted for r in plain.rows]
    if temperature == 0:
        alone = generate_batch(target, prompts, None, max_new_tokens=20)
        assert result.tokens == alone.tokens
    calls = recorder.calls(result)
    accepted = rejected = 0
    for prompt, tokens, row, stats in zip(prompts, result.tokens, calls, result.rows):
        at = len(prompt)
        for call, n in zip(row, stats.accepted):
            assert call.anchor == at and call.accepted == n  # each call where the row stood, as many kept
            assert list(call.emitted) == tokens[at - len(prompt) : at - len(prompt) + n + 1]
            assert call.drafts[:n] == call.emitted[:n]  # the accepted drafts are what was emitted
            if call.rejected:  # the correction replaced the draft the verifier rejected
                assert call.correction == call.emitted[n] != call.drafts[n]
                rejected += 1
            at += n + 1
            accepted += n
        assert [t for call in row for t in call.emitted] == tokens
    assert accepted >= 5 and rejected >= 5, (accepted, rejected)  # both branches were recorded
    assert len(calls[3]) > 0 and calls[3][0].anchor == 1  # a one-token prompt drafts from its first call
    recorder._drafts[0][len(prompts[0])] = (0,) * BLOCK  # a record that disagrees with the decoder's
    with pytest.raises(RuntimeError, match="recorder out of step at row 0"):
        recorder.calls(result)


# ------------------------------------------------------------------------- the Draft-OPD terms


def test_the_terms_are_zero_when_the_draft_is_the_target():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen)
    tokens = torch.randint(0, 11, (6,), generator=gen)
    target_logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(bernoulli_forward_kl(target_logp, logits, tokens), torch.zeros(6), atol=1e-6)
    assert torch.allclose(k3(target_logp, logits, tokens), torch.zeros(6), atol=1e-6)
    other = torch.randn(6, 11, generator=gen)  # a different draft: both terms are positive
    assert (bernoulli_forward_kl(target_logp, other, tokens) > 0).all() and (k3(target_logp, other, tokens) > 0).all()


def test_the_terms_against_a_hand_computation():
    q = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]])
    logits, tokens = q.log(), torch.tensor([0, 2])
    p = torch.tensor([0.3, 0.2])  # the target's probability of each drafted token
    bern = bernoulli_forward_kl(p.log(), logits, tokens)
    expected = [
        0.3 * math.log(0.3 / 0.6) + 0.7 * math.log(0.7 / 0.4),
        0.2 * math.log(0.2 / 0.25) + 0.8 * math.log(0.8 / 0.75),
    ]
    assert bern.tolist() == pytest.approx(expected, rel=1e-5)
    r = [0.3 / 0.6, 0.2 / 0.25]
    assert k3(p.log(), logits, tokens).tolist() == pytest.approx([x - 1 - math.log(x) for x in r], rel=1e-5)
    # rejected drafts weigh decay^(offset - 1) from the draft the verifier rejected on; accepted ones 0
    weights = rejected_weights(torch.tensor([1, 0, 3, 2]), torch.tensor([4, 2, 3, 3]), 4, 0.5)
    assert weights.tolist() == [[0, 1, 0.5, 0.25], [1, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    assert rejected_weights(torch.tensor([1]), torch.tensor([4]), 4, 0.0).tolist() == [[0, 1, 0, 0]]
    # the weighted means: Bernoulli over accepted drafts, k3 by the rejected weights
    accepted = torch.tensor([True, False])
    weight = torch.tensor([0.0, 0.5])
    bern_mean, k3_mean = draft_opd_terms(p.log(), logits, tokens, accepted, weight)
    assert float(bern_mean) == pytest.approx(expected[0], rel=1e-5)
    assert float(k3_mean) == pytest.approx(r[1] - 1 - math.log(r[1]), rel=1e-5)


def test_the_gradients_push_the_draft_toward_the_target():
    """k3 lowers the draft's logit of a rejected token the target gives less; the Bernoulli KL raises
    the logit of an accepted token the target gives more; both reach every logit."""
    logits = torch.zeros(2, 5, requires_grad=True)  # q = 0.2 everywhere
    tokens = torch.tensor([1, 3])
    p = torch.tensor([0.05, 0.9])
    rejected = k3(p.log(), logits, tokens)[0]
    (grad,) = torch.autograd.grad(rejected, logits)
    assert grad[0, 1] > 0 and (grad[1] == 0).all()  # gradient descent lowers q(x) where p(x) < q(x)
    accepted = bernoulli_forward_kl(p.log(), logits, tokens)[1]
    (grad,) = torch.autograd.grad(accepted, logits)
    assert grad[1, 3] < 0 and (grad[1, [0, 1, 2, 4]] > 0).all() and (grad[0] == 0).all()


# ------------------------------------------------------------------------- the replay, every kind


@pytest.mark.parametrize("kind", [*KINDS, "eagle1"])
def test_the_replay_drafts_what_the_decoder_drafted_and_trains(fitted, kind):
    """At every recorded call the replayed head's teacher-forced law (greedy: its argmax) is the draft
    the decoder made, up to and with the rejected one (the row's tokens are the drafts there): the
    replay anchors where the decoder called. Then one step: a finite loss, every term present, and
    gradients on the head's trained weights."""
    target, head = fitted(kind)
    recipe = OnPolicyRecipe(target="t", head="h", data="d", out="o", max_new_tokens=16, rollout_batch_size=2)
    prompts = [p.tolist() for p in _prompts(target)]
    k = BLOCK - 1
    episodes = rollout(target, _drafter(kind, head, target), prompts, recipe, k, seed=0)
    replay = _method(kind).part("replay")
    batch = replay_batch(episodes, width=k, offset=replay.offset, pad_id=0, device="cpu")
    losses_recipe = method_recipe(recipe, _method(kind), head)
    from draftsmith.train.draft_opd import _Kept, _method_loss

    with torch.no_grad():  # the drafting law at the recorded calls, from the forward the loss makes
        out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in head.config.aux_layer_ids], -1)
        anchors, kept = (batch["call_at"] - replay.offset).clamp(min=0), _Kept(head)
        _method_loss(replay, kept, batch, feats, out.logits, None, anchors, batch["call_valid"], losses_recipe, k)
        law = replay.law(head, batch, kept.kept, anchors, batch["drafts"])[:, :, :k]
    drafted = head.draft_to_target(law.argmax(-1))  # [B, A, K]
    checked = 0
    for b, episode in enumerate(episodes):
        calls = [c for c in episode.calls if c.drafts and c.anchor >= replay.offset]
        for a, call in enumerate(calls):
            upto = min(call.accepted + 1, len(call.drafts))  # the accepted drafts and the rejected one
            assert drafted[b, a, :upto].tolist() == list(call.drafts[:upto]), (b, a, call)
            checked += upto
    assert checked >= 20, checked

    head.train()
    loss, parts = replay_losses(replay, head, target, batch, losses_recipe, OPDWeights())
    loss.backward()
    assert math.isfinite(loss.item()) and parts["accepted_drafts"] > 0 and parts["rejected_drafts"] > 0, parts
    assert parts["accepted_kl"] > 0 and parts["rejected_k3"] > 0 and parts["method_loss"] > 0, parts
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    head.zero_grad(set_to_none=True)
    head.eval()


# ------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def saved_heads(toy_dir, tmp_path_factory):
    """kind -> a head folder of the toy target (fitted to its greedy answers), as its trainer saves it."""
    from draftsmith.heads.dflash_formats import save_dflash
    from draftsmith.heads.eagle import save_eagle
    from draftsmith.heads.models import load_causal_lm

    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    root = tmp_path_factory.mktemp("onpolicy-heads")
    folders = {}
    for kind, save in (("dflash", save_dflash), ("eagle", save_eagle)):
        folders[kind] = root / kind
        save(_fit(kind, _build(kind, target), target, steps=10), folders[kind])
    return folders


def _run_values(toy_dir, toy_data, head, out) -> dict:
    return {
        "target": str(toy_dir / "target"),
        "head": str(head),
        "data": str(toy_data),
        "out": str(out),
        "rounds": 2,
        "steps_per_round": 2,
        "prompts_per_round": 3,
        "max_new_tokens": 10,
        "batch_size": 2,
        "heldout_fraction": 0.34,
        "eval_prompts": 2,
        "device": "cpu",
    }


@pytest.mark.parametrize("kind", ["dflash", "eagle"])
def test_two_rounds_write_loadable_heads_and_a_report(kind, toy_dir, toy_data, saved_heads, tmp_path, capsys):
    from draftsmith.eval.drafter_specs import chain_drafter
    from draftsmith.heads.models import load_causal_lm

    out = tmp_path / "run"
    values = _run_values(toy_dir, toy_data, saved_heads[kind], out)
    values |= {"temperature": 1.0, "lr": 1e-3, "method_recipe": {"loss": "forward_kl"}}
    recipe_file = tmp_path / "onpolicy.yaml"
    recipe_file.write_text(yaml.safe_dump(values), encoding="utf-8")
    assert main(["--recipe", str(recipe_file), "--no-progress"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == kind and report["complete"] and [r["round"] for r in report["rounds"]] == [0, 1, 2]
    assert all(r["tau_decoded"] >= 1.0 and r["target_calls"] > 0 for r in report["rounds"])
    assert all(r["rollout"]["prompts"] == 3 and r["replay"]["steps"] == 2 for r in report["rounds"][1:])
    assert "held-out tau" in printed and "bonus token counted" in printed
    # sampled rollouts are measured at their temperature (eval_temperature unset), every round on the same streams
    assert (
        report["eval_temperature"] == 1.0 and "at T = 1 (the same seeded streams (seed 0) each round)" in report["tau"]
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(math.isfinite(m["loss"]) for m in metrics)
    assert json.loads((out / "recipe.json").read_text())["method_recipe_resolved"]["loss"] == "forward_kl"

    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (5, 9)]
    alone = generate_batch(target, prompts, None, max_new_tokens=12).tokens
    before = get_method(kind).load(saved_heads[kind], target=target, device="cpu", dtype=torch.float32)
    for r in (1, 2):
        folder = out / f"round-{r}"
        assert report["rounds"][r]["head"] == str(folder)
        drafter = chain_drafter(kind, folder, target, torch.device("cpu"), torch.float32)
        assert generate_batch(target, prompts, drafter, num_draft_tokens=3, max_new_tokens=12).tokens == alone
    after = get_method(kind).load(out / "round-2", target=target, device="cpu", dtype=torch.float32)
    changed = [
        n for (n, a), b in zip(after.state_dict().items(), before.state_dict().values()) if not torch.equal(a, b)
    ]
    assert changed, "two rounds of replay left the head as it was"


def test_decoded_tau_counts_the_full_calls_with_their_standard_error(monkeypatch):
    """Calls that drafted fewer than the most drafted (cut by the budget) are left out; the standard error
    is the sample standard deviation of the counted calls' tokens over the square root of their number."""
    from types import SimpleNamespace

    import draftsmith.decoding
    from draftsmith.train.common import decoded_tau

    rows = [SimpleNamespace(proposed=[3, 3, 1], accepted=[0, 3, 1]), SimpleNamespace(proposed=[3, 3], accepted=[1, 2])]
    monkeypatch.setattr(draftsmith.decoding, "generate_batch", lambda *a, **k: SimpleNamespace(rows=rows))
    target = torch.nn.Linear(2, 2)
    target.get_output_embeddings = lambda: target
    target.generation_config = SimpleNamespace(eos_token_id=None)
    tau, calls, se = decoded_tau(target, None, [[1, 2]], 3, 8)
    kept = torch.tensor([1.0, 4.0, 2.0, 3.0])  # accepted + 1 of the calls that proposed 3
    assert (tau, calls) == (2.5, 4) and se == pytest.approx(float(kept.std()) / 2)


def test_a_sampled_held_out_tau_decodes_the_same_streams_each_time(toy_dir, toy_data, saved_heads, tmp_path):
    """Rounds are compared at T > 0 on the same seeded draws: one head measured twice gives one tau."""
    from draftsmith.eval.drafter_specs import chain_drafter
    from draftsmith.heads.models import load_causal_lm

    recipe = OnPolicyRecipe(**_run_values(toy_dir, toy_data, saved_heads["dflash"], tmp_path / "run"), temperature=1.0)
    target = load_causal_lm(toy_dir / "target", device=torch.device("cpu"), dtype=torch.float32, role="target")
    drafter = chain_drafter("dflash", saved_heads["dflash"], target, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 7, 6)]
    first = heldout_tau(target, drafter, prompts, 3, recipe)
    assert heldout_tau(target, drafter, prompts, 3, recipe) == first and first["target_calls"] > 0


def test_a_run_stopped_by_a_nan_keeps_its_finished_rounds(
    toy_dir, toy_data, saved_heads, tmp_path, monkeypatch, capsys
):
    import draftsmith.train.onpolicy as onpolicy
    from draftsmith.train.run import TrainingError

    calls, real = [], onpolicy.replay_losses

    def nan_in_round_2(*args):
        calls.append(1)
        loss, parts = real(*args)
        return (loss * float("nan") if len(calls) == 3 else loss), parts

    monkeypatch.setattr(onpolicy, "replay_losses", nan_in_round_2)
    out = tmp_path / "run"
    recipe = OnPolicyRecipe(**_run_values(toy_dir, toy_data, saved_heads["dflash"], out))
    with pytest.raises(TrainingError, match="round 2, step 1: the loss became nan"):
        onpolicy.train(recipe, progress=False)
    report = json.loads((out / "report.json").read_text())
    assert not report["complete"] and [r["round"] for r in report["rounds"]] == [0, 1]
    assert (out / "round-1" / "config.json").is_file() and not (out / "round-2").exists()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"round": 2}, "unknown key(s) round (did you mean rounds?)"),
        (
            {"kind": "medusa"},
            "kind = 'medusa': on-policy post-training supports eagle, dflash, dspark, domino, dflash2",
        ),
        ({"rejected_decay": 1.5}, "rejected_decay = 1.5 must be in [0, 1]"),
        ({"eval_temperature": -1.0}, "eval_temperature = -1.0 must be >= 0"),
        ({"method_recipe": {"los": "tv"}}, "method_recipe: unknown key(s) los for dflash (DFlashRecipe's own keys: "),
        ({"method_recipe": {"lr": 1.0}}, "method_recipe: unknown key(s) lr for dflash"),
        ({"method_recipe": {"loss": "kl"}}, "method_recipe: loss = 'kl': expected one of"),
        ({"method_recipe": {"block_size": 8}}, "method_recipe: block_size = 8, but the head's is 4"),
    ],
)
def test_a_bad_recipe_is_refused_naming_the_key(values, message, toy_dir, toy_data, saved_heads, tmp_path, capsys):
    out = tmp_path / "run"
    base = {"target": str(toy_dir / "target"), "head": str(saved_heads["dflash"]), "data": str(toy_data)}
    recipe_file = tmp_path / "onpolicy.yaml"
    recipe_file.write_text(yaml.safe_dump({**base, "out": str(out), "device": "cpu", **values}), encoding="utf-8")
    assert main(["--recipe", str(recipe_file), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train/onpolicy.py: error:") and message in err, err
    assert not out.exists()  # nothing half-written


def test_a_head_of_another_kind_is_refused_in_one_line(toy_dir, tmp_path):
    from draftsmith.train.onpolicy import head_method

    folder = tmp_path / "medusa"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "draftsmith_medusa"}))
    recipe = OnPolicyRecipe(target=str(toy_dir / "target"), head=str(folder), data="d", out="o")
    with pytest.raises(RecipeError, match=r"holds a Medusa heads \(kind medusa\): on-policy post-training supports"):
        head_method(recipe)
    with pytest.raises(RecipeError, match="unknown key"):
        load_recipe(OnPolicyRecipe, None, {"target": "t", "head": "h", "data": "d", "out": "o", "step": 1})


def test_the_replay_takes_the_loss_the_heads_run_recorded(tmp_path):
    """A head in a run folder replays with the loss keys its recipe.json recorded (a trainer's, or an
    on-policy run's resolved ones), the recipe's method_recipe over them; the run's inputs and shared keys
    are not carried over, and a broken recipe.json is refused naming the file."""
    run = tmp_path / "dflash-run"
    (run / "head").mkdir(parents=True)
    (run / "head" / "config.json").write_text(json.dumps({"model_type": "draftsmith_dflash"}))
    recorded = {"loss": "tv", "decay_gamma": 2.0, "hidden_cache": "/nowhere", "lr": 5.0, "gone_key": 1}
    (run / "recipe.json").write_text(json.dumps(recorded))
    recipe = OnPolicyRecipe(target="t", head=str(run / "head"), data="d", out="o")
    dflash = get_method("dflash")
    resolved = method_recipe(recipe, dflash)
    assert (resolved.loss, resolved.decay_gamma, resolved.hidden_cache, resolved.lr) == ("tv", 2.0, None, 6e-4)
    given = OnPolicyRecipe(target="t", head=str(run / "head"), data="d", out="o", method_recipe={"loss": "jsd"})
    assert (method_recipe(given, dflash).loss, method_recipe(given, dflash).decay_gamma) == ("jsd", 2.0)
    (run / "recipe.json").write_text(json.dumps({"rounds": 3, "method_recipe_resolved": {"loss": "reverse_kl"}}))
    assert method_recipe(recipe, dflash).loss == "reverse_kl"
    (run / "recipe.json").write_text("{not json")
    with pytest.raises(RecipeError, match="recipe.json' \\(the head's run recipe\\) is not readable JSON"):
        method_recipe(recipe, dflash)
    unrecorded = OnPolicyRecipe(target="t", head=str(tmp_path / "x" / "head"), data="d", out="o")
    assert method_recipe(unrecorded, dflash).loss == "soft_ce"  # no run folder: the trainer's defaults


def test_greedy_rollouts_of_greedy_data_are_said_to_repeat_it():
    from draftsmith.train.onpolicy import repeated_rows_note

    greedy = {"settings": {"temperature": 0.0, "max_new_tokens": 128}}
    recipe = OnPolicyRecipe(target="t", head="h", data="d", out="o", max_new_tokens=128)
    assert "the rows replayed are the head's own training rows" in repeated_rows_note(recipe, greedy)
    longer = OnPolicyRecipe(target="t", head="h", data="d", out="o", max_new_tokens=256)
    sampled = OnPolicyRecipe(target="t", head="h", data="d", out="o", temperature=1.0)
    assert repeated_rows_note(longer, greedy) is None and repeated_rows_note(sampled, greedy) is None
    assert repeated_rows_note(recipe, {"settings": {"temperature": 0.7, "max_new_tokens": 128}}) is None
    assert repeated_rows_note(recipe, {}) is None
