"""From what a user names (`--drafter KIND[:NAME]=DIR`, prompt lookup, trees) to a loaded target
and ready drafters.

    specs = DrafterSpecs(target="runs/toy/target", drafters=("draft:small=runs/toy/draft",), prompt_lookup=True)
    target, tokenizer, drafters, device, dtype = load_drafters(specs)

A spec may name several drafters of any registered kind (heads/registry.py); each decodes the rows
its method gives (a chain, and a tree when `--tree KIND=SPEC` asks). Every input is checked before
the (slow) target load, and a bad one raises SpecError naming the flag, the value and what was
expected. `draftsmith eval` and `check-lossless` load through `load_drafters`, `draftsmith tune`
through `load_chain_drafter` (one drafter, decoding a chain).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from draftsmith.heads.registry import METHODS, Method, RegistryError, RowOptions, get_method, read_folder_config


class SpecError(ValueError):
    """A drafter spec (or a job input) that cannot be used; the message names the flag and value."""


# The rows every report may hold besides the drafters': no drafter may take these names.
RESERVED_NAMES = ("target-only", "prompt-lookup")
SPEC_FORM = "KIND[:NAME]=DIR"


@dataclass(frozen=True)
class Drafter:
    """One `--drafter`: its method kind, the name of its rows, its folder."""

    kind: str
    name: str
    folder: str

    @property
    def method(self) -> Method:
        return get_method(self.kind)


@dataclass(frozen=True)
class DrafterSpecs:
    target: str  # folder of the target (HF format, with its tokenizer)
    drafters: tuple[str, ...] = ()  # `KIND[:NAME]=DIR` of trained drafters for this target
    prompt_lookup: bool = False
    max_ngram: int = 3  # prompt lookup: longest n-gram to match
    trees: tuple[str, ...] = ()  # `KIND=SPEC`: also decode that kind's drafters as a tree
    tree_nodes: int = 16  # node budget of an "auto" tree: 17 tokens per verify stays cheap
    lossy: str | None = None  # "typical": typical acceptance (output differs from the target's)
    typical_epsilon: float = 0.09  # typical acceptance: posterior threshold (Cai et al. 2024's default)
    typical_delta: float = 0.3  # typical acceptance: entropy factor (Cai et al. 2024's default)
    allow_target_mismatch: bool = False  # heads trained on another target: only for a fine-tune of it
    device: str = "auto"
    dtype: str = "auto"

    @property
    def typical(self) -> tuple[float, float] | None:
        return (self.typical_epsilon, self.typical_delta) if self.lossy == "typical" else None

    def resolved(self) -> list[Drafter]:
        """The `--drafter`s with their row names (see `parse_drafters`)."""
        return parse_drafters(self.drafters)

    def tree_specs(self) -> dict[str, str]:
        """{kind: tree spec} of the `--tree`s, each checked to name a kind that decodes trees."""
        out = {}
        for value in self.trees:
            kind, sep, spec = str(value).partition("=")
            method = _method(kind, f"--tree {value}")
            if not sep or not spec:
                forms = "; ".join(f"{m.kind}: {m.tree_spec}" for m in METHODS.values() if m.tree_spec)
                raise SpecError(f"--tree {value!r}: expected KIND=SPEC, SPEC per kind: {forms}")
            if method.tree_spec is None:
                trees = ", ".join(m.kind for m in METHODS.values() if m.tree_spec)
                raise SpecError(f"--tree {value!r}: {method.title} decode chains only (trees: {trees})")
            out[kind] = spec
        return out

    def check(self) -> list[Drafter]:
        """The combinations that make no sense, refused before anything is loaded; the drafters."""
        drafters = self.resolved()
        if not drafters and not self.prompt_lookup:
            raise SpecError(f"give a drafter: --drafter {SPEC_FORM} (kinds: {', '.join(METHODS)}) or --prompt-lookup")
        kinds = {d.kind for d in drafters}
        for kind in self.tree_specs():
            if kind not in kinds:
                raise SpecError(f"--tree {kind}=...: applies to {get_method(kind).title}: give --drafter {kind}=DIR")
        if self.lossy and not any(d.method.typical for d in drafters):
            typical = ", ".join(m.kind for m in METHODS.values() if m.typical)
            raise SpecError(f"--lossy applies to drafters of kind {typical}: give one with --drafter")
        return drafters

    def options(self, drafter: Drafter) -> RowOptions:
        tree = self.tree_specs().get(drafter.kind)
        typical = self.typical if drafter.method.typical else None
        return RowOptions(tree=tree, tree_nodes=self.tree_nodes, typical=typical)


def _method(kind: str, where: str) -> Method:
    try:
        return get_method(kind)
    except RegistryError as err:
        raise SpecError(f"{where}: {err}") from None


def parse_drafters(values) -> list[Drafter]:
    """The `--drafter KIND[:NAME]=DIR` values. Without NAME a kind's only drafter is named after the
    kind, one of several after its folder (with the parent folder's name in front when two share a
    name); each folder must hold that kind's layout. A row name taken twice is refused."""
    given = []
    for value in values or ():
        head, sep, folder = str(value).partition("=")
        kind, _, name = head.partition(":")
        if not sep or not folder:
            first = next(iter(METHODS.values()))
            example = f"{first.kind}=runs/{first.kind}/{first.run_folder}"
            raise SpecError(f"--drafter {value!r}: expected {SPEC_FORM}, e.g. {example}")
        given.append(
            (_method(kind.strip(), f"--drafter {value}"), name.strip() or None, str(Path(folder).expanduser()))
        )
    drafters, rows = [], {name: "another method" for name in RESERVED_NAMES}
    for method, name, folder in given:
        if name in METHODS and name != method.kind:  # rows named like another method's would mislead
            raise SpecError(
                f"--drafter {method.kind}:{name}={folder}: {name!r} is another method's name; pick another NAME"
            )
        if name is None:
            bare = [Path(f) for m, n, f in given if m is method and n is None]
            path = Path(folder)
            shared = sum(p.name == path.name for p in bare) > 1
            alone = sum(m is method for m, _, _ in given) == 1
            name = method.kind if alone else (f"{path.parent.name}/{path.name}" if shared else path.name)
        for row in (name + method.row_suffix, f"{name}-tree") if method.tree_spec else (name,):
            if row in rows:
                raise SpecError(
                    f"--drafter {method.kind}:{name}={folder}: the row {row!r} is {rows[row]}'s too; "
                    f"name it with --drafter {method.kind}:NAME=DIR"
                )
            rows[row] = f"{method.kind} {folder!r}"
        drafters.append(Drafter(method.kind, name, folder))
    return drafters


