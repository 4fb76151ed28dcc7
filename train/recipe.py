"""Recipes: one YAML per model family and method, read into the method's typed config.

    accelerate launch train/draft.py --recipe recipes/smollm2/draft.yaml max_steps=50 lr=3e-4

The YAML names components and hyperparameters only; defaults live in the method's config
dataclass, nowhere else: `RunRecipe` holds the keys every method has (target, data, output
folder, optimisation and schedule, evaluation and checkpoint cadence, trackers, Hub push, the
device), each method's recipe extends it with its own keys (and its own defaults where a
shared key's best value differs by method). Unknown keys are errors that list the valid ones
(a typo must not silently train with a default). `key=value` overrides on the command line are parsed as YAML
values (`lr=3e-4`, `share_lm_head=true`, `lora_target_modules=[q_proj,v_proj]`).
Strings that start with `~` are expanded to the home folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TRACKERS = ("wandb", "tensorboard")


MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
TRAIN_ON = ("answers", "all")  # `train_on`: the positions a training batch's loss reads


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file, the key and what was expected."""


@dataclass(kw_only=True)
class RunRecipe:
    """Keys every method's recipe has; their checks run before the method's own."""

    target: str  # HF folder (or hub id) of the target: the model whose generations are learnt
    data: str  # a `draftsmith generate` folder: the target's own answers
    out: str  # where the result, checkpoints and metrics go
    # optimisation: AdamW, linear warm-up then cosine decay to 10% of the peak lr
    lr: float = 1e-3  # peak learning rate; each method states its own
    weight_decay: float = 0.0  # small heads fitted to one target: no regularisation needed
    warmup_steps: int = 20
    max_steps: int = 300  # budget in optimizer steps, never wall-clock: comparisons stay fair
    batch_size: int = 8  # rows per micro-batch (per process)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_length: int = 512  # rows are cut to this many tokens
    group_by_length: bool = True  # batches of rows of similar length (less padding); order still set by seed, step
    grad_clip: float = 1.0  # clip the gradient norm at this (0: no clipping)
    # evaluation, checkpoints, logging
    heldout_fraction: float = 0.05  # every 1/f-th row is held out (0 = no evaluation)
    # the positions a training batch's loss reads: "answers" (the data's loss mask: the assistant's
    # tokens) or "all" (every token after a row's first, the prompt's too: the target's own
    # distribution there, for the same compute per step). Held-out figures read the answers either way.
    train_on: str = "answers"
    eval_every: int = 100  # held-out evaluation every N optimizer steps (and at the end)
    save_every: int = 100  # checkpoint every N optimizer steps
    keep_checkpoints: int = 3  # the newest K checkpoints stay on disk (0 keeps every one)
    resume: bool | str = False  # true: the latest checkpoint in out; a path: that checkpoint
    init_from: str | None = None  # warm start, weights only: a checkpoint folder or a run folder
    log_every: int = 10
    serve_check_prompts: int = 8  # held-out prompts decoded at the end (0 = off): simulated vs decoded tau
    serve_check_new_tokens: int = 64  # tokens decoded per serve-check prompt (~16 target calls at tau 4)
    report_to: list = field(default_factory=list)  # trackers: wandb, tensorboard (metrics.jsonl always)
    tracker_project: str = "draftsmith"
    push_to_hub: bool = False  # push the result when training ends (`draftsmith push` does it later)
    hub_repo_id: str | None = None  # ORG/NAME
    hub_private: bool = False
    # where it runs
    trust_remote_code: bool = False  # run Python shipped with a hub model: only for models you trust
    allow_target_mismatch: bool = (
        False  # the data was made by another target: true only when `target` is a fine-tune of it
    )
    seed: int = 0
    device: str = "auto"  # auto: accelerate's choice (CUDA when available); cpu forces the CPU
    dtype: str = "auto"  # target dtype: auto = bf16 on CUDA, fp32 on CPU
    # the drafter's forward under autocast, its master weights and optimizer state in fp32: auto = the
    # launcher's `--mixed_precision` when it sets one, else the target dtype's (bf16/fp16; no for fp32)
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    target_sharding: str = (
        "none"  # none (whole per process), device_map (one process, several GPUs), fsdp2 or zero3 (over processes)
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):  # nan <= 0 is False: a nan would pass every check below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} = {value} must be a finite number")
        for name in (
            "max_steps",
            "batch_size",
            "grad_accum",
            "max_length",
            "eval_every",
            "save_every",
            "log_every",
            "serve_check_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr = {self.lr} must be > 0")
        for name in ("weight_decay", "warmup_steps", "grad_clip", "serve_check_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 0")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"train_on = {self.train_on!r}: expected one of {', '.join(TRAIN_ON)}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction = {self.heldout_fraction} must be in [0, 1)")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints = {self.keep_checkpoints} must be >= 0 (0 keeps every checkpoint)")
        unknown = [t for t in self.report_to if t not in TRACKERS]
        if unknown:
            raise ValueError(
                f"report_to = {self.report_to}: unknown tracker(s) {unknown}; expected a list of {', '.join(TRACKERS)}"
            )
        if self.push_to_hub and not self.hub_repo_id:
            raise ValueError("push_to_hub = true needs hub_repo_id (ORG/NAME)")
        if self.resume and self.init_from:
            raise ValueError(
                "resume and init_from exclude each other: "
                "resume continues a run, init_from starts a new one from its weights"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision = {self.mixed_precision!r}: expected one of {', '.join(MIXED_PRECISION)}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device = {self.device!r}: expected auto, cpu or cuda")
        from draftsmith.train.sharding import PARTITIONED, TARGET_SHARDINGS

        if self.target_sharding not in TARGET_SHARDINGS:
            raise ValueError(
                f"target_sharding = {self.target_sharding!r}: expected one of {', '.join(TARGET_SHARDINGS)}"
            )
        if self.target_sharding != "none" and getattr(self, "mode", None) == "medusa2":
            raise ValueError(
                f"target_sharding = {self.target_sharding} needs a frozen target: medusa2 trains LoRA on it (use none)"
            )
        if self.target_sharding in PARTITIONED and getattr(self, "draft_init", None) == "truncate":
            raise ValueError(
                f"target_sharding = {self.target_sharding} partitions the layers draft_init = truncate copies: use device_map, or draft_init checkpoint/config"
            )


@dataclass(kw_only=True)
class MaskedHeadRecipe(RunRecipe):
    """RunRecipe's keys and those of a head that drafts several tokens in one forward from mask-token
    placeholders over the target's hidden states (a one-pass head); each method adds its own."""

    mask_token_id: int | None = None  # None: the tokenizer's mask token, else a reserved unused id
    aux_layers: list | None = None  # HF hidden_states ids the head reads; None: the method's default
    draft_vocab_size: int | None = None  # reduced vocabulary from the data (None = the target's)
    vocab_map: str | None = None  # a `draftsmith vocab-map` file of this data instead
    loss: str = "soft_ce"  # divergence to the target per drafted token: any of DIVERGENCES (LK: nla, lk_hybrid)
    hidden_cache: str | None = None  # offline: a cache-hidden folder with the aux layers + last

    def __post_init__(self):
        super().__post_init__()
        from draftsmith.distill.losses import DIVERGENCES

        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id = {self.mask_token_id} must be a token id >= 0")
        if self.loss not in DIVERGENCES:
            raise ValueError(f"loss = {self.loss!r}: expected one of {', '.join(DIVERGENCES)}")
        if self.draft_vocab_size is not None and self.vocab_map:
            raise ValueError("give draft_vocab_size or vocab_map, not both")


def _expected_type(cls, name):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _check_value(cls, name: str, value, where: str):
    """Light type check against the dataclass annotation (int/float/bool/str/list/dict/None)."""
    hint = _expected_type(cls, name)
    origin = typing.get_origin(hint)
    options = (
        typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (hint,)
    )
    for option in options:
        base = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return value
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base is bool and isinstance(value, bool):
            return value
        if base is str and isinstance(value, str):
            return os.path.expanduser(value) if value.startswith("~") else value
        if base in (list, tuple) and isinstance(value, (list, tuple)):
            return list(value)
        if base is dict and isinstance(value, dict):  # a mapping of another recipe's keys (train/onpolicy.py)
            return dict(value)
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise RecipeError(f"{where}: {name} = {value!r} should be {names}")


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(text) if text.strip() else None
    return overrides


def load_recipe(config_cls, path: str | Path | None, overrides: list[str] | dict | None = None):
    """`config_cls` instance from the YAML at `path` (or none) plus overrides."""
    values: dict = {}
    where = "recipe"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise RecipeError(f"recipe {where!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {where!r} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"recipe {where!r} must be a mapping of key: value, got {type(loaded).__name__}")
        values.update(loaded or {})
    extra = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for source, mapping in ((where, values), ("command line", extra)):
        unknown = sorted(set(mapping) - fields)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, fields, n=1)
                hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
            raise RecipeError(f"{source}: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(sorted(fields))}")
    values.update(extra)
    checked = {name: _check_value(config_cls, name, value, where) for name, value in values.items()}
    try:
        return config_cls(**checked)
    except TypeError as err:  # a required key is missing
        required = [
            f.name
            for f in dataclasses.fields(config_cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in checked]
        raise RecipeError(f"{where}: missing required key(s) {', '.join(missing)} ({err})") from None
    except ValueError as err:  # checks name the key first ("lr = nan must ..."): say where it was set
        source = "command line" if any(str(err).startswith(f"{key} = ") for key in extra) else where
        raise RecipeError(f"{source}: {err}") from None


def recipe_dict(config) -> dict:
    """The resolved recipe (every default filled in), saved with checkpoints and results."""
    return dataclasses.asdict(config)


def run_info(recipe) -> dict:
    """What a run's folder records beside its outputs: the resolved recipe, the versions of the
    packages that shape the result, the git revision and the machine, so a run can be
    reproduced (or a drift explained) from its folder alone."""
    import platform
    import subprocess
    import sys
    from importlib import metadata

    versions = {}
    for package in (
        "draftsmith",
        "torch",
        "transformers",
        "accelerate",
        "peft",
        "datasets",
        "safetensors",
        "tokenizers",
    ):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    try:
        revision = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "recipe": recipe_dict(recipe),
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_revision": revision,
        "command": sys.argv,
    }
