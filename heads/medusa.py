"""Medusa heads: extra output heads that read the target's last hidden state.

    heads = MedusaHeads.for_target(target, num_heads=4)       # every head == target's lm_head at init
    logits = heads(hidden)                                     # [num_heads, ..., V]
    save_medusa(heads, "out/heads")                            # draftsmith layout (save_pretrained)
    export_medusa(heads, "out/heads-vllm", "vllm")             # or "medusa" (FasterDecoding, TGI)
    export_folder("out/heads", "out/heads-vllm", "vllm", num_speculative_tokens=3)  # from a folder
    heads = load_medusa("out/heads-vllm", target=target)       # any of the three layouts

The target's lm_head maps h_t, its last hidden state AFTER the final norm (HF's
`hidden_states[-1]`), to token t+1. Medusa head k (0-based) maps the same h_t to token t+2+k:
the token k+1 positions past the next one. Each head is

    (ResBlock)^L -> Linear(H, V, bias=False),      ResBlock(x) = x + SiLU(W x + b)

with W and b zero-initialised, so a block starts as the identity and, its projection being a
copy of the target's lm_head, every head starts out predicting what the target predicts for
t+1 (a useful prior: neighbouring tokens are correlated).

- Medusa-1: the target is frozen and only the heads train; decoding stays lossless.
- Medusa-2: the backbone trains jointly with the heads (LoRA); heads get better, but the
  verifier is no longer the original target.

Layouts (`load_medusa` tells them apart by config.json):
- draftsmith (`save_medusa`): `save_pretrained` of `MedusaHeads`: config.json with
  `model_type: draftsmith_medusa` and the provenance, model.safetensors with
  `blocks.{h}.{l}.linear.{weight,bias}` and `lm_heads.{h}.weight` (absent with share_lm_head).
- "medusa" (FasterDecoding/Medusa, also read by TGI and TensorRT-LLM): config.json with
  `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`; medusa_lm_head.safetensors
  with `{h}.{l}.linear.{weight,bias}` for l < L and the projection as `{h}.{L}.weight`.
- "vllm" (vLLM's `MedusaModel`): config.json with `model_type: medusa`, `num_heads`,
  `num_hidden_layers` (= blocks per head) and the fields below; model.safetensors with
  `blocks.{h}.layers.{l}.{weight,bias}` and `lm_heads.{h}.weight`.

A reduced draft vocabulary (`draft_vocab_size` < vocab_size; buffers `d2t`/`t2d`, `heads.vocab_map`):
projections [Vd, H]; `forward` places the logits in the target vocabulary, -inf elsewhere; vLLM's layout
holds it as `truncated_vocab_size` and a `token_map` [Vd] of target ids, FasterDecoding's cannot.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from draftsmith.heads.artifacts import has_model_type, load_pretrained, read_config, read_weights, write_folder_atomic
from draftsmith.heads.layers import check_vocab_map, draft_to_target_logits, target_provenance

EXPORT_FORMATS = ("medusa", "vllm")
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
VLLM_WEIGHTS = "model.safetensors"
# Provenance travels inside one nested dict in the exported configs: both servers ignore the
# key, and nesting keeps it away from vLLM's `MedusaConfig.from_pretrained`, which renames EVERY
# top-level key containing "num" and "heads"/"layers" to num_heads/num_hidden_layers (a
# top-level `target_num_layers` would silently overwrite the head depth).
PROVENANCE_KEY = "draftsmith"
# MedusaConfig's provenance fields (None when not given): the target's name, revision, fingerprint
# (draftsmith.heads.models.target_fingerprint) and depth, the training data's hash, and the measured
# top-k accuracy of each head, [head][rank] (what the tree builder reads).
_PROVENANCE_FIELDS = (
    "target_name_or_path",
    "target_revision",
    "target_fingerprint",
    "target_num_layers",
    "data_hash",
    "head_accuracies",
)


class MedusaError(ValueError):
    """Heads that cannot be built, loaded, exported or used with a target; the message says why."""


class MedusaConfig(PretrainedConfig):
    model_type = "draftsmith_medusa"

    def __init__(
        self,
        num_heads: int = 4,  # Medusa's default; head k is right ~0.6 * 0.8^k of the time, deeper heads rarely pay
        num_layers: int = 1,  # ResBlocks per head (Medusa: 1)
        hidden_size: int = 4096,
        vocab_size: int = 32000,
        share_lm_head: bool = False,  # True: every head projects with the target's frozen lm_head (saves K*V*H params)
        draft_vocab_size: int | None = None,  # < vocab_size: the projections' rows (a vocab map); None = vocab_size
        **kwargs,  # the provenance (_PROVENANCE_FIELDS), then PretrainedConfig's
    ):
        if num_heads < 1 or num_layers < 0:
            raise MedusaError(
                f"MedusaConfig: num_heads={num_heads}, num_layers={num_layers}; expected num_heads >= 1, num_layers >= 0"
            )
        draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        if not 0 < draft_vocab_size <= vocab_size or (share_lm_head and draft_vocab_size < vocab_size):
            raise MedusaError(
                f"MedusaConfig: draft_vocab_size={draft_vocab_size} with vocab_size={vocab_size}, share_lm_head="
                f"{share_lm_head}; expected 1..vocab_size, and the whole vocabulary with a shared lm_head"
            )
        for name in _PROVENANCE_FIELDS:
            setattr(self, name, kwargs.pop(name, None))
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.share_lm_head = share_lm_head
        self.draft_vocab_size = draft_vocab_size
        super().__init__(**kwargs)

    @property
    def reduced(self) -> bool:
        return self.draft_vocab_size < self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: the identity at init."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(PreTrainedModel):
    """`num_heads` Medusa heads over a target's last (post-norm) hidden state."""

    config_class = MedusaConfig
    base_model_prefix = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        # One module per layer. The original Medusa built `nn.Sequential(*[ResBlock(H)] * L)`,
        # which repeats ONE module L times: for L > 1 its layers silently share weights (and
        # its loader keeps only the last layer's tensors). Here each layer is its own module.
        self.blocks = nn.ModuleList(
            nn.ModuleList(ResBlock(H) for _ in range(config.num_layers)) for _ in range(config.num_heads)
        )
        if not config.share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(H, Vd, bias=False) for _ in range(config.num_heads))
        if config.reduced:  # draft id i is target id i + d2t[i]; t2d marks the draft tokens (heads.vocab_map)
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        # With share_lm_head the target's lm_head is borrowed, never owned: a plain tensor
        # attribute (see `attach_lm_head`), so it is neither saved, nor trained, nor seen by an
        # optimizer, DDP or `parameters()`. `_apply` below moves it with `.to()`.
        self._shared_lm_head: torch.Tensor | None = None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ResBlock):
            init.zeros_(module.linear.weight)
            init.zeros_(module.linear.bias)
        elif isinstance(module, nn.Linear) and module.out_features == self.config.draft_vocab_size:
            init.normal_(module.weight, mean=0.0, std=0.02)  # only without a target; for_target copies its lm_head

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self._shared_lm_head is not None:
            self._shared_lm_head = fn(self._shared_lm_head)
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = False,
        *,
        target_name_or_path: str | None = None,
        data_hash: str | None = None,
        dtype: torch.dtype | None = None,
        vocab_map=None,
    ) -> MedusaHeads:
        """Heads sized for `target`, on its device, each projection a trainable copy of its lm_head
        (its `vocab_map`'s rows only, a `heads.vocab_map.VocabMap`; or, with `share_lm_head`, the
        frozen lm_head itself)."""
        lm_weight = _output_weight(target)
        H, V = target.config.get_text_config().hidden_size, lm_weight.shape[0]
        if lm_weight.shape[1] != H:
            raise MedusaError(
                f"target's output embeddings are {tuple(lm_weight.shape)}, but its config says hidden_size={H}"
            )
        if vocab_map is not None:
            check_vocab_map(vocab_map, V, MedusaError)
        config = MedusaConfig(
            num_heads=num_heads,
            num_layers=num_layers,
            hidden_size=H,
            vocab_size=V,
            share_lm_head=share_lm_head,
            draft_vocab_size=None if vocab_map is None else vocab_map.draft_vocab_size,
            **target_provenance(target, target_name_or_path, data_hash),
        )
        heads = cls(config).to(device=lm_weight.device, dtype=dtype or lm_weight.dtype)
        with torch.no_grad():
            if config.reduced:
                heads.d2t.copy_(vocab_map.d2t), heads.t2d.copy_(vocab_map.t2d)
                lm_weight = lm_weight[heads.draft_ids().to(lm_weight.device)]
            for h in range(num_heads):
                for block in heads.blocks[h]:
                    block.reset_parameters()
                if not share_lm_head:
                    heads.lm_heads[h].weight.copy_(lm_weight)
        if share_lm_head:
            heads.attach_lm_head(lm_weight)
        return heads

    def attach_lm_head(self, weight: torch.Tensor) -> None:
        """Borrow the target's lm_head weight [V, H] for share_lm_head heads (after from_pretrained)."""
        if not self.config.share_lm_head:
            raise MedusaError("attach_lm_head: these heads own their lm_heads (share_lm_head=False); nothing to attach")
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise MedusaError(
                f"attach_lm_head: weight has shape {tuple(weight.shape)}, expected [vocab, hidden] = {list(expected)}"
            )
        self._shared_lm_head = weight.detach()

    # ------------------------------------------------------------------ computation
    def head_hidden(self, hidden: torch.Tensor, num_heads: int | None = None) -> list[torch.Tensor]:
        """Per head (the first `num_heads`; None = all): `hidden` [..., H] through that head's
        blocks (before the projection)."""
        outputs = []
        for blocks in self.blocks[:num_heads]:
            x = hidden
            for block in blocks:
                x = block(x)
            outputs.append(x)
        return outputs

    def draft_ids(self) -> torch.Tensor:
        """[Vd] long: the target id of each projection row (arange(V) without a reduced vocabulary)."""
        if not self.config.reduced:
            return torch.arange(self.config.vocab_size, device=self.device)
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def lm_head_weight(self, h: int) -> torch.Tensor:
        """Head h's projection [Vd, H]: its own, or the attached target lm_head."""
        if not self.config.share_lm_head:
            return self.lm_heads[h].weight
        if self._shared_lm_head is None:
            raise MedusaError(
                "these Medusa heads share the target's lm_head, which is not attached: call "
                "heads.attach_lm_head(target.get_output_embeddings().weight) or load them with "
                "load_medusa(path, target=target)"
            )
        return self._shared_lm_head

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [num_heads, ..., V] from the target's last post-norm hidden state [..., H] (a reduced
        vocabulary's placed in the target's, -inf elsewhere); `num_heads` < config.num_heads runs the
        first heads only (a shorter proposal)."""
        logits = []
        for h, x in enumerate(self.head_hidden(hidden_states, num_heads)):
            weight = self.lm_head_weight(h)
            logits.append(F.linear(x, weight.to(dtype=x.dtype, device=x.device)))  # no-op unless the dtypes differ
        logits = torch.stack(logits)  # [num_heads, ..., Vd]
        return draft_to_target_logits(logits, self.d2t, self.config.vocab_size) if self.config.reduced else logits

    def check_target(self, target: PreTrainedModel) -> None:
        """MedusaError when the sizes differ. Whether the heads were trained on this very target
        (the fingerprint) is `heads.provenance`'s check, which `draftsmith eval` runs."""
        name = getattr(target.config, "_name_or_path", None) or type(target).__name__
        trained_on = self.config.target_name_or_path or "an unrecorded target"
        hidden = target.config.get_text_config().hidden_size
        vocab = _output_weight(target).shape[0]
        if hidden != self.config.hidden_size:
            raise MedusaError(
                f"Medusa heads have hidden size {self.config.hidden_size} (trained on {trained_on}) "
                f"but target {name!r} has hidden size {hidden}"
            )
        if vocab != self.config.vocab_size:
            raise MedusaError(
                f"Medusa heads have vocab size {self.config.vocab_size} (trained on {trained_on}) "
                f"but target {name!r} outputs {vocab} logits"
            )


