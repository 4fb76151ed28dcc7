"""EAGLE-3 / EAGLE-3.1 / P-EAGLE interop with the real speculators 0.9.0, in its own venv
(speculators pins transformers <= 5.19 and cannot share draftsmith's environment).

Both directions, for every combination of the EAGLE-3 variant flags speculators writes
(norm_before_residual x {none, norm_before_fc, fc_norm} x norm_output x embed_requires_grad) on
either of its draft layers (`llama`; `qwen3`, whose attention has per-head q/k norms: draftsmith's
`qk_norm`), 48 in all:
- draftsmith -> speculators: each `export_eagle(.., "vllm")` parses as speculators' registered
  EAGLE-3 config with the layer type and every flag as written, has exactly the keys and shapes of
  a model speculators builds from it, loads with `from_pretrained` into finite weights, and
  speculators' forward gives draftsmith's logits at both training-time-test steps.
- speculators -> draftsmith: one checkpoint per combination built by its model class
  (`Eagle3DraftModel.from_training_args`) and saved with `save_pretrained`, and the checkpoints of
  real `speculators train` runs on CPU (four steps on the toy target's own continuations, the
  trainer's defaults, bf16: eagle3 on a llama layer with norm_before_fc, norm_output,
  norm_before_residual; peagle on a qwen3 layer, q/k norms included), load with `load_eagle`,
  give speculators' logits and decode losslessly (greedy = target-only greedy).
- P-EAGLE (speculators `peagle`) on a qwen3 layer (its trainer's), a llama one and a qwen3 one with
  variants, both directions the same way: the export parses as speculators' P-EAGLE config with
  the mask token, has the keys and shapes of a freshly built `PEagleDraftModel` (`mask_hidden`
  among them) and loads finite; speculators' packed training forward over its COD-sampled chains
  gives draftsmith's logits for the same chains; a checkpoint built by
  `PEagleDraftModel.from_training_args` loads as a `PEagleHead`, computes the same and decodes
  losslessly with the P-EAGLE drafter.
- The DFlash family (speculators `dflash`, `dspark` with its vanilla, gated and rnn sequential
  heads), both directions: each export passes the same strict check and speculators' own backbone
  forward over its own anchored blocks (eager attention on CPU) gives draftsmith's slot states and
  logits (DSpark: the Markov-corrected and confidence logits too); a checkpoint built by
  `DFlashDraftModel` / `DSparkDraftModel.from_training_args` loads, computes the same and decodes
  greedy-identical to target-only.

The venv is built once per speculators/torch version under the temp dir (about 1.5 GB; several
minutes the first time) or at $DRAFTSMITH_SPECULATORS_VENV. A failed install FAILS the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from itertools import product
from pathlib import Path

import pytest
import torch
from fixtures import speculators_blocks, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from draftsmith.decoding import generate
from draftsmith.decoding.dflash import DFlashDrafter
from draftsmith.decoding.dspark import DSparkDrafter
from draftsmith.decoding.eagle import EagleDrafter
from draftsmith.decoding.masks import additive
from draftsmith.decoding.peagle import PEagleDrafter
from draftsmith.distill.vocab import build_vocab_map
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.dflash_formats import export_dflash, load_dflash
from draftsmith.heads.dspark import DSparkHead
from draftsmith.heads.dspark_formats import export_dspark, load_dspark
from draftsmith.heads.eagle import EagleHead, PEagleHead, export_eagle, load_eagle
from draftsmith.train.eagle import shifted, ttt_mask
from draftsmith.train.peagle import chain_mask

pytestmark = pytest.mark.slow

SPECULATORS, TORCH = "0.9.0", "2.13.0"
BLOCK = 4  # DFlash-family block size
# The DFlash family: DFlash (the anchor is the bonus token) and DSpark with each sequential head.
BLOCK_HEADS = {
    "dflash": (DFlashHead, export_dflash, {}),
    **{
        f"dspark-{kind}": (DSparkHead, export_dspark, {"markov_rank": 8, "markov_head_type": kind})
        for kind in ("vanilla", "gated", "rnn")
    },
}
JUDGE = Path(__file__).with_name("speculators_judge.py")
L, VD, T = 4, 64, 12  # target layers, draft vocabulary, tokens per forward
MASK = 319  # P-EAGLE's mask token: the toy vocabulary's last id
# speculators' EAGLE-3 draft layers (its `--draft-arch`), and whether the layer has per-head q/k norms.
ARCHS = {"llama": False, "qwen3": True}
FC_NORMS = ({}, {"norm_before_fc": True}, {"fc_norm": True})  # exclusive: none, one over the concat, one per state


def _combos() -> dict:
    """Every combination of the EAGLE-3 variant flags speculators 0.9.0 supports, on either layer:
    {name: (arch, flags)}, the name the layer and the flags that are on ("llama": EAGLE-3 as trained
    by default; "llama-fc_norm-norm_output": EAGLE-3.1)."""
    combos = {}
    for arch, residual, fc, output, embed in product(ARCHS, (False, True), FC_NORMS, (False, True), (False, True)):
        flags = {"norm_before_residual": residual, "norm_before_fc": False, "fc_norm": False, **fc}
        flags |= {"norm_output": output, "embed_requires_grad": embed}
        combos["-".join([arch, *(k for k, v in flags.items() if v)])] = (arch, flags)
    return combos


COMBOS = _combos()  # 48
# P-EAGLE: the trainer's qwen3 layer, a llama one, and a qwen3 one with variants.
PEAGLE = {
    "peagle": ("qwen3", {}),
    "peagle-llama": ("llama", {}),
    "peagle-qwen3-variants": ("qwen3", {"norm_before_residual": True, "fc_norm": True, "norm_output": True}),
}
TRAINED = {"eagle3": "llama", "peagle": "qwen3"}  # real `speculators train` runs: the layer its defaults give
# speculators' requirements it needs to import and run its model (torchvision/torchaudio: unused).
NOT_NEEDED = {"torch", "torchvision", "torchaudio"}
READ_REQUIREMENTS = """
import importlib.metadata as m
for r in m.requires("speculators") or []:
    if "extra ==" not in r:
        print(r.split(";")[0].strip())
