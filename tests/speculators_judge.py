"""The speculators side of tests/test_speculators_interop.py, run by the interpreter of a venv
that holds speculators 0.9.0 (never by draftsmith's, which does not install it).

    python speculators_judge.py JOBS.json   # [{"check": [DIR, INPUTS, OUT]}, {"build": [...]}, {"train": [...]}]

One process runs every job (importing speculators costs most of a minute on a busy machine).
`check DIR INPUTS OUT`: a checkpoint judged by speculators; `build DIR VERIFIER FLAGS INPUTS
OUT`: a checkpoint built by speculators' model class; `train DATA OUT VERIFIER [TYPE]`: a real
`speculators train --speculator-type TYPE` run on CPU (eagle3 by default; its own data layout
written from the verifier's greedy continuations once per DATA, four steps, its defaults otherwise:
a `llama` draft layer for eagle3, a `qwen3` one, with per-head q/k norms, for peagle).

`check`: the config must parse as speculators' registered EAGLE-3 (or P-EAGLE) config; the weights' keys and
shapes must equal those of a model freshly built from it (less what speculators never saves);
`from_pretrained` must load them (speculators fills the embeddings and lm_head with NaN until
loaded, so finite weights mean every tensor arrived). `build`: the model the speculators trainer
starts from (the layer config of `speculators.train.cli`, of FLAGS' `draft_arch`, `llama` or `qwen3`,
by default the trainer's for the kind; `Eagle3DraftModel.from_training_args` with the variant FLAGS,
a JSON object, a reduced vocabulary, the verifier's embeddings and lm_head), its trainable tensors
moved off their init, saved with `save_pretrained`. `check`
and `build` then run speculators' own forward on INPUTS
(`hidden_states` [1, T, n*H], `input_ids` [1, T]) for two training-time-test steps and write
the draft logits of each step to OUT (`step0`, `step1`); a P-EAGLE checkpoint (speculators_model_type
`peagle`; `build` with FLAGS {"speculator_type": "peagle", ...}) runs its own packed forward instead, over
COD-sampled chains drawn from a fixed seed, and writes the logits with the chains (`logits`, `anchor`,
`depth`); a DFlash-family checkpoint (`build` with FLAGS {"speculator_type": "dflash" | "dspark" | "dflash2",
...}) runs its backbone over anchored blocks from a fixed seed and writes the slots' states and logits
(DSpark: corrected and confidence logits too; DFlash2: its selector's top-K candidates and their edge
scores, `_block_outputs`). The list of JSON reports (one per job) goes to stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.losses import resolve_loss_config
from speculators.models.dflash import DFlashDraftModel
from speculators.models.dflash2 import DFlash2DraftModel
from speculators.models.dspark import DSparkDraftModel
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.peagle import PEagleDraftModel
from speculators.models.peagle.data import generate_cod_sample_indices
from speculators.train.cli import create_transformer_layer_config

ATTENTION = "sdpa"  # the flex-attention default needs a GPU compiler; sdpa is the same maths
PEAGLE_DEPTHS, PEAGLE_SEED = 3, 11  # the packed forward's depths and the seed its COD sampling draws from
BLOCK_ANCHORS, BLOCK_SEED = 3, 13  # a DFlash-family forward's anchored blocks and the seed they are drawn from
BLOCK_MODELS = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel}


def _logits(model, inputs_file: str, out_file: str) -> None:
    inputs = load_file(inputs_file)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model.eval()(
            hidden_states=inputs["hidden_states"],
            input_ids=inputs["input_ids"],
            document_ids=torch.zeros_like(inputs["input_ids"]),
            ttt_steps=2,
        )
    hook.remove()
    save_file({f"step{i}": t.contiguous() for i, t in enumerate(captured)}, out_file)


def _peagle_logits(model, inputs_file: str, out_file: str) -> None:
    """speculators' P-EAGLE training forward with the draft logits captured; the chains it samples
    are drawn again from the same seed first (its sampler consumes the global RNG, nothing else does)."""
    inputs = load_file(inputs_file)
    ids = inputs["input_ids"]
    ones = torch.ones_like(ids, dtype=torch.float32)  # the forward's loss mask when none is given
    torch.manual_seed(PEAGLE_SEED)
    anchor, depth = generate_cod_sample_indices(seq_length=ids.shape[1], loss_mask=ones, num_depths=PEAGLE_DEPTHS)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    torch.manual_seed(PEAGLE_SEED)
    with torch.no_grad():
        model.eval()(
            hidden_states=inputs["hidden_states"],
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            verifier_last_hidden_states=torch.zeros(1, ids.shape[1], model.config.transformer_layer_config.hidden_size),
            num_depths=PEAGLE_DEPTHS,
            loss_config=resolve_loss_config("kl_div", "eager"),  # fused needs Triton
        )
    hook.remove()
    save_file({"logits": captured[0][0].contiguous(), "anchor": anchor, "depth": depth}, out_file)


def _block_outputs(model, inputs_file: str, out_file: str) -> None:
    """A DFlash-family model's (DFlash, DSpark) backbone over BLOCK_ANCHORS anchored blocks drawn from
    BLOCK_SEED (speculators' own anchor sampling), and DSpark's heads on it: the final-norm states,
    the backbone logits, the Markov-corrected logits and the confidence logits of every slot, with the
    blocks' token indices (INPUTS also holds `last` [1, T, H], the verifier's last states it reads)."""
    inputs = load_file(inputs_file)
    ids = inputs["input_ids"]
    torch.manual_seed(BLOCK_SEED)
    with torch.no_grad():
        hidden, logits, _, _, indices = model.eval()._backbone_forward(
            inputs["hidden_states"],
            ids,
            torch.ones_like(ids),
            inputs["last"],
            torch.zeros_like(ids),
            max_anchors=BLOCK_ANCHORS,
        )
        out = {"hidden": hidden[0], "logits": logits[0], "indices": indices}
        markov = getattr(model, "markov_head", None)
        if markov is not None:
            B = model.block_size
            prev = ids[0, indices].view(-1, B)  # sample_from_anchor: slot k's bias reads the token at p + k
            blocks = hidden[0].view(-1, B, hidden.shape[-1])
            e = markov.prev_embeddings(prev)
            bias = markov.block_bias(prev_token_ids=prev, hidden_states=blocks, prev_emb=e)
            out["corrected"] = (logits[0].view(-1, B, logits.shape[-1]) + bias).reshape(logits.shape[1:])
            if model.confidence_head is not None:
                with_e = model.config.confidence_head_with_markov
                out["confidence"] = model.confidence_head(torch.cat([blocks, e], -1) if with_e else blocks).reshape(-1)
        selector = getattr(model, "candidate_selector", None)
        if selector is not None:  # DFlash2: its own predecessors (the anchor, then the block's tokens) and top-K
            prev = model._predecessor_ids(ids, indices).reshape(1, -1)
            candidates = logits.topk(selector.top_k, dim=-1).indices
            out["candidates"] = candidates[0]
            out["scores"] = selector.score_candidates(logits, hidden, prev, candidates)[0]
    save_file({k: v.contiguous() for k, v in out.items()}, out_file)


def check(folder: str, inputs_file: str, out_file: str) -> dict:
    """Also for speculators' own checkpoints: loaded in float32 whatever they were saved in."""
    config = SpeculatorModelConfig.from_pretrained(folder)
    block = config.speculators_model_type in BLOCK_MODELS  # its eager attention takes the block mask on CPU
    config.transformer_layer_config._attn_implementation = "eager" if block else ATTENTION
    fresh = SpeculatorModel.registered_model_class_from_config(config)(config)
    never_saved = set(fresh._keys_to_ignore_on_save or [])
    expected = {k: list(v.shape) for k, v in fresh.state_dict().items() if k not in never_saved}
    written = {k: list(v.shape) for k, v in load_file(f"{folder}/model.safetensors").items()}
    cls = SpeculatorModel.registered_model_class_from_config(config)  # Eagle3DraftModel or PEagleDraftModel
    model = cls.from_pretrained(folder, config=config, dtype=torch.float32)
    finite = {k: bool(torch.isfinite(v.float()).all()) for k, v in model.state_dict().items()}
    forward = _block_outputs if block else _peagle_logits if isinstance(model, PEagleDraftModel) else _logits
    forward(model, inputs_file, out_file)
    return {
        "config_class": type(config).__name__,
        "model_class": type(model).__name__,
        "missing": sorted(set(expected) - set(written)),
        "unexpected": sorted(set(written) - set(expected)),
        "shape_mismatches": sorted(k for k in set(expected) & set(written) if expected[k] != written[k]),
        "not_finite": sorted(k for k, ok in finite.items() if not ok),
        "flags": {  # those of its config class
            k: getattr(config, k)
            for k in (
                "norm_before_fc",
                "fc_norm",
                "norm_output",
                "norm_before_residual",
                "embed_requires_grad",
                "target_hidden_size",
                "sample_from_anchor",
                "block_size",
                "markov_rank",
                "markov_head_type",
                "enable_confidence_head",
                "confidence_head_with_markov",
                "conv_kernel_size",
                "conv_group_size",
                "selector_rank",
                "selector_top_k",
            )
            if hasattr(config, k)
        },
        "mask_token_id": getattr(config, "mask_token_id", None),
        "layer_type": config.transformer_layer_config.model_type,  # qwen3: the layer has q/k norms
    }


