"""Which target an artifact was made from, checked against the target it is about to serve.

    recorded = TargetRecord.of_description(data.provenance["target"])     # generated data
    recorded = TargetRecord.of_head_config(heads.config)                   # a head trained on it
    note = check_target_provenance(f"data {data.dir}", recorded, target, allow_mismatch=False,
                                   flag="set allow_target_mismatch=true")

Every artifact draftsmith makes from a target records that target: generated data in
provenance.json ("target": `models.describe_model`), heads trained on it in their config
(`target_fingerprint`, `target_name_or_path`, `target_num_layers`, the sizes), hidden-state
caches in their manifest (checked by `HiddenStateCache.check`, always strictly: states of
another model are not this model's). The fingerprint (`models.target_fingerprint`) covers the
config and a sample of every weight. The rule, the same for every trainer and for `eval`:

- the shapes recorded (architecture, hidden size, vocabulary, number of layers) must be the
  target's: an artifact of another shape cannot serve it, whatever the flag says;
- another fingerprint is an error, unless the user says the target is a fine-tune of the one
  the artifact was made from (`allow_target_mismatch`, one name everywhere: recipe key, CLI
  flag `--allow-target-mismatch`); then one warning line;
- no fingerprint at all (heads imported from another toolkit): one note line saying that only
  the recorded shapes were compared.
"""

from __future__ import annotations

from dataclasses import dataclass


class ProvenanceError(ValueError):
    """An artifact made from another target; the message names both and what to do."""


@dataclass(frozen=True)
class TargetRecord:
    """What an artifact records of the target it was made from (None: not recorded)."""

    fingerprint: str | None = None
    name_or_path: str | None = None
    architectures: tuple[str, ...] | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None

    @classmethod
    def of_model(cls, target) -> TargetRecord:
        from draftsmith.heads.models import target_fingerprint

        text = target.config.get_text_config()
        out = target.get_output_embeddings()
        return cls(
            fingerprint=target_fingerprint(target),
            name_or_path=getattr(target.config, "_name_or_path", None) or type(target).__name__,
            architectures=tuple(target.config.architectures or ()) or None,
            hidden_size=text.hidden_size,
            vocab_size=out.weight.shape[0] if out is not None else text.vocab_size,
            num_layers=text.num_hidden_layers,
        )

    @classmethod
    def of_description(cls, target: dict | None) -> TargetRecord:
        """From `models.describe_model`'s dict (data provenance.json "target")."""
        d = target or {}
        return cls(
            fingerprint=d.get("fingerprint"),
            name_or_path=d.get("name_or_path") or d.get("path"),
            architectures=tuple(d["architectures"]) if d.get("architectures") else None,
            hidden_size=d.get("hidden_size"),
            vocab_size=d.get("vocab_size"),
            num_layers=d.get("num_layers"),
        )

    @classmethod
    def of_head_config(cls, config) -> TargetRecord:
        """From the config of a head trained on the target (its hidden and vocabulary sizes are the target's)."""
        architectures = getattr(config, "target_architectures", None)
        return cls(
            fingerprint=getattr(config, "target_fingerprint", None),
            name_or_path=getattr(config, "target_name_or_path", None),
            architectures=tuple(architectures) if architectures else None,
            hidden_size=getattr(config, "hidden_size", None),
            vocab_size=getattr(config, "vocab_size", None),
            num_layers=getattr(config, "target_num_layers", None),
        )


# (field, how a message names it): the shapes a fine-tune keeps
_SHAPES = (
    ("architectures", "architecture"),
    ("hidden_size", "hidden size"),
    ("vocab_size", "vocabulary"),
    ("num_layers", "layers"),
)


def check_target_provenance(
    artifact: str, recorded: TargetRecord, target, *, allow_mismatch: bool, flag: str
) -> str | None:
    """None when `artifact` (named as the user knows it: "data DIR", "<Method.title> DIR") was made
    from `target`; else the one line to show (a warning for an allowed fine-tune, a note for an
    artifact without draftsmith provenance). Raises ProvenanceError for a shape that differs, and
    for another fingerprint unless `allow_mismatch`; `flag` says how the user allows it
    ("pass --allow-target-mismatch")."""
    ours = TargetRecord.of_model(target)
    made_from = f"target {recorded.name_or_path!r}" if recorded.name_or_path else "an unnamed target"
    compared = []
    for key, what in _SHAPES:
        theirs, mine = getattr(recorded, key), getattr(ours, key)
        if theirs is None or mine is None:
            continue
        if theirs != mine:
            show = (lambda v: "/".join(v)) if key == "architectures" else str
            raise ProvenanceError(
                f"{artifact} was made from {made_from} with {what} {show(theirs)}, but target {ours.name_or_path!r} "
                f"has {show(mine)}: it cannot serve this target (use the target it was made from)"
            )
        compared.append(what)
    if recorded.fingerprint is None:
        checked = f"compared only {', '.join(compared)}: they agree" if compared else "nothing could be compared"
        return f"note: {artifact} carries no draftsmith provenance (no target fingerprint); {checked}"
    if recorded.fingerprint == ours.fingerprint:
        return None
    mismatch = (
        f"{artifact} was made from {made_from} (fingerprint {recorded.fingerprint[:12]}), "
        f"not from target {ours.name_or_path!r} (fingerprint {ours.fingerprint[:12]})"
    )
    if allow_mismatch:
        return f"warning: {mismatch}; used anyway, as allowed for a fine-tune of that target"
    raise ProvenanceError(f"{mismatch}: use the target it was made from, or {flag} if this target is a fine-tune of it")