def _output_weight(target: PreTrainedModel) -> torch.Tensor:
    out = target.get_output_embeddings()  # lm_head, or embed_out (gpt_neox), ...
    if out is None:
        raise MedusaError(f"target {type(target).__name__} has no output embeddings (get_output_embeddings() is None)")
    return out.weight


# ---------------------------------------------------------------------- key layouts
# internal name (MedusaHeads.state_dict with own lm_heads) -> name in an exported layout.
# "medusa": FasterDecoding/Medusa medusa_model.py, `medusa_head = ModuleList([Sequential(
#   *[ResBlock]*L, Linear(H, V, bias=False))])`, ResBlock holds `self.linear`.
# "vllm": vllm/model_executor/models/medusa.py, `Medusa.blocks = ModuleList([ResidualBlock])`,
#   ResidualBlock holds `self.layers = ModuleList([Linear(H, H, bias=config.medusa_fc_bias)])`,
#   `Medusa.lm_heads = ModuleList([ParallelLMHead])`; load_weights strips "medusa_heads.".
def _key_map(num_heads: int, num_layers: int, fmt: str) -> dict[str, str]:
    keys = {}
    for h in range(num_heads):
        for l in range(num_layers):
            for p in ("weight", "bias"):
                keys[f"blocks.{h}.{l}.linear.{p}"] = (
                    f"{h}.{l}.linear.{p}" if fmt == "medusa" else f"blocks.{h}.layers.{l}.{p}"
                )
        keys[f"lm_heads.{h}.weight"] = f"{h}.{num_layers}.weight" if fmt == "medusa" else f"lm_heads.{h}.weight"
    return keys


