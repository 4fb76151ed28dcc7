"""The commands that serve a drafter folder with vLLM and SGLang, read off the folder itself.

    from draftsmith.publish.serve import serving_commands
    print(serving_commands("runs/demo-eagle3-vllm").text())   # after `draftsmith export`

`draftsmith export` and `draftsmith tune --write` print these for what they wrote; the model card
uses the same two command builders. What each server loads (flags checked against the vLLM and
SGLang speculative-decoding docs):
- vLLM: `vllm serve TARGET --speculative-config '{"method": M, "model": DRAFT, "num_speculative_tokens": K}'`
  with M = "medusa" (vLLM's Medusa layout), "eagle3" (the speculators layout; a P-EAGLE head adds
  `"parallel_drafting": true`), "dflash" (the speculators `dflash` layout), "draft_model" (a plain
  causal LM sharing the target's vocabulary);
- SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3|STANDALONE
  --speculative-draft-model-path DRAFT --speculative-num-steps K --speculative-eagle-topk 1
  --speculative-num-draft-tokens K+1` (a chain). SGLang has no Medusa drafter, and no layout of a
  P-EAGLE or DFlash head is written here: their notes say so.
Each kind of the registry (draftsmith.heads.registry) has one builder below (`_SERVERS`).
A layout no server loads (the draftsmith layout, FasterDecoding's Medusa layout) gets the
`draftsmith export` command that converts it first, then the server's command on the result.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.publish.artifacts import HubError, artifact_kind, default_tokens, draft_limit, read_json

SGLANG_EAGLE3 = "LlamaForCausalLMEagle3"
#: The Hub tags of an export format: the servers that load it (the model card's metadata).
FORMAT_TAGS = {"vllm": ("vllm",), "sglang": ("sglang",), "medusa": ("tgi",)}


def vllm_command(
    target: str, target_revision: str | None, method: str, draft: str, k: int, revision=None, **options
) -> str:
    """`vllm serve` with a drafter: `method` is vLLM's SpeculativeConfig.method; `options` more of its
    fields (P-EAGLE: parallel_drafting)."""
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
    verified per call, as draftsmith measures; an EAGLE tree passes topk and draft_tokens."""
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
    return _SERVERS[kind](folder, config, served, revision, setting, k)


def _export_command(folder: Path, fmt: str, k: int, target: str | None = None) -> tuple[Path, str]:
    """(the folder written, the `draftsmith export` that converts `folder` to `fmt` there)."""
    out = folder.with_name(f"{folder.name}-{fmt}")
    target_flag = f" --target {shlex.quote(str(target))}" if target else ""
    command = (
        f"draftsmith export {shlex.quote(str(folder))} --format {fmt} --num-speculative-tokens {k} "
        f"--out {shlex.quote(str(out))}{target_flag}"
    )
    return out, command


def _draft(folder: Path, config: dict, served, revision, setting: dict, k: int) -> ServingCommands:
    out = ServingCommands(folder, "a draft model (a plain causal LM)", k)
    out.vllm.append(vllm_command(served, revision, "draft_model", folder, k))
    out.sglang.append(sglang_command(served, "STANDALONE", folder, k))
    return out