def build(folder: str, verifier: str, flags: str, inputs_file: str, out_file: str) -> dict:
    flags = json.loads(flags)
    kind = flags.pop("speculator_type", "eagle3")
    cls = BLOCK_MODELS.get(kind) or (PEagleDraftModel if kind == "peagle" else Eagle3DraftModel)
    block = kind in BLOCK_MODELS
    arch = flags.pop("draft_arch", "llama" if kind == "eagle3" else "qwen3")  # the trainer's --draft-arch default
    # The trainer's own draft layer config: one layer shaped from the verifier, its defaults (EAGLE: a
    # llama or qwen3 layer, sliding-window attention over 2048 tokens, which a 12-token test never
    # reaches; the DFlash family: a qwen3 layer of full attention, the one kind draftsmith's block heads implement).
    layer_config = create_transformer_layer_config(
        verifier,
        num_layers=1,
        draft_arch=arch,
        hidden_act=None,
        sliding_window=2048,
        full_attention_indices=[0] if block else [],
    )
    V = layer_config.vocab_size
    draft_vocab = flags.pop("draft_vocab_size", V)
    target_ids = torch.arange(0, V, max(V // draft_vocab, 1))[:draft_vocab]  # a spread-out draft vocabulary
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(draft_vocab)
    # the DFlash family attends eagerly; EAGLE-3 and P-EAGLE take 3 TTT steps, the norm before the
    # residual off unless FLAGS turn it on
    if block:
        variant = dict(draft_attn_impl="eager", **flags)
    else:
        variant = dict(ttt_steps=3, draft_attn_impl=ATTENTION, **{"norm_before_residual": False, **flags})
    model = cls.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab, verifier_name_or_path=verifier, **variant
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # off the init (norms at 1, small weights), so that loading is tested
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else 0.05))
    model.save_pretrained(folder)
    if block:
        _block_outputs(model, inputs_file, out_file)
    else:
        (_peagle_logits if cls is PEagleDraftModel else _logits)(model, inputs_file, out_file)
        assert isinstance(model.config, Eagle3SpeculatorConfig)  # PEagleSpeculatorConfig is one too
    return {"saved": sorted(load_file(f"{folder}/model.safetensors"))}