def _provenance(config: MedusaConfig) -> dict:
    return {field: getattr(config, field) for field in _PROVENANCE_FIELDS}


def _dtype_name(heads: MedusaHeads) -> str:
    return str(heads.dtype).removeprefix("torch.")


def _medusa_config(heads: MedusaHeads) -> dict:
    c = heads.config
    return {
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": c.target_name_or_path,  # FasterDecoding loads the target from here
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "torch_dtype": _dtype_name(heads),
        PROVENANCE_KEY: _provenance(c),  # ignored by FasterDecoding and TGI
    }


def _vllm_config(heads: MedusaHeads) -> dict:
    # Every field vLLM reads, written explicitly (checked against
    # vllm/transformers_utils/configs/medusa.py `MedusaConfig.__init__` and the getattr()s in
    # vllm/model_executor/models/medusa.py).
    c = heads.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,  # ResBlocks per head, not the target's depth
        "max_paths": 64,  # vLLM's default; unused by V1, which drafts top-1 per head (no tree)
        "topk": 10,  # vLLM's default; unused likewise
        "truncated_vocab_size": c.draft_vocab_size,  # < vocab_size: the weights' `token_map` [Vd] of target ids
        # vLLM's Linear has bias=getattr(config, "medusa_fc_bias", False): without this flag
        # the trained biases are silently dropped by its loader (not in params_dict).
        "medusa_fc_bias": True,
        "original_lm_head": False,  # one lm_head per head (shared heads are written out per head)
        "logit_scale": 1.0,
        "torch_dtype": _dtype_name(heads),
        "dtype": _dtype_name(heads),  # transformers 5 spelling of torch_dtype
        PROVENANCE_KEY: _provenance(c),  # ignored by vLLM (kept as an unused config attribute)
    }


