"""Loading targets and drafts from local folders, and checking that their vocabularies agree."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto" -> bfloat16 on CUDA, float32 elsewhere."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"--dtype {name!r}: expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _check_folder(path: str | Path, role: str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{role} folder {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{role} folder {str(path)!r} has no config.json (save it with save_pretrained)")
    return path


def load_causal_lm(path: str | Path, *, device: torch.device, dtype: torch.dtype, role: str = "model") -> PreTrainedModel:
    path = _check_folder(path, role)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the {role} from {str(path)!r}: {err}") from None
    return model.to(device).eval()


def load_tokenizer(path: str | Path, role: str = "model"):
    """The folder's tokenizer, or None when it has none."""
    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def output_vocab_size(path: str | Path, role: str) -> int:
    config = AutoConfig.from_pretrained(_check_folder(path, role))
    return config.get_text_config().vocab_size


def check_vocab_compatible(target_dir: str | Path, draft_dir: str | Path, target_tokenizer=None, draft_tokenizer=None) -> None:
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
        if len(t_vocab) > min(v_target, v_draft):
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
