"""Loading targets and drafts from local folders, and checking that their vocabularies agree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith.heads.artifacts import check_safetensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class ModelLoadError(ValueError):
    """A model or tokenizer folder that cannot be used; the message says which and why."""


def resolve_device(name: str | None) -> torch.device:
    """`None`/"auto" -> CUDA when available, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ModelLoadError(f"--device {name!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: CUDA is not available on this machine")
    return device


def native_bf16(device: torch.device) -> bool:
    """True where bf16 matrix products run in hardware: CUDA, and CPUs with AVX512-BF16 or AMX.
    There a batch-1 forward streams half the bytes of fp32, and a verify of K + 1 tokens costs
    about one single-token step (fp32 GEMM at M = 2..8 costs 1.4-1.8 of M = 1 on such a CPU);
    elsewhere bf16 is emulated and slower than fp32."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in probes)


def resolve_dtype(name: str | None, device: torch.device, *, native: str = "cuda") -> torch.dtype:
    """`None`/"auto" -> bfloat16 on CUDA, float32 elsewhere; with `native="any"`, bfloat16 wherever it
    is native (`native_bf16`: CUDA, CPUs with AVX512-BF16 or AMX; the demo's choice)."""
    if name in (None, "auto"):
        bf16 = native_bf16(device) if native == "any" else device.type == "cuda"
        return torch.bfloat16 if bf16 else torch.float32
    return parse_dtype(name)


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    """A dtype name or its short alias (bf16, fp16, fp32)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ModelLoadError(f"{flag} {name!r}: expected one of auto, {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return DTYPES[name]


def is_hub_id(text: str) -> bool:
    """ "org/name" (or "name") that is not a local path: loaded from the Hugging Face Hub."""
    text = str(text)
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in text.split("/"))


def _check_folder(path: str | Path, role: str) -> Path | str:
    if is_hub_id(str(path)):
        return str(path)  # from_pretrained fetches it (or finds it in the local HF cache)
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{role} folder {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{role} folder {str(path)!r} has no config.json (save it with save_pretrained)")
    return path


def load_causal_lm(
    path: str | Path,
    *,
    device: torch.device | None,
    dtype: torch.dtype,
    role: str = "model",
    trust_remote_code: bool = False,
    device_map: dict | None = None,
) -> PreTrainedModel:
    """An unmodified HF causal LM in eval mode. Python shipped with a hub model runs only with
    `trust_remote_code=True` (off by default: a recipe must ask for it). With `device_map`
    (module name -> device, accelerate's big-model loading) it is spread over those devices."""
    path = _check_folder(path, role)
    if isinstance(path, Path):
        check_safetensors(path, role, ModelLoadError)  # a truncated file names itself, not a loader traceback
    try:
        placed = {"device_map": device_map} if device_map is not None else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **placed)
    except (OSError, ValueError) as err:
        where = "the Hugging Face Hub (or the local HF cache)" if isinstance(path, str) else "its folder"
        raise ModelLoadError(f"cannot load the {role} {str(path)!r} from {where}: {err}") from None
    return (model if device_map is not None else model.to(device)).eval()


def load_tokenizer(path: str | Path, role: str = "model", trust_remote_code: bool = False):
    """The folder's (or hub id's) tokenizer, or None when it has none."""
    path = str(path) if is_hub_id(str(path)) else Path(path).expanduser()
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None


def output_vocab_size(path: str | Path, role: str) -> int:
    path = _check_folder(path, role)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"{role} {str(path)!r} is neither a local folder nor a model on the Hugging Face Hub (or in the local "
            f"HF cache): check the path ({str(err).splitlines()[0]})"
        ) from None
    return config.get_text_config().vocab_size