def train(data: str, out: str, verifier: str, kind: str = "eagle3") -> dict:
    import speculators.train.checkpointer
    import speculators.train.trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    if not (Path(data) / "hidden_states").is_dir():  # one data folder serves every run
        _write_train_data(data, verifier)
    # On CPU: the trainer asks for a local GPU rank and device and synchronizes the accelerator.
    speculators.train.trainer.get_local_rank = lambda: "cpu"
    speculators.train.checkpointer.get_current_device = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    main(
        TrainConfig.resolve(
            [
                "--verifier-name-or-path",
                verifier,
                "--data-path",
                data,
                "--speculator-type",
                kind,
                "--save-path",
                out,
                "--target-layer-ids",
                "1",
                "2",
                "3",
                "--draft-attn-impl",
                ATTENTION,
                "--loss-implementation",
                "eager",
                "--epochs",
                "1",
                "--max-steps",
                "4",
                "--num-workers",
                "0",
                "--hidden-states-dtype",
                "float32",
                "--total-seq-len",
                "64",
                "--on-missing",
                "raise",
            ]
        )
    )
    return {"checkpoints": sorted(p.name for p in Path(out).iterdir())}


def _write_train_data(data: str, verifier: str) -> None:
    """speculators' data layout: a datasets folder (input_ids, loss_mask, seq_len) and, per row,
    hidden_states/hs_{i}.safetensors with the aux layers' states and the last layer's output BEFORE
    the final norm, [T, 4, H], and the token ids; rows are the verifier's greedy continuations."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(verifier).eval()
    (Path(data) / "hidden_states").mkdir(parents=True)
    rows, gen = {"input_ids": [], "loss_mask": [], "seq_len": []}, torch.Generator().manual_seed(0)
    for i in range(8):
        prompt = torch.randint(3, target.config.vocab_size, (1, 6), generator=gen)
        ids = target.generate(prompt, max_new_tokens=26, do_sample=False)[0]
        last = {}

        def keep(_module, _args, out, last=last):
            last["x"] = out[0] if isinstance(out, tuple) else out

        hook = target.model.layers[-1].register_forward_hook(keep)
        with torch.no_grad():
            states = target(ids[None], output_hidden_states=True).hidden_states
        hook.remove()
        stacked = torch.stack([states[k][0] for k in (1, 2, 3)] + [last["x"][0]], dim=1)
        save_file({"hidden_states": stacked.contiguous(), "token_ids": ids}, f"{data}/hidden_states/hs_{i}.safetensors")
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append([0] * 6 + [1] * (len(ids) - 6))  # the continuation is trained
        rows["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(rows)
    dataset.set_format("torch")
    dataset.save_to_disk(data)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    commands = {"check": check, "build": build, "train": train}
    print(json.dumps([commands[name](*args) for job in jobs for name, args in job.items()]))