"""


def _run(cmd, what: str, timeout: int = 1800) -> str:
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {timeout} s")
    if done.returncode:
        pytest.fail(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def speculators_python() -> Path:
    """The interpreter of a venv with speculators 0.9.0 and CPU torch (built when missing)."""
    default = Path(tempfile.gettempdir()) / f"draftsmith-speculators-{SPECULATORS}-torch-{TORCH}"
    root = Path(os.environ.get("DRAFTSMITH_SPECULATORS_VENV") or default)
    python = root / "bin" / "python"
    if (root / "ready").is_file():
        return python
    shutil.rmtree(root, ignore_errors=True)  # a half-built venv from an interrupted run
    _run([sys.executable, "-m", "venv", root], "creating the speculators venv")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", f"speculators=={SPECULATORS}"], f"pip install speculators=={SPECULATORS}")
    wanted = [r for r in _run([python, "-c", READ_REQUIREMENTS], "reading speculators' metadata").split("\n") if r]
    wanted = [r for r in wanted if re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() not in NOT_NEEDED]
    _run([*pip, f"torch=={TORCH}", *wanted], f"pip install torch=={TORCH} {' '.join(wanted)}")
    (root / "ready").write_text(f"speculators=={SPECULATORS} torch=={TORCH}\n")
    return python


def draftsmith_logits(head: EagleHead, inputs: dict) -> dict:
    """The head's logits at training-time-test steps 0 and 1, as speculators' forward lays them out
    (step 1 reads step 0's output and the next tokens; positions one on: RoPE is relative)."""
    ids, n = inputs["input_ids"], inputs["input_ids"].shape[1]
    positions = torch.arange(n)[None]
    cache = DynamicCache()
    with torch.no_grad():
        out, step0 = head(ids, head.project(inputs["hidden_states"]), position_ids=positions, cache=cache)
        mask = ttt_mask(n, 1, ids.device, head.dtype)
        _, step1 = head(shifted(ids, 1), out, position_ids=positions + 1, cache=cache, attention_mask=mask)
    return {"step0": step0, "step1": step1}


def _perturbed(head, gen, trainable_only: bool = False):
    """Every tensor off its init (norms at 1), so that a dropped or misread tensor shows."""
    with torch.no_grad():
        for p_name, p in head.named_parameters():
            if p.requires_grad or not trainable_only:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in p_name else 0.05))
    return head.eval()


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """Every export and every speculators-built checkpoint, judged in ONE speculators process."""
    python = speculators_python()
    tmp = tmp_path_factory.mktemp("speculators")
    target = tiny_model("llama", layers=L)
    target.save_pretrained(tmp / "target")  # the verifier path speculators reads configs and weights from
    tiny_tokenizer().save_pretrained(tmp / "target")  # its trainer loads the verifier's tokenizer
    H = target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, T, 3 * H, generator=gen),
        "input_ids": torch.randint(3, 320, (1, T), generator=gen),
        "last": torch.randn(1, T, H, generator=gen),  # the verifier's last states (DFlash family: its teacher)
    }
    save_file(inputs, str(tmp / "inputs.safetensors"))
    vmap = build_vocab_map(torch.arange(320).flip(0) * (torch.arange(320) % 3 != 0), VD, "data-hash")
    heads, jobs, index = {}, [], {}

    def job(kind: str, name: str, *args) -> None:
        index[kind, name] = len(jobs)
        jobs.append({kind: [str(a) for a in args]})

    def judge_both(name: str, head, export, build_flags: dict, out: str = "logits") -> None:
        """`name`'s draftsmith head exported and checked; speculators' build of `build_flags` saved and run."""
        heads[name] = head
        export(head, tmp / f"export-{name}")
        job("check", name, tmp / f"export-{name}", tmp / "inputs.safetensors", tmp / f"export-{name}.{out}")
        flags = json.dumps({"target_layer_ids": [1, 2, 3], **build_flags})  # its default ids need L >= 7
        job(
            "build",
            name,
            tmp / f"built-{name}",
            tmp / "target",
            flags,
            tmp / "inputs.safetensors",
            tmp / f"built-{name}.{out}",
        )

    on_disk = {"target_name_or_path": str(tmp / "target")}
    for name, (arch, flags) in COMBOS.items():
        head = EagleHead.for_target(target, vocab_map=vmap, qk_norm=ARCHS[arch], **on_disk, **flags)
        vocab = {"draft_vocab_size": VD} if name != "llama" else {}  # speculators' default: the full vocabulary
        judge_both(
            name, _perturbed(head, gen), partial(export_eagle, format="vllm"), {"draft_arch": arch, **vocab, **flags}
        )
    # P-EAGLE: an export of draftsmith's head, and a checkpoint speculators' model class builds
    for name, (arch, flags) in PEAGLE.items():
        head = PEagleHead.for_target(
            target,
            mask_token_id=MASK,
            num_depths=3,
            vocab_map=vmap,
            aux_layer_ids=[1, 2, 3],
            qk_norm=ARCHS[arch],
            **on_disk,
            **flags,
        )
        build = {
            "speculator_type": "peagle",
            "draft_arch": arch,
            "draft_vocab_size": VD,
            "mask_token_id": MASK,
            "num_depths": 3,
        }
        judge_both(
            name,
            _perturbed(head, gen),
            partial(export_eagle, format="vllm", num_speculative_tokens=3),
            {**build, **flags},
        )
    # The DFlash family: an export of each draftsmith head, and a checkpoint speculators' model class builds
    for name, (head_class, export, variant) in BLOCK_HEADS.items():
        head = head_class.for_target(
            target, block_size=BLOCK, mask_token_id=MASK, vocab_map=vmap, aux_layer_ids=[1, 2, 3], **on_disk, **variant
        )
        kind = "dspark" if "markov_rank" in variant else "dflash"
        build = {"speculator_type": kind, "draft_vocab_size": VD, "mask_token_id": MASK, "block_size": BLOCK}
        judge_both(name, _perturbed(head, gen, trainable_only=True), export, {**build, **variant}, out="out")
    # Real `speculators train` runs with the trainer's defaults (eagle3: a llama layer; peagle: qwen3)
    for kind in TRAINED:
        job("train", kind, tmp / "train-data", tmp / f"trained-{kind}", tmp / "target", kind)
        folder = tmp / f"trained-{kind}" / "checkpoint_best"
        job("check", f"trained-{kind}", folder, tmp / "inputs.safetensors", tmp / f"trained-{kind}.logits")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    reports = json.loads(
        _run([python, JUDGE, tmp / "jobs.json"], "the speculators judge", timeout=900).splitlines()[-1]
    )
    return {
        "tmp": tmp,
        "target": target.eval(),
        "inputs": inputs,
        "heads": heads,
        "report": lambda kind, name: reports[index[kind, name]],
    }