def check_vocab_compatible(
    target_dir: str | Path, draft_dir: str | Path, target_tokenizer=None, draft_tokenizer=None
) -> None:
    """A draft must speak the target's vocabulary: same token strings for the same ids.

    The logit dimensions may differ by padding (e.g. a 0.5B and a 7B model of one family pad
    their embedding matrices differently) as long as both tokenizers are identical and fit in
    both; the drafter then aligns its logits. Without a draft tokenizer the sizes must match.
    """
    v_target = output_vocab_size(target_dir, "target")
    v_draft = output_vocab_size(draft_dir, "draft")
    if target_tokenizer is None:
        target_tokenizer = load_tokenizer(target_dir)
    if draft_tokenizer is None:
        draft_tokenizer = load_tokenizer(draft_dir)
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
            example = ", ".join(f"{tok!r}->{idx}" for tok, idx in differ[:3])
            raise ModelLoadError(
                f"draft vocabulary differs from the target's: target {str(target_dir)!r} has "
                f"{len(t_vocab)} tokens, draft {str(draft_dir)!r} has {len(d_vocab)}; "
                f"{len(differ)} (token, id) pairs differ (e.g. {example}). "
                "Speculative decoding needs a draft with the target's tokenizer."
            )
        # Tokens past the logits are the target's own matter (neither model ever emits them); only
        # when the sizes differ must the tokenizer fit the smaller, for the logits to be aligned.
        if v_target != v_draft and len(t_vocab) > min(v_target, v_draft):
            raise ModelLoadError(
                f"tokenizer has {len(t_vocab)} tokens but the models output {v_target} (target) "
                f"and {v_draft} (draft) logits"
            )
        return
    if v_target != v_draft:
        raise ModelLoadError(
            f"draft vocabulary differs from the target's: target {str(target_dir)!r} outputs "
            f"{v_target} logits, draft {str(draft_dir)!r} outputs {v_draft} "
            "(and no tokenizer in both folders to prove they only differ by padding)"
        )


# --------------------------------------------------------------------------- fingerprints
# Every artifact made from a target (generated data, hidden-state caches, trained heads) records
# which target made it, so that a later consumer can refuse a mismatch instead of training on
# silent garbage. Hashing all weights of a 70B model would read 140 GB; instead the fingerprint
# covers the full config and a strided sample of 64 values from every parameter, rounded to
# bfloat16 so that one checkpoint loaded in fp32 or in bf16 gives the same fingerprint.

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash", "use_cache")


def config_fingerprint(config) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@torch.no_grad()
def fingerprint_sample(tensor: torch.Tensor) -> bytes:
    """A parameter's part of the fingerprint: 64 strided values, rounded to bfloat16."""
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 64)][:64]
    return sample.to(torch.bfloat16).float().cpu().numpy().tobytes()


def fingerprint_of(config, samples: dict[str, bytes]) -> str:
    """The fingerprint from the config and each parameter's `fingerprint_sample`, by name."""
    digest = hashlib.sha256(config_fingerprint(config).encode())
    for name in sorted(samples):
        digest.update(name.encode())
        digest.update(samples[name])
    return digest.hexdigest()


def target_fingerprint(model: PreTrainedModel) -> str:
    """A target partitioned over processes (train/sharding.py) carries the fingerprint its
    loader took from the whole tensors: its own parameters are shards."""
    recorded = getattr(model, "draftsmith_fingerprint", None)
    if recorded is not None:
        return recorded
    return fingerprint_of(model.config, {name: fingerprint_sample(p) for name, p in model.named_parameters()})


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of the vocabulary and the added tokens (what decides the ids), or None."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def describe_model(path: str | Path, model: PreTrainedModel) -> dict:
    """Provenance of a loaded model: where it came from and what exactly it is."""
    config = model.config
    return {
        "path": str(Path(path).resolve()) if Path(path).exists() else str(path),
        "name_or_path": getattr(config, "_name_or_path", None) or str(path),
        "revision": getattr(config, "_commit_hash", None),
        "architectures": getattr(config, "architectures", None),
        "num_layers": config.get_text_config().num_hidden_layers,
        "hidden_size": config.get_text_config().hidden_size,
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "config_hash": config_fingerprint(config),
        "fingerprint": target_fingerprint(model),
    }


def load_draft_model(folder, *, target=None, device=None, dtype=None) -> PreTrainedModel:
    """A draft model as the decoder loads it (the registry's draft loader): the folder's causal LM
    on `device` in `dtype` (the target's when not given); its vocabulary is checked by
    `check_vocab_compatible` before the target loads."""
    device = device if device is not None else (target.device if target is not None else None)
    dtype = dtype if dtype is not None else (target.dtype if target is not None else torch.float32)
    return load_causal_lm(folder, device=device, dtype=dtype, role="draft")
