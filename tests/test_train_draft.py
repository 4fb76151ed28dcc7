"""train/draft.py on a toy target: divergences lower, on-policy uses the draft, acceptance rises,
bad recipes are clear errors."""

import json

import pytest
import torch
import torch.nn.functional as F
from lifecycle_helpers import launch_one_process, toy_recipe, write_recipe

from draftsmith.distill.acceptance import simulated_tau
from draftsmith.distill.losses import divergence
from draftsmith.train.draft import DraftRecipe, chain_along_text, main
from draftsmith.train.draft_rows import generated_rows, is_on_policy_step
from draftsmith.train.recipe import RecipeError, load_recipe


def base(toy_dir, toy_data, out, **extra):
    values = toy_recipe(toy_dir, toy_data, out, max_steps=10, log_every=1, eval_every=10, lr=3e-4)
    return values | dict(draft_init="checkpoint", draft_path=toy_dir / "draft", num_draft_tokens=3) | extra


def summary(out):
    return json.loads((out / "training_summary.json").read_text())


def test_bad_recipes(tmp_path):
    ok = dict(target="t", out="o", data="d", draft_path="p")
    with pytest.raises(RecipeError, match="loss = 'kld'.*forward_kl, reverse_kl, jsd, tv, kl_tv"):
        load_recipe(DraftRecipe, write_recipe(tmp_path / "a.yaml", **ok, loss="kld"))
    with pytest.raises(RecipeError, match="on_policy_fraction = 1.5 must be in \\[0, 1\\]"):
        load_recipe(DraftRecipe, write_recipe(tmp_path / "b.yaml", **ok), ["on_policy_fraction=1.5"])
    with pytest.raises(RecipeError, match="draft_path"):
        load_recipe(DraftRecipe, write_recipe(tmp_path / "c.yaml", target="t", out="o", data="d"))
    with pytest.raises(RecipeError, match="unknown key.*divergence.*valid keys"):
        load_recipe(DraftRecipe, write_recipe(tmp_path / "d.yaml", **ok, divergence="tv"))


def test_on_policy_steps_are_spread():
    assert [is_on_policy_step(s, 0.5) for s in range(4)] == [False, True, False, True]
    assert sum(is_on_policy_step(s, 0.25) for s in range(100)) == 25
    assert not any(is_on_policy_step(s, 0.0) for s in range(10)) and all(is_on_policy_step(s, 1.0) for s in range(10))


def test_simulated_tau_along_the_text_matches_a_hand_computation():
    a = torch.tensor([[0.5, 0.5, 1.0, 0.0]])
    valid = torch.ones_like(a, dtype=torch.bool)
    tau = simulated_tau(chain_along_text(a, valid, 2))
    # 1 (bonus) + t=0: .5 + .5*.5; t=1: .5 + .5*1; t=2: 1 + 0; t=3: 0 (nothing after the end)
    assert tau[0].tolist() == pytest.approx([1.75, 2.0, 2.0, 1.0])
    valid[0, 1] = False  # an invalid position accepts nothing: the chains through it stop there
    assert simulated_tau(chain_along_text(a, valid, 2))[0].tolist() == pytest.approx([1.5, 1.0, 2.0, 1.0])


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd", "tv", "kl_tv"])
def test_each_divergence_lowers(loss):
    torch.manual_seed(0)
    teacher = torch.randn(4, 6, 40) * 3
    student = torch.randn(4, 6, 40, requires_grad=True)
    opt = torch.optim.Adam([student], lr=0.1)
    first = None
    for _ in range(30):
        value = divergence(loss, student, teacher)
        first = float(value.detach()) if first is None else first
        opt.zero_grad()
        value.backward()
        opt.step()
    assert float(value) < 0.5 * first


def test_distillation_raises_held_out_acceptance(toy_dir, toy_data, tmp_path):
    out = tmp_path / "fkl"
    assert (
        main(
            [
                "--recipe",
                str(write_recipe(tmp_path / "r.yaml", **base(toy_dir, toy_data, out, loss="forward_kl", max_steps=16))),
                "--no-progress",
            ]
        )
        == 0
    )
    s = summary(out)
    assert s["eval"]["acceptance"] > s["initial"]["acceptance"] + 0.02
    assert s["eval"]["tau_simulated"] > s["initial"]["tau_simulated"]
    assert (out / "draft" / "config.json").is_file() and (out / "draft" / "tokenizer.json").is_file()
    assert s["draft"]["parameters"] > 0 and s["on_policy_steps"] == 0


def test_train_on_all_trains_every_token_but_the_first(toy_dir, toy_data, tmp_path):
    from draftsmith.distill.data import DistillData

    rows = generated_rows(DistillData(toy_data))
    every = rows.every_token()
    assert every.ids is rows.ids and [sum(m) for m in every.masks] == [len(ids) - 1 for ids in rows.ids]
    assert all(m[0] == 0 for m in every.masks) and sum(map(sum, every.masks)) > sum(map(sum, rows.masks))
    out = tmp_path / "all"
    recipe = write_recipe(tmp_path / "r.yaml", **base(toy_dir, toy_data, out, train_on="all", max_steps=4))
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    assert summary(out)["eval"]["tau_simulated"] >= 1.0


def test_on_policy_uses_the_draft_and_records_it(toy_dir, toy_data, tmp_path):
    out = tmp_path / "op"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        **base(toy_dir, toy_data, out, loss="tv", on_policy_fraction=0.5, max_steps=4, on_policy_new_tokens=8),
    )
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    s = summary(out)
    assert s["on_policy_steps"] == 2 and s["off_policy_steps"] == 2 and 0 < s["on_policy_tokens"] <= 2 * 2 * 8
    logged = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "on_policy" in r]
    assert [r["on_policy"] for r in logged] == [False, True, False, True]