def _clean(report: dict) -> None:
    """speculators' strict check: exactly the keys and shapes of the model it builds, all loaded finite."""
    assert (report["missing"], report["unexpected"], report["shape_mismatches"], report["not_finite"]) == (
        [],
        [],
        [],
        [],
    )


@pytest.mark.parametrize("name", COMBOS)
def test_draftsmith_exports_are_what_speculators_builds_and_computes(judged, name):
    arch, flags = COMBOS[name]
    report = judged["report"]("check", name)
    assert report["config_class"] == "Eagle3SpeculatorConfig" and report["model_class"] == "Eagle3DraftModel"
    _clean(report)
    assert report["layer_type"] == arch  # qwen3: speculators builds the q/k norms draftsmith wrote
    assert report["flags"] == {**flags, "target_hidden_size": None}  # every flag as written, none dropped
    theirs = load_file(str(judged["tmp"] / f"export-{name}.logits"))
    ours = draftsmith_logits(judged["heads"][name], judged["inputs"])
    for step in ("step0", "step1"):
        torch.testing.assert_close(theirs[step], ours[step], rtol=1e-4, atol=1e-4, msg=f"{name} {step}")


def peagle_logits(head: PEagleHead, inputs: dict, chains: dict) -> torch.Tensor:
    """The head's logits over speculators' packed chains (element (a, d) at position a + d: the
    data's token and state at depth 0, the placeholder beyond), one forward with the chain mask."""
    anchor, depth = chains["anchor"][None], chains["depth"][None]
    position = anchor + depth
    ids, states = inputs["input_ids"], inputs["hidden_states"]
    is_pair = depth == 0
    element_ids = torch.where(is_pair, ids[0, position], torch.full_like(position, head.config.mask_token_id))
    with torch.no_grad():
        hidden = torch.where(
            is_pair[..., None], head.project(states[:, position[0]]), head.mask_features(1, position.shape[1])
        )
        real = torch.ones_like(is_pair)
        mask = additive(chain_mask(anchor, depth, real, torch.ones_like(ids, dtype=torch.bool)), head.dtype)[:, None]
        _, logits = head(element_ids, hidden, position_ids=position, attention_mask=mask)
    return logits[0]