# ---------------------------------------------------------------------- writing
def _write_atomic(out_dir, write, *, overwrite: bool, may_replace=None) -> Path:
    return write_folder_atomic(out_dir, write, overwrite=overwrite, may_replace=may_replace, error=MedusaError)


def _is_draftsmith_medusa(folder: Path) -> bool:
    return has_model_type(folder, MedusaConfig.model_type)


def save_medusa(heads: MedusaHeads, out_dir, *, overwrite: bool = False) -> Path:
    """Draftsmith layout (`save_pretrained`, safetensors), written atomically. An existing folder
    is replaced when it holds draftsmith Medusa heads (re-running a training), anything else
    only with `overwrite`."""
    return _write_atomic(
        out_dir,
        lambda tmp: heads.save_pretrained(tmp, safe_serialization=True),
        overwrite=overwrite,
        may_replace=_is_draftsmith_medusa,
    )


def export_medusa(heads: MedusaHeads, out_dir, format: str, *, overwrite: bool = False) -> Path:
    """Write `heads` in a server's layout: "medusa" (FasterDecoding/Medusa, TGI) or "vllm".

    With num_layers > 1 the "medusa" files hold every layer, as TGI reads them; FasterDecoding's
    own loader, whose layers are one shared module, would keep only the last layer."""
    if format not in EXPORT_FORMATS:
        raise MedusaError(f"export format {format!r}: expected one of {', '.join(map(repr, EXPORT_FORMATS))}")
    c = heads.config
    if c.reduced and format == "medusa":
        raise MedusaError(
            f"these heads draft over {c.draft_vocab_size} of {c.vocab_size} tokens, and FasterDecoding's layout has no "
            "token map: export them as 'vllm' (truncated_vocab_size and token_map) or 'hf'"
        )
    if c.share_lm_head and heads._shared_lm_head is None:
        raise MedusaError(
            f"exporting to {format!r} writes the target's lm_head into every head, but it is not attached: "
            "call heads.attach_lm_head(target.get_output_embeddings().weight) or load_medusa(path, target=target)"
        )
    own = heads.state_dict()
    state = {}
    for internal, external in _key_map(c.num_heads, c.num_layers, format).items():
        if internal.startswith("lm_heads.") and c.share_lm_head:
            # Neither format can share a projection, so each head gets its own copy
            # (safetensors also refuses one tensor under several names).
            tensor = heads.lm_head_weight(int(internal.split(".")[1])).to(heads.dtype).clone()
        else:
            tensor = own[internal]
        state[external] = tensor.detach().to("cpu").contiguous()
    if c.reduced:
        state["token_map"] = heads.draft_ids().to("cpu")  # vLLM: logits[..., token_map] = the heads' [..., Vd]
    if format == "medusa":
        config, weights = _medusa_config(heads), MEDUSA_WEIGHTS
    else:
        config, weights = _vllm_config(heads), VLLM_WEIGHTS

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / weights), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return _write_atomic(out_dir, write, overwrite=overwrite)


