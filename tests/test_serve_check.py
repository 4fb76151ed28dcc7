"""The serve check at the end of training: the held-out simulated tau against the tau the real
decoder measures with the saved drafter (greedy chain, same K), printed, recorded in
training_summary.json and metrics.jsonl, and a warning when they differ by more than 10%.

The fixture target copies its last token (its layers add nothing to the residual stream, its
output head is its embedding): every greedy answer is one token repeated. Medusa heads and a
truncated draft predict that from the start, so both figures are high and must agree; a planted
mismatch (another K, a shuffled vocabulary map) must make the check warn. The simulated tau
follows the decoder's walk (`walk_tau`): heads that know some rows and not others agree too."""

import json
import types
from pathlib import Path

import pytest
import torch
from lifecycle_helpers import recipe_base

from draftsmith.train.common import heldout_prompts, serve_check


def write_copy_target(folder: Path, *, prompts: int = 24, new_tokens: int = 40) -> tuple[Path, Path]:
    """(target folder, data folder): the copying target and its greedy answers to `prompts` prompts."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.generate import GenerateSettings
    from draftsmith.distill.generate_run import generate_dataset
    from draftsmith.distill.sources import load_source
    from draftsmith.heads.toy import CORPUS, tiny_config, tiny_tokenizer

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config("llama", hidden=48, layers=2))
    with torch.no_grad():
        for layer in target.model.layers:  # each block adds zero: every state is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = target.get_input_embeddings().weight
        target.get_output_embeddings().weight.copy_(20 * torch.nn.functional.normalize(embed, dim=-1))
    target.generation_config.eos_token_id = None
    tok = tiny_tokenizer()
    target.save_pretrained(folder / "target")
    tok.save_pretrained(folder / "target")
    lines = [line.strip() for line in CORPUS.splitlines() if len(line.strip()) > 20][:prompts]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines))
    settings = GenerateSettings(max_new_tokens=new_tokens, batch_size=8)
    source = load_source(str(folder / "prompts.jsonl"))
    generate_dataset(target, tok, source, folder / "data", settings, template=None, progress=False, log=lambda *a: None)
    return folder / "target", folder / "data"


@pytest.fixture(scope="module")
def copy_target(tmp_path_factory):
    return write_copy_target(tmp_path_factory.mktemp("copy-target"))


def common(target, data, out, **extra):
    values = recipe_base(
        target,
        data,
        out,
        batch_size=4,
        max_length=96,
        warmup_steps=2,
        eval_every=1000,
        save_every=1000,
        heldout_fraction=0.34,
        serve_check_prompts=8,
        serve_check_new_tokens=32,
    )
    return values | extra


# kind -> (trainer module and recipe, the recipe's own keys, the saved folder); K = 3 for every kind.
KINDS = {
    "medusa": ("medusa.MedusaRecipe", dict(num_heads=3, max_steps=4, lr=1e-2), "heads"),
    "eagle": (
        "eagle.EagleRecipe",
        dict(eval_depth=3, ttt_steps=3, max_steps=30, lr=1e-2, draft_vocab_size=128),
        "head",
    ),
    "dflash": ("dflash.DFlashRecipe", dict(block_size=4, max_steps=30, lr=1e-2), "head"),
    "peagle": ("peagle.PEagleRecipe", dict(num_depths=3, max_steps=30, lr=1e-2), "head"),
    "draft": (
        "draft.DraftRecipe",
        dict(draft_init="truncate", draft_layers=1, num_draft_tokens=3, max_steps=2),
        "draft",
    ),
}


@pytest.fixture(scope="module")
def trained(copy_target, tmp_path_factory):
    """`trained(kind)` -> (summary, run folder, console output): one short run per kind, once."""
    import contextlib
    import importlib
    import io

    runs = {}

    def get(kind):
        if kind not in runs:
            (module, recipe_name), keys = KINDS[kind][0].split("."), KINDS[kind][1]
            trainer = importlib.import_module(f"draftsmith.train.{module}")
            recipe_cls = getattr(trainer, recipe_name)
            out = tmp_path_factory.mktemp(kind) / "run"
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                summary = trainer.train(recipe_cls(**common(*copy_target, out, **keys)), progress=False)
            runs[kind] = summary, out, printed.getvalue()
        return runs[kind]

    return get


@pytest.mark.parametrize("kind", ["medusa", "eagle", "dflash", "peagle", "draft"])
def test_both_figures_are_printed_and_recorded(trained, kind):
    summary, out, printed = trained(kind)
    check = summary["serve_check"]
    print(kind, {k: check[k] for k in ("tau_simulated", "tau_decoded", "ratio", "target_calls")})
    assert check["num_draft_tokens"] == 3 and check["prompts"] == 8
    assert check["ratio"] == pytest.approx(check["tau_decoded"] / check["tau_simulated"])
    assert check["agrees"] == (abs(check["ratio"] - 1) <= 0.10)
    line = f"serve check: simulated tau {check['tau_simulated']:.3f} vs decoded tau {check['tau_decoded']:.3f}"
    assert line in printed and ("WARNING: decoded tau is" in printed) == (not check["agrees"])
    assert json.loads((out / "training_summary.json").read_text())["serve_check"] == check
    logged = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["serve_check"] for r in logged if "serve_check" in r] == [check]


# Medusa heads and a truncated draft copy the target's own prediction from the start: both
# figures are high. EAGLE-3, DFlash and P-EAGLE learn it from scratch; at 30 steps they know some
# rows and not others, so the chain's mean over every position (~2.4) is far above what the decoder
# gets (~1.55): its calls crowd where chains are short. The simulated tau follows the decoder's
# walk over the same prompts and tokens, and greedy decoding along the target's own answers is
# exactly teacher forcing: measured decoded / simulated = 1.000 for every kind.
@pytest.mark.parametrize("kind", ["medusa", "eagle", "dflash", "peagle", "draft"])
def test_the_simulated_walk_serves_what_training_said(trained, kind):
    summary = trained(kind)[0]
    check, evaluation = summary["serve_check"], summary["eval"]
    served = evaluation["tau_simulated_greedy_served" if kind == "draft" else "tau_simulated_served"]
    assert check["tau_simulated"] == served and abs(check["ratio"] - 1) <= 0.02 and check["agrees"], check
    assert evaluation["tau_simulated"] == pytest.approx(served, rel=0.1)  # every held-out row and token
    if kind in ("medusa", "draft"):
        assert check["tau_simulated"] > 3.5, check  # K = 3: 4 at most, far from tau = 1
    else:  # acceptance varies along the text: the mean over positions would have warned
        assert check["tau_decoded"] < 0.8 * evaluation["tau_simulated_mean"], (check, evaluation)


def fake_run(recipe_values: dict, printed: list, logged: list):
    """What `serve_check` reads of a `TrainingRun`, to call it again on a finished run's folder."""
    recipe = types.SimpleNamespace(**recipe_values)
    return types.SimpleNamespace(
        recipe=recipe,
        is_main=True,
        device=torch.device("cpu"),
        step=0,
        print=printed.append,
        log=lambda step, record: logged.append(record),
    )