def peagle_lossless(head: PEagleHead, target) -> None:
    prompt = torch.randint(3, 320, (10,), generator=torch.Generator().manual_seed(7))
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    assert generate(target, PEagleDrafter(head), prompt, max_new_tokens=24, num_draft_tokens=3).tokens == reference


@pytest.mark.parametrize("name", PEAGLE)
def test_peagle_export_is_what_speculators_builds_and_computes(judged, name):
    report = judged["report"]("check", name)
    assert report["config_class"] == "PEagleSpeculatorConfig" and report["model_class"] == "PEagleDraftModel"
    _clean(report)
    assert report["layer_type"] == PEAGLE[name][0]
    assert report["mask_token_id"] == MASK and report["flags"]["embed_requires_grad"] is True
    theirs = load_file(str(judged["tmp"] / f"export-{name}.logits"))
    assert int(theirs["depth"].max()) == 2  # the chains reach every depth
    ours = peagle_logits(judged["heads"][name], judged["inputs"], theirs)
    torch.testing.assert_close(theirs["logits"], ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", PEAGLE)
def test_a_speculators_peagle_checkpoint_loads_computes_the_same_and_decodes_losslessly(judged, name):
    arch, flags = PEAGLE[name]
    saved = judged["report"]("build", name)["saved"]
    assert "mask_hidden" in saved and ("layers.0.self_attn.q_norm.weight" in saved) == ARCHS[arch]
    folder, target = judged["tmp"] / f"built-{name}", judged["target"]
    with pytest.warns(UserWarning, match="sliding-window attention over 2048"):
        head = load_eagle(folder, target=target)
    assert isinstance(head, PEagleHead) and head.config.mask_token_id == MASK and head.config.num_depths == 3
    assert head.config.qk_norm == ARCHS[arch] and all(getattr(head.config, k) == v for k, v in flags.items())
    assert head.config.draft_vocab_size == VD and head.embed_tokens.weight.requires_grad
    theirs = load_file(str(judged["tmp"] / f"built-{name}.logits"))
    torch.testing.assert_close(theirs["logits"], peagle_logits(head, judged["inputs"], theirs), rtol=1e-4, atol=1e-4)
    peagle_lossless(head, target)


def lossless(head, target) -> None:
    prompt = torch.randint(3, 320, (10,), generator=torch.Generator().manual_seed(7))
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    for tree in (None, {"depth": 3, "top_k": 3, "total_tokens": 8}):
        out = generate(target, EagleDrafter(head, tree=tree), prompt, max_new_tokens=24, num_draft_tokens=3)
        assert out.tokens == reference, tree


@pytest.mark.parametrize("kind", TRAINED)
def test_a_speculators_train_run_loads_computes_the_same_and_decodes_losslessly(judged, kind):
    """The issue's case among them: a peagle run's qwen3 layer carries q_norm / k_norm."""
    report = judged["report"]("check", f"trained-{kind}")  # speculators' own judgement of its checkpoint
    assert (report["missing"], report["unexpected"], report["not_finite"]) == ([], [], [])
    assert report["layer_type"] == TRAINED[kind]
    folder, target = judged["tmp"] / f"trained-{kind}" / "checkpoint_best", judged["target"]
    with pytest.warns(UserWarning, match="sliding-window attention over 2048"):
        head = load_eagle(folder, target=target, dtype=torch.float32)
    c = head.config
    assert c.qk_norm == ARCHS[TRAINED[kind]] and isinstance(head, PEagleHead) == (kind == "peagle")
    # the trainer's variant defaults: norm_before_fc and norm_output for eagle3 only
    assert (c.norm_before_fc, c.norm_output, c.fc_norm) == ((True, True, False) if kind == "eagle3" else (False,) * 3)
    assert report["flags"] == {
        **{k: getattr(c, k) for k in report["flags"] if k != "target_hidden_size"},
        "target_hidden_size": None,
    }
    theirs = load_file(str(judged["tmp"] / f"trained-{kind}.logits"))
    if kind == "peagle":
        torch.testing.assert_close(
            theirs["logits"], peagle_logits(head, judged["inputs"], theirs), rtol=1e-4, atol=1e-4
        )
        return peagle_lossless(load_eagle(folder, target=target), target)  # as saved: bf16 head, fp32 target
    ours = draftsmith_logits(head, judged["inputs"])
    for step in ("step0", "step1"):
        torch.testing.assert_close(theirs[step], ours[step], rtol=1e-4, atol=1e-4, msg=step)
    lossless(load_eagle(folder, target=target), target)  # as saved: bf16 head, fp32 target


@pytest.mark.parametrize("name", COMBOS)
def test_speculators_checkpoints_load_compute_the_same_and_decode_losslessly(judged, name):
    arch, flags = COMBOS[name]
    folder, target = judged["tmp"] / f"built-{name}", judged["target"]
    saved = judged["report"]("build", name)["saved"]
    assert "embed_tokens.weight" in saved and ("layers.0.self_attn.q_norm.weight" in saved) == ARCHS[arch]
    with pytest.warns(UserWarning, match="sliding-window attention over 2048"):  # the trainer's default layer
        head = load_eagle(folder, target=target)
    assert head.config.qk_norm == ARCHS[arch]
    for flag, value in flags.items():
        assert getattr(head.config, flag) == value, flag
    assert head.config.draft_vocab_size == (VD if name != "llama" else 320)
    assert head.embed_tokens.weight.requires_grad == flags["embed_requires_grad"]
    theirs = load_file(str(judged["tmp"] / f"built-{name}.logits"))
    ours = draftsmith_logits(head, judged["inputs"])
    for step in ("step0", "step1"):
        torch.testing.assert_close(theirs[step], ours[step], rtol=1e-4, atol=1e-4, msg=f"{name} {step}")
    lossless(head, target)


def _same_outputs(theirs: dict, ours: dict, name: str) -> None:
    assert set(ours) <= set(theirs), (name, sorted(theirs))
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key], value, rtol=1e-4, atol=1e-4, msg=f"{name} {key}")


