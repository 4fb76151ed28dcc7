"""The commands that serve a drafter folder with vLLM and SGLang, read off the folder itself.

    from draftsmith.publish.serve import serving_commands
    print(serving_commands("runs/demo-head-vllm").text())   # after `draftsmith export`

`draftsmith export` and `draftsmith tune --write` print these for what they wrote; the model card
uses the same two command builders (flags checked against the vLLM and SGLang speculative-decoding
docs):
- vLLM: `vllm serve TARGET --speculative-config '{"method": M, "model": DRAFT, "num_speculative_tokens": K}'`;
- SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm A
  --speculative-draft-model-path DRAFT --speculative-num-steps K ...` (a chain, K + 1 tokens verified).
What each kind loads with (M, A, extra fields, a refusal note) is its own: the registry's `server`
(`Method.serving`, in the method's heads module) returns it as plain data, and `_commands` writes
it here. A layout no server loads gets the `draftsmith export` command that converts it first, then
the server's command on the result.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.heads.registry import METHODS, get_method
from draftsmith.publish.artifacts import HubError, artifact_kind, default_tokens, draft_limit, read_json

#: The Hub tags of an export format: the servers that load it (the model card's metadata).
FORMAT_TAGS = {"vllm": ("vllm",), "sglang": ("sglang",)} | {
    fmt: tags for method in METHODS.values() for fmt, tags in method.format_tags
}


def vllm_command(
    target: str, target_revision: str | None, method: str, draft: str, k: int, revision=None, **options
) -> str:
    """`vllm serve` with a drafter: `method` is vLLM's SpeculativeConfig.method; `options` more of its
    fields (e.g. parallel_drafting)."""
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": k, **options}
    if revision:
        spec["revision"] = revision  # the draft's branch (vLLM's SpeculativeConfig.revision)
    rev = f" --revision {shlex.quote(target_revision)}" if target_revision else ""
    return f"vllm serve {shlex.quote(str(target))}{rev} --speculative-config {shlex.quote(json.dumps(spec))}"


def sglang_command(
    target: str,
    algorithm: str,
    draft: str,
    k: int,
    revision: str | None = None,
    *,
    topk: int = 1,
    draft_tokens: int | None = None,
) -> str:
    """SGLang's server with a drafter. By default a chain (top-k 1): K draft steps, K + 1 tokens
    verified per call, as draftsmith measures; a tree passes topk and draft_tokens."""
    rev = f" --speculative-draft-model-revision {shlex.quote(revision)}" if revision else ""
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {shlex.quote(str(draft))}{rev} --speculative-num-steps {k} "
        f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {draft_tokens or k + 1}"
    )


@dataclass
class ServingCommands:
    """How to serve one folder: the vLLM and SGLang commands (None: that server cannot), each
    preceded by the `draftsmith export` that converts the folder when the server reads another
    layout, and notes."""

    folder: Path
    layout: str  # what the folder holds, in words
    k: int
    vllm: list[str] = field(default_factory=list)
    sglang: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"serve {self.folder} ({self.layout}, K = {self.k}):"]
        for server, commands in (("vLLM", self.vllm), ("SGLang", self.sglang)):
            if commands:
                lines.append(f"  {server}:")
                lines += [f"    {c}" for c in commands]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _target_of(config: dict, target) -> tuple[str, str | None]:
    """(the target to serve, its revision): the one given, else the one the folder records; a
    local folder as an absolute path (the server runs from anywhere)."""
    own = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {}
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    name = target or own.get("target_name_or_path") or config.get("target_name_or_path") or verifier.get("name_or_path")
    revision = None if target else own.get("target_revision") or config.get("target_revision")
    if not name:
        return "TARGET", None
    local = Path(str(name)).expanduser()
    return (str(local.resolve()) if local.exists() else str(name)), revision


def _speculation(config: dict) -> dict:
    own = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {}
    setting = own.get("speculation") or config.get("speculation")  # `draftsmith tune --write`
    return setting if isinstance(setting, dict) else {}


def serving_commands(folder, *, target=None, num_speculative_tokens: int | None = None) -> ServingCommands:
    """The commands that serve `folder` (any drafter layout draftsmith writes): with `target`
    (default: the target the folder records) and K (default: the setting `tune --write`
    recorded, else `default_tokens`: the one the folder's server config holds, else the method's),
    never above what one call of the head proposes."""
    folder = Path(folder).expanduser().resolve()
    config = read_json(folder / "config.json", "drafter config")
    if not config:
        raise HubError(f"{str(folder)!r} has no config.json: not a drafter folder draftsmith wrote")
    kind = artifact_kind(config, str(folder / "config.json"))
    served, revision = _target_of(config, target)
    setting = _speculation(config)
    k = int(num_speculative_tokens or setting.get("num_speculative_tokens") or default_tokens(kind, config))
    limit = draft_limit(kind, config)
    k = min(k, limit) if limit else k
    return _commands(get_method(kind).serving(folder, config, setting, k), folder, served, revision, k)


def _export_command(folder: Path, fmt: str, k: int, target: str | None = None) -> tuple[Path, str]:
    """(the folder written, the `draftsmith export` that converts `folder` to `fmt` there)."""
    out = folder.with_name(f"{folder.name}-{fmt}")
    target_flag = f" --target {shlex.quote(str(target))}" if target else ""
    command = (
        f"draftsmith export {shlex.quote(str(folder))} --format {fmt} --num-speculative-tokens {k} "
        f"--out {shlex.quote(str(out))}{target_flag}"
    )
    return out, command


def _commands(facts: dict, folder: Path, served, revision, k: int) -> ServingCommands:
    """The commands of a method's serving facts (`Method.serving`): for each server it can use,
    the `draftsmith export` first when the folder is in another layout, then the server's command."""
    out = ServingCommands(folder, facts["layout"], k)
    for fmt, commands in (("vllm", out.vllm), ("sglang", out.sglang)):
        server = facts.get(fmt)
        if not server:
            continue
        draft = folder
        if server.get("export"):
            draft, export = _export_command(folder, fmt, k, served if server.get("export_target") else None)
            commands.append(export)
        options = server.get("options") or {}
        if fmt == "vllm":
            commands.append(vllm_command(served, revision, server["method"], draft, k, **options))
        else:
            commands.append(sglang_command(served, server["algorithm"], draft, server.get("steps") or k, **options))
    out.notes += facts.get("notes") or []
    return out