def export_folder(folder, out, fmt: str, *, num_speculative_tokens: int, target=None) -> Path:
    """The registry's exporter: the heads of `folder` (any of the three layouts) written to `out`
    as `fmt` ("vllm", "medusa", or "hf" = the draftsmith layout, saved as it is). `target` is a
    zero-argument callable loading the target, called only for heads that share its lm_head in a
    server layout (which holds a copy per head). vLLM drafts one token per head, so
    `num_speculative_tokens` is not written anywhere."""
    heads = load_medusa(folder)
    if fmt == "hf":
        return save_medusa(heads, out)
    if heads.config.share_lm_head:
        if target is None:
            raise MedusaError(
                f"{str(folder)!r}: these heads share the target's lm_head, and the {fmt!r} layout holds a copy per "
                "head: give the target (--target), or export with format 'hf'"
            )
        heads = load_medusa(folder, target=target())
    return export_medusa(heads, out, fmt)


# ---------------------------------------------------------------------- loading
def load_medusa(
    path, *, target: PreTrainedModel | None = None, device=None, dtype: torch.dtype | None = None
) -> MedusaHeads:
    """Heads from a draftsmith, "medusa" or "vllm" folder (detected from config.json). With
    `target`: sizes checked and, for share_lm_head, its lm_head attached."""
    path, raw = read_config(path, "Medusa heads", MedusaError)
    if raw.get("model_type") == MedusaConfig.model_type:
        heads = load_pretrained(MedusaHeads, path, "Medusa heads", MedusaError, dtype)
    elif raw.get("model_type") == "medusa" or "MedusaModel" in (raw.get("architectures") or []):
        heads = _load_vllm(path, raw)
    elif "medusa_num_heads" in raw:
        heads = _load_original(path, raw)
    else:
        raise MedusaError(
            f"{str(path / 'config.json')!r} is not a Medusa config (model_type={raw.get('model_type')!r}): expected "
            f"model_type {MedusaConfig.model_type!r} (draftsmith), 'medusa' (vLLM) or a 'medusa_num_heads' key (FasterDecoding)"
        )
    if dtype is not None or device is not None:
        heads = heads.to(device=device, dtype=dtype)
    if target is not None:
        heads.check_target(target)
        if heads.config.share_lm_head:
            heads.attach_lm_head(_output_weight(target))
    return heads.eval()