def served(copy_target, out, kind, k, monkeypatch=None, plant=None):
    """`serve_check` of the finished run in `out` decoded at K = `k`, the drafter changed by `plant`."""
    from draftsmith.distill.data import DistillData
    from draftsmith.eval import drafter_specs
    from draftsmith.heads.models import load_causal_lm
    from draftsmith.train.common import split_rows

    if plant is not None:
        build = drafter_specs.chain_drafter
        monkeypatch.setattr(drafter_specs, "chain_drafter", lambda *a, **kw: plant(build(*a, **kw)))
    target = load_causal_lm(str(copy_target[0]), device="cpu", dtype=torch.float32, role="target")
    data = DistillData(str(copy_target[1]))
    prompts = heldout_prompts(data, split_rows(len(data), 0.34)[1], 8)
    evaluation = json.loads((out / "training_summary.json").read_text())["eval"]
    printed, logged = [], []
    run = fake_run(dict(serve_check_prompts=8, serve_check_new_tokens=32, target_sharding="none"), printed, logged)
    check = serve_check(run, target, kind, out / KINDS[kind][2], prompts, k, evaluation)
    return check, "\n".join(printed), logged


def test_decoding_at_another_k_makes_the_guard_warn(copy_target, trained):
    _, out, _ = trained("medusa")
    check, printed, logged = served(copy_target, out, "medusa", k=1)
    assert not check["agrees"] and check["tau_decoded"] < 0.75 * check["tau_simulated"], check
    assert "WARNING: decoded tau is" in printed and "below the simulated one" in printed
    assert "vocab map mismatch" in printed and "chat template" in printed and "own-prediction drift" in printed
    assert logged == [{"serve_check": check}]


def test_a_shuffled_vocab_map_makes_the_guard_warn(copy_target, trained, monkeypatch):
    _, out, _ = trained("eagle")

    def shuffle(drafter):  # draft id i -> the target id of another draft id
        head = drafter.head
        ids = head.draft_to_target(torch.arange(head.d2t.numel()))
        perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
        head.d2t.copy_(ids[perm] - torch.arange(ids.numel()))
        return drafter

    check, printed, _ = served(copy_target, out, "eagle", k=3, monkeypatch=monkeypatch, plant=shuffle)
    assert not check["agrees"] and check["tau_decoded"] < 1.5, check
    assert "WARNING" in printed


def test_off_and_without_heldout_rows(copy_target, tmp_path):
    from draftsmith.train.medusa import MedusaRecipe, train

    target, data = copy_target
    off = common(target, data, tmp_path / "off", num_heads=2, max_steps=1, serve_check_prompts=0)
    assert train(MedusaRecipe(**off), progress=False)["serve_check"] == {}
    none = common(target, data, tmp_path / "none", num_heads=2, max_steps=1, heldout_fraction=0.0)
    skipped = train(MedusaRecipe(**none), progress=False)["serve_check"]
    assert skipped == {"skipped": "no held-out rows (heldout_fraction = 0)"}
    with pytest.raises(ValueError, match="serve_check_prompts = -1 must be >= 0"):
        MedusaRecipe(**common(target, data, tmp_path / "bad", serve_check_prompts=-1))


def test_the_served_walk_covers_the_serve_checks_prompts_and_tokens():
    from draftsmith.train.common import served_walk

    recipe = types.SimpleNamespace(serve_check_prompts=3, serve_check_new_tokens=6)
    starts = torch.zeros(4, 12, dtype=torch.bool)
    starts[:, 2:11] = True  # held-out rows 2..5, each a call possible at 2..10
    chains = torch.ones(4, 12, 2, dtype=torch.bool)  # K = 2, every draft right
    # Row 2 only; 6 new tokens: the decoder's full calls start at answer tokens 0 and 3 (3 tokens each)
    assert served_walk(chains, starts, 2, recipe) == (6.0, 2.0)
    assert served_walk(chains, starts, 0, recipe) == (18.0, 6.0)  # rows 0, 1 and 2
    assert served_walk(chains, starts, 3, recipe) == (0.0, 0.0)  # past the serve check's prompts