def _eagle(folder: Path, config: dict, served, revision, setting: dict, k: int) -> ServingCommands:
    version = config.get("version") or config.get("speculators_model_type") or "eagle3"
    if version != "eagle3":
        out = ServingCommands(folder, f"an {version.upper()} head in the draftsmith layout", k)
        out.notes.append(
            "vLLM and SGLang load EAGLE-3 heads from draftsmith's exports; an EAGLE-1 head has no server layout here: "
            f"decode with it through draftsmith (draftsmith eval --drafter eagle={shlex.quote(str(folder))})"
        )
        return out
    depth, topk, total = setting.get("depth"), setting.get("top_k"), setting.get("total_tokens")
    tree = {"topk": topk, "draft_tokens": total + 1} if depth and topk and total else {}  # SGLang counts the root
    steps = depth or k
    if "speculators_model_type" in config:
        out = ServingCommands(folder, "an EAGLE-3 head in the speculators layout (vLLM)", k)
        out.vllm.append(vllm_command(served, revision, "eagle3", folder, k))
    elif SGLANG_EAGLE3 in (config.get("architectures") or []):
        out = ServingCommands(folder, "an EAGLE-3 head in SGLang's layout", k)
        out.sglang.append(sglang_command(served, "EAGLE3", folder, steps, **tree))
    else:
        out = ServingCommands(folder, "an EAGLE-3 head in the draftsmith layout", k)
    for fmt, commands in (("vllm", out.vllm), ("sglang", out.sglang)):
        if commands:
            continue
        converted, export = _export_command(folder, fmt, k)
        commands.append(export)
        commands.append(
            vllm_command(served, revision, "eagle3", converted, k)
            if fmt == "vllm"
            else sglang_command(served, "EAGLE3", converted, steps, **tree)
        )
    if tree:
        out.notes.append(f"vLLM drafts a chain of K = {k}; SGLang the tuned tree (depth {depth}, top-k {topk})")
    out.notes.append("the head reads the target's hidden states at fixed layers: serve it with exactly this target")
    return out


def _dflash(folder: Path, config: dict, served, revision, setting: dict, k: int) -> ServingCommands:
    """A DFlash head: vLLM serves the speculators `dflash` layout (method "dflash", one block of
    block_size - 1 drafts per call); SGLang's DFlash drafter reads another layout, not written here."""
    exported = "speculators_model_type" in config
    out = ServingCommands(folder, f"a DFlash head in the {'speculators' if exported else 'draftsmith'} layout", k)
    draft = folder
    if not exported:
        draft, export = _export_command(folder, "vllm", k)
        out.vllm.append(export)
    out.vllm.append(vllm_command(served, revision, "dflash", draft, k))
    out.notes.append("SGLang: no DFlash layout is written here (draftsmith exports the speculators layout vLLM loads)")
    out.notes.append("the head reads the target's hidden states at fixed layers: serve it with exactly this target")
    return out


def _peagle(folder: Path, config: dict, served, revision, setting: dict, k: int) -> ServingCommands:
    """A P-EAGLE head: vLLM serves the speculators `peagle` layout as an EAGLE-3 head drafting every
    depth in one pass (`parallel_drafting`); SGLang has no P-EAGLE layout here."""
    exported = "speculators_model_type" in config
    out = ServingCommands(folder, f"a P-EAGLE head in the {'speculators' if exported else 'draftsmith'} layout", k)
    draft = folder
    if not exported:
        draft, export = _export_command(folder, "vllm", k)
        out.vllm.append(export)
    out.vllm.append(vllm_command(served, revision, "eagle3", draft, k, parallel_drafting=True))
    out.notes.append("SGLang has no P-EAGLE layout here")
    out.notes.append("the head reads the target's hidden states at fixed layers: serve it with exactly this target")
    return out


def _medusa(folder: Path, config: dict, served, revision, setting: dict, k: int) -> ServingCommands:
    own = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else config
    if config.get("model_type") == "medusa":
        out = ServingCommands(folder, "Medusa heads in vLLM's layout", k)
        out.vllm.append(vllm_command(served, revision, "medusa", folder, k))
    else:
        layout = "FasterDecoding's layout" if "medusa_num_heads" in config else "the draftsmith layout"
        out = ServingCommands(folder, f"Medusa heads in {layout}", k)
        converted, export = _export_command(folder, "vllm", k, served if own.get("share_lm_head") else None)
        out.vllm.append(export)
        out.vllm.append(vllm_command(served, revision, "medusa", converted, k))
    out.notes.append("SGLang has no Medusa drafter")
    if setting.get("tree"):
        out.notes.append(
            "vLLM drafts the heads' top-1 chain; the tuned tree is for `draftsmith eval --drafter medusa=DIR "
            "--medusa-tree`"
        )
    return out


# What each kind of drafter folder is served with (the kinds of draftsmith.heads.registry.METHODS).
_SERVERS = {"draft": _draft, "medusa": _medusa, "eagle": _eagle, "peagle": _peagle, "dflash": _dflash}
