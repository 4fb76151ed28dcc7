"""Push a trained drafter to the Hugging Face Hub, with a model card generated from its run.

    draftsmith push runs/my-run --repo-id me/llama-3.1-8b-drafter --private     # the layout a server loads
    draftsmith push runs/my-run --repo-id me/llama-3.1-8b-drafter --format hf   # the draftsmith layout
    draftsmith push runs/my-run --repo-id me/llama-3.1-8b-drafter --dry-run --out staged   # write, push nothing

    from draftsmith.publish import push, stage_run
    url = push("runs/my-run", "me/llama-3.1-8b-drafter", private=True)

One module per step, every method taken from the registry (draftsmith.heads.registry.METHODS):
- artifacts.py: what is being pushed (`find_artifact`: a run folder with the sub-folder its trainer
  writes, or a bare drafter folder; `artifact_kind` is the registry's `method_of_config`), its layout
  (`resolve_format`: the method's `export_formats`, the first by default, what a server loads; "hf"
  is the draftsmith layout), the repo id, and the run's `draftsmith eval` report;
- scrub.py: credentials out of the recipe and run info, and a last check of the staged files;
- stage.py: `stage_run` writes what would be pushed (the weights by the method's exporter, safetensors
  only; recipe.yaml, run_info.json, README.md) in a temporary folder and renames it into place;
- card.py + card.md.j2: `model_card`, the README.md: target (name, revision, fingerprint), data
  provenance, training, the `draftsmith eval` results when the run has them, and the commands
  that serve the drafter with vLLM and SGLang;
- push.py: `push` uploads a staging; the Hub's errors come back as one `HubError` line.

The token comes from the argument or huggingface_hub's usual sources (HF_TOKEN, `hf auth login`);
it is never printed and never written into a pushed file.
"""

from draftsmith.publish.artifacts import (
    Artifact,
    HubError,
    artifact_kind,
    check_repo_id,
    find_artifact,
    find_eval_report,
    load_eval_report,
    local_eval_command,
    resolve_format,
    serving_tokens,
)
from draftsmith.publish.card import model_card
from draftsmith.publish.push import push
from draftsmith.publish.scrub import is_secret_key, scrub
from draftsmith.publish.stage import stage_run

__all__ = [
    "Artifact",
    "HubError",
    "artifact_kind",
    "check_repo_id",
    "find_artifact",
    "find_eval_report",
    "is_secret_key",
    "load_eval_report",
    "local_eval_command",
    "model_card",
    "push",
    "resolve_format",
    "scrub",
    "serving_tokens",
    "stage_run",
]