def check_folder(drafter: Drafter) -> None:
    """A folder holds its kind's layout (config.json), else SpecError naming what was expected."""
    method, flag = drafter.method, f"--drafter {drafter.kind}={drafter.folder}"
    if not Path(drafter.folder).is_dir():
        raise SpecError(f"{flag}: {drafter.folder!r} does not exist or is not a directory")
    config = read_folder_config(drafter.folder)
    if method.has_own_layout and not method.matches(config):
        raise SpecError(
            f"{flag}: expected a {method.title} folder (config.json with model_type in {list(method.model_types)}"
            + (f" or speculators_model_type in {list(method.speculators_types)}" if method.speculators_types else "")
            + f"), found model_type {config.get('model_type')!r}"
        )
    if not method.has_own_layout and not config.get("model_type"):
        raise SpecError(f"{flag}: expected a transformers model folder (config.json with a model_type)")


def load_drafters(specs: DrafterSpecs):
    """(target, tokenizer, {row name: drafter}, device, dtype), with every input checked first."""
    from draftsmith.decoding.drafters import PromptLookupDrafter
    from draftsmith.heads.models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype

    drafters = specs.check()
    device = resolve_device(specs.device)
    dtype = resolve_dtype(specs.dtype, device)
    tokenizer = load_tokenizer(specs.target)
    for drafter in drafters:
        check_folder(drafter)
        if drafter.method.precheck:
            drafter.method.part("precheck")(specs.target, drafter.folder, target_tokenizer=tokenizer)
    target = _checked(load_causal_lm(specs.target, device=device, dtype=dtype, role="target"), specs.target, "target")
    rows = {}
    for drafter in drafters:
        loaded = load_checked(drafter, target, device, dtype, specs.allow_target_mismatch)
        try:
            rows.update(drafter.method.rows(loaded, target, drafter.name, specs.options(drafter)))
        except ValueError as err:
            raise SpecError(f"--drafter {drafter.kind}={drafter.folder}: {err}") from None
    if specs.prompt_lookup:
        rows["prompt-lookup"] = PromptLookupDrafter(max_ngram=specs.max_ngram)
    return target, tokenizer, rows, device, dtype


def _checked(model, folder, what: str):
    """`model`, once its weights are known to be finite (else SpecError naming the tensor)."""
    from draftsmith.heads.artifacts import check_finite_weights

    check_finite_weights(model, folder, what, SpecError)
    return model


def load_checked(drafter: Drafter, target, device, dtype, allow_target_mismatch: bool = False):
    """The trained drafter of `drafter` (its method's loader), once its files are whole, its
    weights finite, and it fits `target` and was trained on it (`check_heads_target`); else
    SpecError (the loader's own error too, after the flag)."""
    from draftsmith.heads.artifacts import check_safetensors

    method, flag = drafter.method, f"--drafter {drafter.kind}={drafter.folder}"
    check_safetensors(drafter.folder, method.title, SpecError)
    try:
        loaded = _checked(
            method.load(drafter.folder, target=target, device=device, dtype=dtype), drafter.folder, method.title
        )
    except method.part("error") as err:
        raise SpecError(f"{flag}: {err}") from None
    if method.trained_on_target:
        check_heads_target(f"{method.title} {drafter.folder!r}", loaded, target, allow_target_mismatch)
    return loaded


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


def chain_drafter(kind: str, folder, target, device, dtype, *, allow_target_mismatch: bool = False):
    """The chain drafter of one folder of `kind` (any registered kind) over an already loaded
    `target`, with `load_checked`'s checks; its rows are named after the kind."""
    drafter = Drafter(_method(kind, "drafter kind").kind, kind, str(folder))
    check_folder(drafter)
    loaded = load_checked(drafter, target, device, dtype, allow_target_mismatch)
    return next(iter(drafter.method.rows(loaded, target, kind, RowOptions()).values()))


def load_chain_drafter(target_folder, spec: str, *, device="auto", dtype="auto", allow_target_mismatch=False):
    """The one chain drafter `draftsmith tune` measures (`spec`: KIND[:NAME]=DIR), loaded as
    `load_drafters` loads it: (target, tokenizer, drafter, its folder, its kind)."""
    specs = DrafterSpecs(
        target=str(target_folder),
        drafters=(spec,),
        allow_target_mismatch=allow_target_mismatch,
        device=device,
        dtype=dtype,
    )
    (drafter,) = specs.resolved()
    target, tokenizer, rows, _, _ = load_drafters(specs)
    return target, tokenizer, next(iter(rows.values())), drafter.folder, drafter.kind


def eos_token_id(target, tokenizer):
    """The tokenizer's end-of-sequence id, else the target's generation config's."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return eos if eos is not None else target.generation_config.eos_token_id