@pytest.mark.parametrize("name", BLOCK_HEADS)
def test_block_exports_are_what_speculators_builds_and_computes(judged, name):
    """DFlash and DSpark exports: speculators' strict config and key check, and its own forward over
    its own anchored blocks gives draftsmith's states, logits (DSpark: corrected and confidence)."""
    report = judged["report"]("check", name)
    dspark = name.startswith("dspark")
    assert report["config_class"] == ("DSparkSpeculatorConfig" if dspark else "DFlashSpeculatorConfig")
    _clean(report)
    assert report["mask_token_id"] == MASK and report["flags"]["sample_from_anchor"] is dspark
    assert report["flags"]["block_size"] == BLOCK
    if dspark:
        assert report["flags"]["markov_head_type"] == BLOCK_HEADS[name][2]["markov_head_type"]
    theirs = load_file(str(judged["tmp"] / f"export-{name}.out"))
    _same_outputs(theirs, speculators_blocks(judged["heads"][name], judged["inputs"], theirs["indices"]), name)


@pytest.mark.parametrize("name", BLOCK_HEADS)
def test_speculators_block_checkpoints_load_compute_the_same_and_decode_losslessly(judged, name):
    """Checkpoints speculators' DFlash / DSpark classes build and save load into draftsmith, compute
    speculators' outputs and decode greedy-identical to target-only."""
    folder, target = judged["tmp"] / f"built-{name}", judged["target"]
    dspark = name.startswith("dspark")
    head = (load_dspark if dspark else load_dflash)(folder, target=target)
    assert isinstance(head, DSparkHead if dspark else DFlashHead) and head.config.draft_vocab_size == VD
    theirs = load_file(str(judged["tmp"] / f"built-{name}.out"))
    _same_outputs(theirs, speculators_blocks(head, judged["inputs"], theirs["indices"]), name)
    prompt = torch.randint(3, 320, (10,), generator=torch.Generator().manual_seed(7))
    reference = generate(target, None, prompt, max_new_tokens=24).tokens
    drafter = DSparkDrafter(head) if dspark else DFlashDrafter(head)
    assert generate(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=BLOCK).tokens == reference