def test_fixed_data_ce_baseline_truncated_draft_and_lora(toy_dir, toy_data, tmp_path):
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(
        "\n".join(json.dumps({"text": line}) for line in (toy_dir / "prompts.jsonl").read_text().splitlines()[:8])
        + "\n"
    )
    out = tmp_path / "ce"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        **base(
            toy_dir,
            toy_data,
            out,
            loss="ce",
            data_mode="fixed",
            fixed_data=fixed,
            draft_init="truncate",
            draft_layers=1,
            max_steps=4,
        ),
    )
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    assert summary(out)["data"].startswith("fixed:") and summary(out)["draft"]["num_layers"] == 1
    out = tmp_path / "lora"
    recipe = write_recipe(tmp_path / "l.yaml", **base(toy_dir, toy_data, out, lora=True, lora_r=4, max_steps=3))
    assert main(["--recipe", str(recipe), "--no-progress"]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "draft")  # LoRA merged: a plain model
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_incompatible_draft_is_refused(toy_dir, toy_data, tmp_path):
    from draftsmith.heads.toy import tiny_model

    other = tmp_path / "other"
    model = tiny_model("llama", seed=3)
    model.resize_token_embeddings(400)
    model.save_pretrained(other)
    recipe = write_recipe(tmp_path / "r.yaml", **base(toy_dir, toy_data, tmp_path / "o", draft_path=other))
    assert main(["--recipe", str(recipe), "--no-progress"]) == 2


@pytest.mark.slow
def test_accelerate_launch_entry_point(toy_dir, toy_data, tmp_path):
    """The command users run: `accelerate launch train/draft.py --recipe ...`, in a subprocess."""
    out = tmp_path / "launched"
    stdout = launch_one_process("train/draft.py", base(toy_dir, toy_data, out, max_steps=2, eval_every=2), tmp_path)
    assert (out / "draft" / "config.json").is_file() and "held-out acceptance" in stdout


@pytest.mark.parametrize("loss", ["ce", "kl_tv", "topk"])
def test_logits_of_the_trained_positions_only_give_the_same_loss_and_gradient(pairs, loss):
    """The trainer has both models project only the trained positions' states (`logits_at`); the
    loss and the draft's gradient are the masked loss's over every position's logits."""
    from types import SimpleNamespace

    from draftsmith.distill.losses import cross_entropy, topk_divergence, topk_teacher
    from draftsmith.train.draft import draft_loss, logits_at, rows_of, trained_rows

    target, draft = pairs("llama")
    torch.manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (3, 12))
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0  # a shorter row, padded
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, 6:], loss_mask[1, 8:], loss_mask[2, 5:9] = True, True, True  # answers after prompts of 6, 8, 5
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    kind = "ce" if loss == "ce" else "kl_tv"
    recipe = SimpleNamespace(loss=kind, chunk_size=None, beta=0.5, tv_weight=0.5, temperature=1.0)
    params = [p for p in draft.parameters() if p.requires_grad]
    inputs = {"input_ids": ids, "attention_mask": attention, "use_cache": False}

    # the reference: every position's logits, the loss masked to the trained ones
    mask = loss_mask[:, 1:] & attention[:, :-1].bool()
    with torch.no_grad():
        teacher = target(**inputs).logits[:, :-1].float()
    student = draft(**inputs).logits[:, :-1].float()
    if loss == "ce":
        want = cross_entropy(student, ids[:, 1:], mask)
    elif loss == "topk":
        want = topk_divergence(kind, student, *topk_teacher(teacher, 5), mask, tv_weight=0.5)
    else:
        want = divergence(kind, student, teacher, mask, tv_weight=0.5)
    want_grad = torch.autograd.grad(want, params)

    kept = trained_rows(batch)
    assert kept.shape == ids.shape and int(kept.sum()) == int(mask.sum()) == 14
    with torch.no_grad(), logits_at(target, kept):
        rows = target(**inputs).logits
    assert rows.shape == (14, target.config.vocab_size)  # the output layer saw the 14 trained states only
    with logits_at(draft, kept):
        student_rows = rows_of(draft(**inputs).logits, kept)
    topk = topk_teacher(rows, 5) if loss == "topk" else None
    got = draft_loss(
        recipe, student_rows, labels=F.pad(ids[:, 1:], (0, 1))[kept], teacher=None if topk else rows, topk=topk
    )
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, params), want_grad):
        torch.testing.assert_close(a, b)
    assert draft(**inputs).logits.dim() == 3  # the hook is gone after the block


def test_a_model_that_feeds_its_output_layer_another_shape_keeps_its_logits_whole():
    """`logits_at` acts only when the output layer gets [B, T, H]; otherwise the model's logits come
    out whole and `rows_of` takes the trained rows from them."""
    from types import SimpleNamespace

    from draftsmith.train.draft import logits_at, rows_of

    class Flattening(torch.nn.Module):  # projects [B * T, H], as a model of its own making might
        def __init__(self):
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)

        def get_output_embeddings(self):
            return self.out

        def forward(self, ids):
            return SimpleNamespace(logits=self.out(self.embed(ids).reshape(-1, 4)).reshape(*ids.shape, 10))

    model, ids = Flattening(), torch.randint(0, 10, (2, 5))
    rows = torch.rand(2, 5) > 0.5
    with logits_at(model, rows):
        logits = model(ids).logits
    assert logits.shape == (2, 5, 10)
    torch.testing.assert_close(rows_of(logits, rows), model(ids).logits[rows])
