"""train/eagle.py on a toy target (EAGLE-1 and EAGLE-3), offline caches, `eval --eagle`, `export`."""

import json

import pytest
import torch
from lifecycle_helpers import cache_hidden_args, eval_error_args, head_recipe, losses, recipe_base, toy_eval_args

from draftsmith.distill.data import DistillData
from draftsmith.distill.hidden_cache import CacheError
from draftsmith.heads.eagle import load_eagle
from draftsmith.train.eagle import EagleRecipe, main, train, ttt_mask
from draftsmith.train.recipe import RecipeError, load_recipe


def recipe(toy_dir, toy_data, out, **extra):
    return EagleRecipe(**head_recipe(toy_dir, toy_data, out, eval_depth=3) | extra)


def test_ttt_mask_sees_the_context_and_its_own_chain():
    mask = ttt_mask(3, 2, "cpu")[0, 0] == 0  # [3, 9]: step-0 block, step-1 block, step-2 block
    assert mask[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert mask[:, 3:6].tolist() == torch.eye(3, dtype=torch.bool).tolist()
    assert mask[:, 6:].tolist() == torch.eye(3, dtype=torch.bool).tolist()


def test_bad_recipes(tmp_path):
    base = dict(target="t", data="d", out="o")
    with pytest.raises(ValueError, match="eagle3 options"):
        EagleRecipe(**base, version="eagle1", draft_vocab_size=64)
    with pytest.raises(ValueError, match="expected eagle1 or eagle3"):
        EagleRecipe(**base, version="eagle2")
    path = tmp_path / "r.yaml"
    path.write_text("target: t\ndata: d\nout: o\nttt_step: 3\n")
    with pytest.raises(RecipeError, match="unknown key.*ttt_step.*valid keys.*ttt_steps"):
        load_recipe(EagleRecipe, path)
    with pytest.raises(ValueError, match="loss = 'kl': expected one of .*soft_ce.*nla, lk_hybrid"):
        EagleRecipe(**base, loss="kl")
    with pytest.raises(ValueError, match="fc_norm / norm_output are eagle3 options"):
        EagleRecipe(**base, version="eagle1", norm_output=True)


@pytest.mark.parametrize("version, extra", [("eagle3", {"draft_vocab_size": 64, "ttt_steps": 3}), ("eagle1", {})])
def test_training_lowers_the_loss_and_saves_a_loadable_head(toy_dir, toy_data, tmp_path, version, extra):
    out = tmp_path / version
    summary = train(recipe(toy_dir, toy_data, out, version=version, log_every=1, **extra), progress=False)
    values = losses(out)
    assert len(values) == 12 and sum(values[-3:]) / 3 < sum(values[:3]) / 3
    head = load_eagle(out / "head", expected_data_hash=DistillData(toy_data).data_hash if version == "eagle3" else None)
    assert head.config.version == version and len(summary["eval"]["top1_per_step"]) == 3
    assert 1.0 <= summary["eval"]["tau_simulated"] <= 4.0
    if version == "eagle3":
        assert head.config.draft_vocab_size == 64 and summary["vocab_coverage"] > 0.5


def test_train_on_all_reads_the_prompts_too_and_holds_out_the_answers(toy_dir, toy_data, tmp_path):
    """`train_on: all`: a training batch's loss reads every token after a row's first (a superset of
    the answers); the held-out batches still read the answers only; a value not known is refused."""
    from draftsmith.train.common import collate_rows, heldout_batches

    data = DistillData(toy_data)
    rows = list(range(len(data)))
    answers, every = collate_rows(data, rows, 64, 0), collate_rows(data, rows, 64, 0, every_token=True)
    real = every["attention_mask"].bool()
    assert (every["loss_mask"] == real & (torch.arange(real.shape[1]) > 0)).all()
    assert (every["loss_mask"] | ~answers["loss_mask"]).all() and every["loss_mask"].sum() > answers["loss_mask"].sum()
    ((_, held),) = heldout_batches(data, rows, len(rows), 64, 0, "cpu")
    assert (held["loss_mask"] == answers["loss_mask"]).all()

    out = tmp_path / "all"
    summary = train(recipe(toy_dir, toy_data, out, train_on="all", draft_vocab_size=64, ttt_steps=2), progress=False)
    assert json.loads((out / "recipe.json").read_text())["train_on"] == "all"
    assert 1.0 <= summary["eval"]["tau_simulated"] <= 3.0
    with pytest.raises(ValueError, match="train_on = 'prompts': expected one of answers, all"):
        EagleRecipe(target="t", data="d", out="o", train_on="prompts")


def test_eagle31_with_an_lk_loss_trains_decodes_and_saves(toy_dir, toy_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftsmith.decoding import generate
    from draftsmith.decoding.eagle import EagleDrafter

    out = tmp_path / "e31"
    extra = dict(draft_vocab_size=64, ttt_steps=2, fc_norm=True, norm_output=True, loss="lk_hybrid", log_every=1)
    train(recipe(toy_dir, toy_data, out, **extra), progress=False)
    values = losses(out)
    assert len(values) == 12 and all(v == v for v in values) and sum(values[-3:]) / 3 < sum(values[:3]) / 3
    head = load_eagle(out / "head")
    assert (head.config.fc_norm, head.config.norm_output) == (True, True)
    assert not torch.equal(head.fc_norm[0].weight, torch.ones_like(head.fc_norm[0].weight))  # the new norms trained
    target = AutoModelForCausalLM.from_pretrained(toy_dir / "target").eval()
    prompt = torch.arange(3, 15)
    reference = generate(target, None, prompt, max_new_tokens=12).tokens
    assert generate(target, EagleDrafter(head), prompt, max_new_tokens=12, num_draft_tokens=3).tokens == reference


def test_offline_cache_and_mismatches(toy_dir, toy_data, tmp_path, run_cli):
    cache = tmp_path / "cache"
    code, _, err = run_cli(cache_hidden_args(toy_dir, toy_data, cache, "0,1,last"))
    assert code == 0, err
    # eagle3 on a 2-layer target reads aux (0, 1) and needs `last` for the teacher
    summary = train(
        recipe(toy_dir, toy_data, tmp_path / "offline", hidden_cache=str(cache), max_steps=3), progress=False
    )
    assert summary["aux_layers"] == [0, 1]
    # a cache holding more layers than the head reads serves it (aux [1] + last of (0, 1, last))
    summary = train(
        recipe(toy_dir, toy_data, tmp_path / "o2", hidden_cache=str(cache), aux_layers=[1], max_steps=2), progress=False
    )
    assert summary["aux_layers"] == [1] and summary["train_tokens_per_second"] > 0
    fewer = tmp_path / "fewer"
    code, _, err = run_cli(cache_hidden_args(toy_dir, toy_data, fewer, "1,last"))
    assert code == 0, err
    with pytest.raises(CacheError, match=r"holds layers \[1, 2\], the trainer needs \[0, 1, 2\] \(missing \[0\]\)"):
        train(recipe(toy_dir, toy_data, tmp_path / "o3", hidden_cache=str(fewer), max_steps=2), progress=False)


def test_eval_and_export_an_eagle_head(toy_dir, toy_data, tmp_path, run_cli):
    out = tmp_path / "e3"
    train(recipe(toy_dir, toy_data, out, draft_vocab_size=64, ttt_steps=2, max_steps=4), progress=False)
    head = out / "head"
    code, stdout, err = run_cli(
        toy_eval_args(
            "eval",
            toy_dir,
            "--eagle",
            head,
            "--eagle-tree",
            "2,3,8",
            limit=2,
            max_new_tokens=10,
            k=3,
            out=tmp_path / "ev",
        )
    )
    assert code == 0, err
    rows = {r["method"]: r for r in json.loads((tmp_path / "ev" / "report.json").read_text())["methods"]}
    assert {"eagle-chain", "eagle-tree"} <= set(rows) and rows["eagle-tree"]["tree"]
    # The toy target has 2 layers: aux ids (0, 1) are not the three ids servers wire in, so the
    # server formats refuse; the draftsmith format round-trips.
    code, _, err = run_cli(["export", head, "--format", "vllm", "--out", tmp_path / "v"])
    assert code == 2 and "exactly 3 aux hidden states" in err
    code, _, err = run_cli(["export", head, "--format", "hf", "--out", tmp_path / "hf"])
    assert code == 0, err
    a, b = load_eagle(head), load_eagle(tmp_path / "hf")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # Several heads side by side, each named: the same weights measure the same.
    code, _, err = run_cli(
        toy_eval_args(
            "eval",
            toy_dir,
            *("--eagle", f"ours={head}", "--eagle", f"copy={tmp_path / 'hf'}"),
            limit=1,
            max_new_tokens=8,
            k=3,
            out=tmp_path / "ev2",
            extra=["--no-distances"],
        )
    )
    assert code == 0, err
    rows = {r["method"]: r for r in json.loads((tmp_path / "ev2" / "report.json").read_text())["methods"]}
    assert {"ours-chain", "copy-chain"} <= set(rows) and rows["ours-chain"]["alpha"] == rows["copy-chain"]["alpha"]
    code, _, err = run_cli(eval_error_args(toy_dir, "--eagle", f"medusa={head}", out=tmp_path / "x"))
    assert code == 2 and "another method's name" in err
    code, _, err = run_cli(eval_error_args(toy_dir, "--prompt-lookup", "--eagle-tree", "2,2,4", out=tmp_path / "x"))
    assert code == 2 and "give --drafter eagle=DIR" in err
    code, _, err = run_cli(eval_error_args(toy_dir, "--eagle", head, "--eagle-tree", "2,2", out=tmp_path / "x"))
    assert code == 2 and "DEPTH,TOP_K,TOTAL_TOKENS" in err


def test_entry_point_reports_errors(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("target: t\ndata: d\nout: o\nversion: eagle9\n")
    assert main(["--recipe", str(path), "--no-progress"]) == 2


def _fibonacci(n: int, a: int, b: int, m: int, offset: int) -> list[int]:
    out = [a, b]
    while len(out) < n:
        out.append((out[-1] + out[-2]) % m)
    return [offset + x for x in out]


def _fit_stream(model, stream, *, steps: int, batch_size: int, seq_len: int, lr: float, warmup: int = 10) -> float:
    """Next-token training of `model` on random windows of `stream` (AdamW, linear warm-up); returns the
    loss on the stream's first 2,000 tokens afterwards."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
        ids = torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).long()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        held = stream[:2000].long().view(-1, seq_len)
        return float(model(input_ids=held, labels=held).loss)


@pytest.mark.slow
def test_training_time_test_helps_deeper_drafts(tmp_path):
    """A fixture task where drafting deeper needs the draft's own state: the target continues
    Fibonacci sequences mod 10 (each token needs the two before it). At step 2+, the head must
    carry the previous token in the feature it feeds itself; only training-time test (n > 1)
    teaches that. Same budget for n = 1 and n = 3; depth >= 2 accuracy must be clearly higher."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.generate import GenerateSettings
    from draftsmith.distill.generate_run import generate_dataset
    from draftsmith.distill.sources import load_source
    from draftsmith.heads.toy import tiny_config, tiny_tokenizer

    m, offset = 10, 10
    gen = torch.Generator().manual_seed(0)
    stream = []
    for _ in range(400):
        a, b = torch.randint(0, m, (2,), generator=gen).tolist()
        stream += _fibonacci(40, a, b, m, offset)
    stream = torch.tensor(stream, dtype=torch.int32)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("llama", hidden=48, layers=2))
    assert _fit_stream(target, stream, steps=150, batch_size=16, seq_len=40, lr=3e-3) < 0.8  # it learned the rule
    target.generation_config.eos_token_id = None
    tok = tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    prompts = [_fibonacci(4, *torch.randint(0, m, (2,), generator=gen).tolist(), m, offset) for _ in range(32)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": tok.decode(p)}) for p in prompts) + "\n")
    settings = GenerateSettings(max_new_tokens=20, batch_size=16)
    generate_dataset(
        target,
        tok,
        load_source(str(tmp_path / "p.jsonl")),
        tmp_path / "data",
        settings,
        template=None,
        progress=False,
        log=lambda *a: None,
    )
    # 60 steps of 8 rows at lr 3e-3, evaluated after the last on a quarter of the data
    training = dict(
        batch_size=8, max_length=64, max_steps=60, warmup_steps=5, eval_every=60, save_every=1000, heldout_fraction=0.25
    )
    deep = {}
    for n in (1, 3):
        values = recipe_base(tmp_path / "target", tmp_path / "data", tmp_path / f"e{n}", lr=3e-3, **training)
        r = EagleRecipe(**values, version="eagle3", ttt_steps=n, eval_depth=3)
        top1 = train(r, progress=False)["eval"]["top1_per_step"]
        deep[n] = sum(top1[1:]) / 2
    print("depth >= 2 top-1, n = 1 vs n = 3:", deep)
    assert deep[3] > deep[1] + 0.2, deep