def _load_original(path: Path, raw: dict) -> MedusaHeads:
    file = path / MEDUSA_WEIGHTS
    if not file.is_file() and (path / "medusa_lm_head.pt").is_file():
        raise MedusaError(f"{str(path)!r} holds medusa_lm_head.pt (pickle); convert it to {MEDUSA_WEIGHTS} first")
    state = read_weights(file, "Medusa weights", MedusaError)
    num_heads, num_layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
    # Hub configs often omit the sizes: read them off head 0's projection [V, H].
    proj = state.get(f"0.{num_layers}.weight")
    if proj is None:
        raise MedusaError(
            f"{str(file)!r} has no key '0.{num_layers}.weight' (head 0's projection for medusa_num_layers={num_layers})"
        )
    return _from_state(path, file, raw, state, "medusa", num_heads, num_layers, *proj.shape)


def _load_vllm(path: Path, raw: dict) -> MedusaHeads:
    file = path / VLLM_WEIGHTS
    state = {k.removeprefix("medusa_heads."): v for k, v in read_weights(file, "Medusa weights", MedusaError).items()}
    # vLLM's MedusaConfig.from_pretrained accepts any top-level "*num*heads*" / "*num*layers*" key
    # (e.g. medusa_num_heads) as num_heads / num_hidden_layers; accept what it accepts.
    for key in list(raw):
        if "num" in key and "heads" in key:
            raw["num_heads"] = raw.pop(key)
        elif "num" in key and "layers" in key:
            raw["num_hidden_layers"] = raw.pop(key)
    if "num_heads" not in raw:
        raise MedusaError(f"{str(path / 'config.json')!r} (vLLM Medusa) has no num_heads")
    num_heads, num_layers = int(raw["num_heads"]), int(raw.get("num_hidden_layers", 1))
    if "lm_heads.0.weight" not in state:
        raise MedusaError(f"{str(file)!r} has no key 'lm_heads.0.weight' (head 0's projection)")
    rows, hidden = state["lm_heads.0.weight"].shape
    vocab, token_map = int(raw.get("vocab_size") or rows), state.pop("token_map", None)
    if int(raw.get("truncated_vocab_size") or vocab) < vocab:  # as vLLM: a token map, else none (ignored)
        truncated = int(raw["truncated_vocab_size"])
        token_map = None if token_map is None else token_map.long()
        if token_map is None or tuple(token_map.shape) != (truncated,) or token_map.unique().numel() != truncated:
            raise MedusaError(
                f"{str(file)!r}: truncated_vocab_size={truncated} < vocab_size={vocab} needs a token_map of "
                f"{truncated} distinct target ids, found {None if token_map is None else list(token_map.shape)}"
            )
        if int(token_map.min()) < 0 or int(token_map.max()) >= vocab:
            raise MedusaError(f"{str(file)!r}: token_map holds ids outside the vocabulary 0..{vocab - 1}")
        for key in [k for k in state if k.startswith("lm_heads.") and state[k].shape[0] == vocab > truncated]:
            state[key] = state[key][token_map]  # full-vocabulary rows: vLLM keeps the token map's
    else:
        token_map, vocab = None, rows  # the weights' size, checked against config.json's below
    if raw.get("original_lm_head", False) and "lm_heads.0.weight" in state:  # one projection for all heads
        for h in range(1, num_heads):
            state.setdefault(f"lm_heads.{h}.weight", state["lm_heads.0.weight"].clone())  # own copies, not tied
    if not raw.get("medusa_fc_bias", False):
        # vLLM builds these Linears without bias and its loader skips bias tensors: mirror that.
        dropped = [k for k in state if k.startswith("blocks.") and k.endswith(".bias")]
        if dropped:
            warnings.warn(
                f"{str(path)!r}: medusa_fc_bias is false, so vLLM ignores the {len(dropped)} bias tensors; dropped them too",
                stacklevel=3,
            )
        state = {k: v for k, v in state.items() if k not in dropped}
        for key in [k for k in state if k.startswith("blocks.") and k.endswith(".weight")]:
            state[key.removesuffix("weight") + "bias"] = torch.zeros(hidden, dtype=state[key].dtype)
    return _from_state(path, file, raw, state, "vllm", num_heads, num_layers, vocab, hidden, token_map)


