"""From what a user names (folders, method flags) to a loaded target and ready drafters.

    specs = DrafterSpecs(target="runs/toy/target", drafts=("small=runs/toy/draft",), prompt_lookup=True)
    target, tokenizer, drafters, device, dtype = load_drafters(specs)

One spec may ask for several methods at once (draft models, prompt lookup, Medusa heads as a
chain and a tree, an EAGLE head as a chain and a dynamic tree); every input is checked before
the (slow) target load, and a bad one raises SpecError naming the flag, the value and what
was expected. `draftsmith eval` and `check-lossless` load through `load_drafters`, `draftsmith
tune` through `load_chain_drafter` (one drafter, decoding a chain).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


class SpecError(ValueError):
    """A drafter spec (or a job input) that cannot be used; the message names the flag and value."""


# The names of the other rows of a report: a draft model may not take one.
RESERVED_NAMES = ("target-only", "prompt-lookup", "medusa-chain", "medusa-tree", "eagle-chain", "eagle-tree")


@dataclass(frozen=True)
class DrafterSpecs:
    target: str  # folder of the target (HF format, with its tokenizer)
    drafts: tuple[str, ...] = ()  # `[NAME=]DIR` of draft models sharing the target's vocabulary
    prompt_lookup: bool = False
    max_ngram: int = 3  # prompt lookup: longest n-gram to match
    medusa: str | None = None  # folder of Medusa heads
    medusa_tree: str | None = None  # "auto" (from the heads' measured accuracies) or a JSON list of paths
    tree_nodes: int = 16  # node budget of medusa_tree "auto": 17 tokens per verify stays cheap
    eagle: str | tuple[str, ...] | None = None  # `[NAME=]DIR` of EAGLE-1/EAGLE-3 heads (one or several)
    eagle_tree: str | None = None  # "DEPTH,TOP_K,TOTAL_TOKENS" of an EAGLE-2 dynamic tree
    dflash: tuple[str, ...] = ()  # `[NAME=]DIR` of DFlash heads for this target
    peagle: tuple[str, ...] = ()  # `[NAME=]DIR` of P-EAGLE heads for this target
    lossy: str | None = None  # "typical": Medusa's typical acceptance (output differs from the target's)
    typical_epsilon: float = 0.09  # typical acceptance: posterior threshold (Medusa's default)
    typical_delta: float = 0.3  # typical acceptance: entropy factor (Medusa's default)
    allow_target_mismatch: bool = False  # heads trained on another target: only for a fine-tune of it
    device: str = "auto"
    dtype: str = "auto"

    @property
    def typical(self) -> tuple[float, float] | None:
        return (self.typical_epsilon, self.typical_delta) if self.lossy == "typical" else None

    def check(self) -> None:
        """The combinations that make no sense, refused before anything is loaded."""
        if not (self.drafts or self.prompt_lookup or self.medusa or self.eagle or self.dflash or self.peagle):
            raise SpecError(
                "give a drafter: --draft DIR, --medusa DIR, --eagle DIR and/or --prompt-lookup "
                "(or --dflash DIR, --peagle DIR)"
            )
        if self.medusa_tree and not self.medusa:
            raise SpecError("--medusa-tree applies to Medusa heads: give --medusa DIR")
        if self.eagle_tree and not self.eagle:
            raise SpecError("--eagle-tree applies to EAGLE heads: give --eagle DIR")
        if self.lossy and not (self.medusa or self.eagle):
            raise SpecError("--lossy applies to Medusa and EAGLE heads: give --medusa DIR or --eagle DIR")
        eagles = [name for name in eagle_names(self.eagle) if name != "eagle"]
        taken = set(RESERVED_NAMES) | set(draft_names(self.drafts))
        for name in eagles:
            if {f"{name}-chain", f"{name}-tree"} & taken:
                raise SpecError(
                    f"--eagle {name}=DIR: its rows {name}-chain/{name}-tree take another method's name; pick another NAME"
                )


def load_drafters(specs: DrafterSpecs):
    """(target, tokenizer, {name: drafter}, device, dtype), with every input checked first."""
    from draftsmith.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
    from draftsmith.heads.models import (
        check_vocab_compatible,
        load_causal_lm,
        load_tokenizer,
        resolve_device,
        resolve_dtype,
    )

    specs.check()
    device = resolve_device(specs.device)
    dtype = resolve_dtype(specs.dtype, device)
    drafts = draft_names(specs.drafts)
    tokenizer = load_tokenizer(specs.target)
    for folder in drafts.values():
        check_vocab_compatible(specs.target, folder, target_tokenizer=tokenizer)
    dflash = dflash_names(specs.dflash, taken=set(drafts))
    peagle = peagle_names(specs.peagle, taken=set(drafts) | set(dflash))
    target = _checked(load_causal_lm(specs.target, device=device, dtype=dtype, role="target"), specs.target, "target")
    drafters = {}
    for name, folder in drafts.items():
        draft = _checked(load_causal_lm(folder, device=device, dtype=dtype, role="draft"), folder, "draft")
        label = Path(folder).name if len(drafts) == 1 else name  # one --draft keeps its method name "draft"
        drafters[name] = DraftModelDrafter(draft, name=label)
    if specs.prompt_lookup:
        drafters["prompt-lookup"] = PromptLookupDrafter(max_ngram=specs.max_ngram)
    if specs.medusa:
        drafters.update(_medusa_drafters(specs, target, device, dtype))
    if specs.eagle:
        drafters.update(_eagle_drafters(specs, target, device, dtype))
    drafters.update(_one_pass_drafters("--dflash", dflash, target, device, dtype, specs.allow_target_mismatch))
    drafters.update(_one_pass_drafters("--peagle", peagle, target, device, dtype, specs.allow_target_mismatch))
    return target, tokenizer, drafters, device, dtype


def _checked(model, folder, what: str):
    """`model`, once its weights are known to be finite (else SpecError naming the tensor)."""
    from draftsmith.heads.artifacts import check_finite_weights

    check_finite_weights(model, folder, what, SpecError)
    return model


def draft_names(values, *, flag: str = "--draft", single: str = "draft") -> dict[str, str]:
    """{method name: folder} of the --draft (or --eagle) flags. `NAME=DIR` names a draft; a bare
    DIR is `single` when it is the only one, else its folder name, with the parent folder's name
    in front when two folders share a name (demo-target-cpu/draft, distilled-draft/draft)."""
    specs = []
    for value in values or []:
        name, sep, folder = str(value).partition("=")
        if sep and name and folder and not Path(value).expanduser().exists():
            specs.append((name.strip(), str(Path(folder).expanduser())))
        else:
            specs.append((None, str(Path(value).expanduser())))
    if len(specs) == 1 and specs[0][0] is None:
        return {single: specs[0][1]}
    bare = [Path(f).expanduser() for n, f in specs if n is None]
    out: dict[str, str] = {}
    for name, folder in specs:
        if name is None:
            path = Path(folder).expanduser()
            shared = sum(p.name == path.name for p in bare) > 1
            name = f"{path.parent.name}/{path.name}" if shared else path.name
        if name in out or name in RESERVED_NAMES:
            raise SpecError(
                f"{flag}: two drafters (or one and another method) are both named {name!r}; "
                f"name them with {flag} NAME=DIR"
            )
        out[name] = folder
    return out


def dflash_names(values, taken=()) -> dict[str, str]:
    """{method name: folder} of the --dflash flags (named as --draft's; one bare DIR is "dflash"),
    each folder checked to hold a DFlash head before anything loads."""
    from draftsmith.heads.dflash import DFlashConfig

    out = {}
    for name, folder in (draft_names(values) if values else {}).items():
        name = "dflash" if name == "draft" else name
        if name in out or name in taken or name in RESERVED_NAMES:
            raise SpecError(f"--dflash: {name!r} names another method too; name the heads with --dflash NAME=DIR")
        config = Path(folder) / "config.json"
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError):
            model_type = None
        if model_type != DFlashConfig.model_type:
            raise SpecError(
                f"--dflash {folder}: expected a DFlash head folder (config.json with model_type {DFlashConfig.model_type!r})"
            )
        out[name] = folder
    return out


def peagle_names(values, taken=()) -> dict[str, str]:
    """{method name: folder} of the --peagle flags (named as --draft's; one bare DIR is "peagle"),
    each folder checked to hold a P-EAGLE head (draftsmith's or speculators' layout) before anything loads."""
    from draftsmith.heads.eagle import PEagleConfig

    out = {}
    for name, folder in (draft_names(values) if values else {}).items():
        name = "peagle" if name == "draft" else name
        if name in out or name in taken or name in RESERVED_NAMES:
            raise SpecError(f"--peagle: {name!r} names another method too; name the heads with --peagle NAME=DIR")
        try:
            config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        if config.get("model_type") != PEagleConfig.model_type and config.get("speculators_model_type") != "peagle":
            raise SpecError(
                f"--peagle {folder}: expected a P-EAGLE head folder (config.json with model_type "
                f"{PEagleConfig.model_type!r} or speculators_model_type 'peagle')"
            )
        out[name] = folder
    return out


def _one_pass_drafters(flag: str, names: dict[str, str], target, device, dtype, allow_target_mismatch: bool) -> dict:
    """{method name: drafter} of the heads of `flag` ("--dflash" or "--peagle": heads that draft
    every position in one forward), each loaded through `_load_checked`."""
    from draftsmith.decoding.dflash import DFlashDrafter
    from draftsmith.decoding.peagle import PEagleDrafter
    from draftsmith.heads.dflash import DFlashError
    from draftsmith.heads.dflash_formats import load_dflash
    from draftsmith.heads.eagle import EagleError, load_eagle

    what, load, error, drafter = {
        "--dflash": ("DFlash head", load_dflash, DFlashError, DFlashDrafter),
        "--peagle": ("P-EAGLE head", load_eagle, EagleError, PEagleDrafter),
    }[flag]
    drafters = {}
    for name, folder in names.items():
        head = _load_checked(
            what, load, error, folder, target, device, dtype, allow_target_mismatch, context=f"{flag} {folder}: "
        )
        drafters[name] = drafter(head, name=name)
    return drafters


def parse_eagle_tree(text: str) -> dict:
    """ "DEPTH,TOP_K,TOTAL_TOKENS" -> the EagleDrafter tree options."""
    try:
        depth, top_k, total = (int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--eagle-tree {text!r}: expected DEPTH,TOP_K,TOTAL_TOKENS, e.g. 4,4,16") from None
    if min(depth, top_k, total) < 1:
        raise SpecError(f"--eagle-tree {text!r}: all three must be >= 1")
    return {"depth": depth, "top_k": top_k, "total_tokens": total}


def parse_medusa_tree(text: str, heads, folder, num_nodes: int) -> list[tuple[int, ...]]:
    """ "auto" (a tree of `num_nodes` built from the heads' recorded accuracies) or JSON paths."""
    from draftsmith.eval.medusa_tree import build_medusa_tree

    if text == "auto":
        accuracies = heads.config.head_accuracies
        if not accuracies:
            raise SpecError(
                f"--medusa-tree auto: {folder} records no head accuracies "
                "(train it with train/medusa.py, or give the paths as JSON)"
            )
        return build_medusa_tree(accuracies, num_nodes)
    try:
        return [tuple(int(r) for r in path) for path in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise SpecError(
            f"--medusa-tree {text!r}: expected auto or a JSON list of paths like [[0],[1],[0,0]] ({err})"
        ) from None


def load_medusa_heads(folder, target, device, dtype, *, allow_target_mismatch: bool = False):
    """Medusa heads that fit `target` (sizes) and were trained on it (`_load_checked`)."""
    from draftsmith.heads.medusa import MedusaError, load_medusa

    return _load_checked("Medusa heads", load_medusa, MedusaError, folder, target, device, dtype, allow_target_mismatch)


def load_eagle_head(folder, target, device, dtype, *, allow_target_mismatch: bool = False):
    """An EAGLE head that fits `target` (sizes, depth, RoPE) and was trained on it (`_load_checked`)."""
    from draftsmith.heads.eagle import EagleError, load_eagle

    return _load_checked("EAGLE head", load_eagle, EagleError, folder, target, device, dtype, allow_target_mismatch)


def _load_checked(what: str, load, error, folder, target, device, dtype, allow_target_mismatch, *, context=""):
    """`load(folder, target=, device=, dtype=)`'s heads, once their files are whole, their weights
    finite, and they fit `target` and were trained on it (`check_heads_target`); else SpecError
    (`error` of `load` too, its message after `context`)."""
    from draftsmith.heads.artifacts import check_safetensors

    check_safetensors(folder, what, SpecError)
    try:
        heads = _checked(load(folder, target=target, device=device, dtype=dtype), folder, what)
    except error as err:
        raise SpecError(f"{context}{err}") from None
    check_heads_target(f"{what} {str(folder)!r}", heads, target, allow_target_mismatch)
    return heads


def check_heads_target(what: str, heads, target, allow_target_mismatch: bool) -> None:
    """Heads trained on another target: SpecError naming both fingerprints, unless allowed (a
    fine-tune of it); heads without draftsmith provenance (imported): a note on stderr saying
    what could be compared. The rule is `heads.provenance`, the trainers' too."""
    from draftsmith.heads.provenance import ProvenanceError, TargetRecord, check_target_provenance

    try:
        note = check_target_provenance(
            what,
            TargetRecord.of_head_config(heads.config),
            target,
            allow_mismatch=allow_target_mismatch,
            flag="pass --allow-target-mismatch",
        )
    except ProvenanceError as err:
        raise SpecError(str(err)) from None
    if note:
        print(note, file=sys.stderr)


def eagle_names(value) -> dict[str, str]:
    """{row prefix: folder} of the --eagle flags: one bare DIR is "eagle" (rows eagle-chain,
    eagle-tree); `NAME=DIR` gives rows NAME-chain and NAME-tree (heads of other toolkits beside
    draftsmith's, measured by the same decoder)."""
    values = (value,) if isinstance(value, str) else tuple(value or ())
    return draft_names(values, flag="--eagle", single="eagle") if values else {}


def _eagle_drafters(specs: DrafterSpecs, target, device, dtype) -> dict:
    from draftsmith.decoding.eagle import EagleDrafter

    options = {"typical": specs.typical}
    tree = parse_eagle_tree(specs.eagle_tree) if specs.eagle_tree else None
    drafters = {}
    for prefix, folder in eagle_names(specs.eagle).items():
        head = load_eagle_head(folder, target, device, dtype, allow_target_mismatch=specs.allow_target_mismatch)
        drafters[f"{prefix}-chain"] = EagleDrafter(head, name=f"{prefix}-chain", **options)
        if tree is not None:
            drafters[f"{prefix}-tree"] = EagleDrafter(head, tree=tree, name=f"{prefix}-tree", **options)
    return drafters


def _medusa_drafters(specs: DrafterSpecs, target, device, dtype) -> dict:
    from draftsmith.decoding.drafters import MedusaDrafter

    heads = load_medusa_heads(specs.medusa, target, device, dtype, allow_target_mismatch=specs.allow_target_mismatch)
    layers = target.config.get_text_config().num_hidden_layers
    options = {"typical": specs.typical}
    drafters = {"medusa-chain": MedusaDrafter(heads, layers, name="medusa-chain", **options)}
    if specs.medusa_tree:
        tree = parse_medusa_tree(specs.medusa_tree, heads, specs.medusa, specs.tree_nodes)
        try:
            drafters["medusa-tree"] = MedusaDrafter(heads, layers, tree=tree, name="medusa-tree", **options)
        except ValueError as err:
            raise SpecError(f"--medusa-tree: {err}") from None
    return drafters


CHAIN_KINDS = ("draft", "medusa", "eagle", "dflash", "peagle")


def chain_drafter(kind: str, folder, target, device, dtype, *, allow_target_mismatch: bool = False):
    """The chain drafter `draftsmith eval` builds from one folder of `kind` (CHAIN_KINDS: a draft
    model, Medusa heads, an EAGLE, DFlash or P-EAGLE head) over an already loaded `target`, with
    the same checks (whole files, finite weights, trained on this target)."""
    from draftsmith.decoding.drafters import DraftModelDrafter, MedusaDrafter
    from draftsmith.heads.models import load_causal_lm

    if kind == "draft":
        model = _checked(load_causal_lm(folder, device=device, dtype=dtype, role="draft"), folder, "draft")
        return DraftModelDrafter(model, name="draft")
    if kind == "medusa":
        heads = load_medusa_heads(folder, target, device, dtype, allow_target_mismatch=allow_target_mismatch)
        return MedusaDrafter(heads, target.config.get_text_config().num_hidden_layers, name="medusa-chain")
    if kind == "eagle":
        from draftsmith.decoding.eagle import EagleDrafter

        head = load_eagle_head(folder, target, device, dtype, allow_target_mismatch=allow_target_mismatch)
        return EagleDrafter(head, name="eagle-chain")
    if kind not in ("dflash", "peagle"):
        raise SpecError(f"drafter kind {kind!r}: expected one of {', '.join(CHAIN_KINDS)}")
    return _one_pass_drafters(f"--{kind}", {kind: str(folder)}, target, device, dtype, allow_target_mismatch)[kind]


def load_chain_drafter(
    target_folder,
    *,
    draft=None,
    medusa=None,
    eagle=None,
    dflash=None,
    peagle=None,
    device="auto",
    dtype="auto",
    allow_target_mismatch=False,
):
    """The one chain drafter `draftsmith tune` measures (exactly one of draft, medusa, eagle,
    dflash, peagle): (target, tokenizer, drafter, its folder, the Medusa heads or None)."""
    from draftsmith.heads.models import (
        check_vocab_compatible,
        load_causal_lm,
        load_tokenizer,
        resolve_device,
        resolve_dtype,
    )

    folders = {"draft": draft, "medusa": medusa, "eagle": eagle, "dflash": dflash, "peagle": peagle}
    if sum(x is not None for x in folders.values()) != 1:
        raise SpecError("give one drafter to tune: --draft, --medusa, --eagle, --dflash or --peagle DIR")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tokenizer = load_tokenizer(target_folder)
    if draft:
        check_vocab_compatible(target_folder, draft, target_tokenizer=tokenizer)
    target = _checked(load_causal_lm(target_folder, device=device, dtype=dtype, role="target"), target_folder, "target")
    kind, folder = next((k, f) for k, f in folders.items() if f is not None)
    drafter = chain_drafter(kind, folder, target, device, dtype, allow_target_mismatch=allow_target_mismatch)
    return target, tokenizer, drafter, folder, (drafter.heads if kind == "medusa" else None)


def eos_token_id(target, tokenizer):
    """The tokenizer's end-of-sequence id, else the target's generation config's."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return eos if eos is not None else target.generation_config.eos_token_id
