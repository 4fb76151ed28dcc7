"""Secrets never leave the machine: credential keys are dropped, token-like values redacted, and
the staged folder is checked for the Hub token before anything is uploaded."""

from __future__ import annotations

import re
from pathlib import Path

from draftsmith.publish.artifacts import HubError

REDACTED = "<redacted>"
_HF_TOKEN_VALUE = re.compile(r"hf_[A-Za-z0-9]{20,}")
_SECRET_WORDS = ("secret", "password", "passwd", "api_key", "apikey", "credential", "private_key")
# "<word>_token" names a vocabulary entry for these words (pad_token, eos_token, ...), not a credential.
_VOCABULARY_WORDS = {
    "bos",
    "eos",
    "pad",
    "unk",
    "sep",
    "cls",
    "mask",
    "bonus",
    "draft",
    "special",
    "start",
    "end",
    "stop",
    "next",
    "new",
    "first",
    "last",
    "target",
    "image",
    "audio",
    "video",
    "think",
    "sentinel",
    "decoder",
    "add",
    "split",
}


def is_secret_key(key: str) -> bool:
    """True for names of credentials (token, hub_token, use_auth_token, api_key, ...); False for
    vocabulary names (pad_token, eos_token_id, max_new_tokens, tokenizer, token_map)."""
    k = str(key).lower().replace("-", "_").strip("_")
    if any(word in k for word in _SECRET_WORDS):
        return True
    parts = k.split("_")
    return parts[-1] == "token" and (len(parts) == 1 or parts[-2] not in _VOCABULARY_WORDS)


def scrub_text(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with each of `secrets` and anything shaped like a Hub token redacted."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _HF_TOKEN_VALUE.sub(REDACTED, text)


def _scrub_argv(argv: list, secrets: tuple[str, ...]) -> list:
    """A command line with the values of credential flags (`--hub-token X`, `hub_token=X`) redacted."""
    out, hide_next = [], False
    for item in argv:
        text = str(item)
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, sep, _ = text.lstrip("-").partition("=")
        if is_secret_key(name) and (sep or text.startswith("-")):
            if sep:
                out.append(text.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(text)
                hide_next = True
            continue
        out.append(scrub_text(text, secrets))
    return out


def scrub(value, secrets: tuple[str, ...] = ()):
    """`value` without credential keys, with token-like strings and `secrets` redacted."""
    if isinstance(value, dict):
        return {
            k: (_scrub_argv(v, secrets) if k == "command" and isinstance(v, list) else scrub(v, secrets))
            for k, v in value.items()
            if not is_secret_key(k)
        }
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, str):
        return scrub_text(value, secrets)
    return value


def check_no_secret(folder: Path, secrets: tuple[str, ...]) -> None:
    """Last guard before anything leaves the machine: no staged file contains a secret. Weights
    are read only in their safetensors header (tensors cannot hold a string on purpose)."""
    needles = [s.encode() for s in secrets if s]
    if not needles:
        return
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                head = f.read(8)
                data = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        else:
            data = path.read_bytes()
        if any(n in data for n in needles):
            name = str(path.relative_to(folder))
            raise HubError(f"{name!r} would carry the Hub token; nothing was pushed. Remove it from that file.")