def _from_state(path, file, raw, state, fmt, num_heads, num_layers, vocab, hidden, token_map=None) -> MedusaHeads:
    """Heads of `state` in layout `fmt`; `token_map` [Vd]: the target id of each projection row."""
    for key, expected in (("hidden_size", hidden), ("vocab_size", vocab)):
        if raw.get(key) not in (None, expected):
            raise MedusaError(f"{str(path)!r}: config.json says {key}={raw[key]} but the weights have {expected}")
    keys = _key_map(num_heads, num_layers, fmt)
    missing = sorted(set(keys.values()) - set(state))
    unexpected = sorted(set(state) - set(keys.values()))
    if missing or unexpected:
        raise MedusaError(
            f"{str(file)!r} does not match its config ({num_heads} heads x {num_layers} layers): "
            f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}"
        )
    provenance = raw.get(PROVENANCE_KEY) or {}
    if fmt == "medusa" and not provenance.get("target_name_or_path"):
        provenance = {**provenance, "target_name_or_path": raw.get("base_model_name_or_path")}
    config = MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        share_lm_head=False,
        draft_vocab_size=None if token_map is None else token_map.numel(),
        **{k: provenance.get(k) for k in _PROVENANCE_FIELDS},
    )
    with torch.device("meta"):  # no random init of K x V x H weights that are overwritten at once
        heads = MedusaHeads(config)
    weights = {internal: state[external] for internal, external in keys.items()}
    if token_map is not None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[token_map] = True
        weights |= {"d2t": token_map - torch.arange(token_map.numel()), "t2d": t2d}
    try:
        heads.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:  # shape mismatches
        raise MedusaError(f"cannot load {str(file)!r}: {err}") from None
    return heads


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load Medusa heads (`publish.serve` writes the commands): vLLM reads its own
    layout (method "medusa"), the others are exported to it first (with the target when the heads
    share its lm_head); SGLang has no Medusa drafter."""
    own = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else config
    if config.get("model_type") == "medusa":
        layout, vllm = "Medusa heads in vLLM's layout", {"method": "medusa"}
    else:
        layout = "FasterDecoding's layout" if "medusa_num_heads" in config else "the draftsmith layout"
        layout = f"Medusa heads in {layout}"
        vllm = {"method": "medusa", "export": True, "export_target": bool(own.get("share_lm_head"))}
    notes = ["SGLang has no Medusa drafter"]
    if setting.get("tree"):
        notes.append(
            "vLLM drafts the heads' top-1 chain; the tuned tree is for `draftsmith eval --drafter medusa=DIR "
            "--medusa-tree`"
        )
    return {"layout": layout, "vllm": vllm, "notes": notes}
