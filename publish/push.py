"""Upload a staged run to the Hub, and say in one line what the Hub answered when it fails."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from draftsmith.publish.artifacts import HubError, check_repo_id, find_artifact
from draftsmith.publish.scrub import scrub_text
from draftsmith.publish.stage import stage_run


def push(run_dir, repo_id, *, private=False, token=None, endpoint=None, commit_message=None, **staging) -> str:
    """Stage `run_dir` (`stage_run`, with `staging`: its format, eval_report, revision, base_model and
    license) and upload it to the Hub model repo `repo_id`; return its URL.

    The repo is created when missing (`private` applies to a new repo; pushing with
    private=True into an existing public repo is refused). `token`: the argument, else HF_TOKEN
    or the stored login. `endpoint`: the argument, else HF_ENDPOINT, else the Hub. `revision`: a
    branch, created from main when missing."""
    check_repo_id(repo_id)
    revision = staging.get("revision")
    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE is set: unset it to push to the Hub")
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass token=")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    tmp = Path(tempfile.mkdtemp(prefix="draftsmith-push-"))
    try:
        folder = stage_run(run_dir, tmp / "stage", repo_id=repo_id, _secrets=(token,), **staging)
        if commit_message is None:
            artifact = find_artifact(run_dir)
            steps = artifact.summary.get("steps")
            commit_message = f"draftsmith: {artifact.title}" + (f", {steps} steps" if steps else "")
        api = HfApi(endpoint=endpoint, token=token)
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            repo = url.repo_id  # NAME alone resolves to the token owner's namespace
            if private and api.repo_info(repo, repo_type="model").private is False:
                raise HubError(
                    f"{repo} already exists and is public: private=True does not change an existing repo. Make it "
                    "private on the Hub first, or push to a new repo id. Nothing was uploaded."
                )
            if revision and not revision.startswith("refs/"):
                api.create_branch(repo, branch=revision, exist_ok=True, repo_type="model")
            api.upload_folder(
                repo_id=repo,
                folder_path=str(folder),
                commit_message=commit_message,
                revision=revision,
                repo_type="model",
            )
        except HubError:
            raise
        except Exception as err:  # the Hub's HTTP errors, connection errors, a rejected card
            if not _is_hub_failure(err):
                raise
            raise HubError(f"pushing to {repo_id} at {endpoint} failed: {_hub_message(err, (token,))}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    page = f"{endpoint}/{repo}"
    return f"{page}/tree/{revision}" if revision else page


def _is_hub_failure(err: Exception) -> bool:
    """Errors of the network and the Hub (not bugs): HTTP status errors, connection errors (of
    whichever HTTP library this huggingface_hub uses), invalid card metadata, offline mode."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, (HfHubHTTPError, OfflineModeIsEnabled, OSError)):
        return True
    if type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
        return True
    return isinstance(err, ValueError) and "README.md" in str(err)


def _hub_message(err: Exception, secrets: tuple[str, ...]) -> str:
    """One line: the error's first line and what the Hub said (its server message)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    server = getattr(err, "server_message", None)
    if server and server.strip() and server.strip() not in text:
        text += f" ({' '.join(server.split())})"
    elif "README.md" in text and len(lines) > 1:
        text += " " + " ".join(lines[1:])
    return scrub_text(text, secrets)
