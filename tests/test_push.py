"""`draftsmith push` / draftsmith.publish against a local stand-in of the Hub (no network).

The stand-in (`FakeHub`, http.server in a thread) answers the calls huggingface_hub makes for
`create_repo`, `repo_info`, `create_branch` and `upload_folder` without hf_xet: validate-yaml,
preupload (every file "regular", so contents arrive base64 in the commit's NDJSON) and commit.
Anything else is recorded as unexpected and answered 404, so a test fails if the client starts
calling something new.
"""

import base64
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
import yaml
from lifecycle_helpers import TOY_TRAINING, recipe_base, toy_eval_args

from draftsmith.heads.registry import get_method
from draftsmith.publish import HubError, check_repo_id, is_secret_key, model_card, push, scrub, stage_run

FAKE_TOKEN = "hf_" + "Zq7" * 12  # token-shaped, never a real one
TARGET_ID = "toy-org/toy-target"


# ---------------------------------------------------------------------- the stand-in Hub
class FakeHub:
    user = "toy-user"  # the namespace a bare NAME resolves to

    def __init__(self):
        self.repos = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.calls = []  # (method, path)
        self.auth = set()  # Authorization headers seen
        self.created = []  # create-repo payloads
        self.unexpected = []
        self.commits = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.handle(self, "GET")

            def do_POST(self):
                hub.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, req, method: str) -> None:
        path = unquote(urlsplit(req.path).path)
        body = req._body() if method == "POST" else b""
        self.calls.append((method, path))
        if req.headers.get("Authorization"):
            self.auth.add(req.headers["Authorization"])
        if method == "POST" and path == "/api/repos/create":
            payload = json.loads(body)
            self.created.append(payload)
            repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
            if repo_id in self.repos:
                return req._send(409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"})
            self.repos[repo_id] = {"private": payload.get("visibility") == "private", "branches": {"main": {}}}
            return req._send(200, {"url": f"{self.url}/{repo_id}", "name": repo_id})
        if method == "POST" and path == "/api/validate-yaml":
            # The Hub rejects a base_model that is not a model id (e.g. a local path).
            content = json.loads(body)["content"]
            meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
            base = (meta or {}).get("base_model")
            if base is not None and (not isinstance(base, str) or base.startswith(("/", ".", "~"))):
                return req._send(400, {"errors": [{"message": f'"base_model" with value "{base}" is not valid'}]})
            return req._send(200, {"errors": [], "warnings": []})
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(preupload|commit|branch)/(.+))?", path)
        repo = self.repos.get(match.group(1)) if match else None
        if match and repo is None:
            return req._send(404, {"error": "Repository not found"})
        if match and method == "GET" and match.group(2) is None:
            return req._send(200, {"id": match.group(1), "private": repo["private"], "sha": "0" * 40})
        if match and method == "POST" and match.group(2) == "preupload":
            files = json.loads(body)["files"]
            return req._send(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if match and method == "POST" and match.group(2) == "branch":
            if match.group(3) in repo["branches"]:
                return req._send(409, {"error": "branch exists"})
            repo["branches"][match.group(3)] = dict(repo["branches"]["main"])
            return req._send(200, {})
        if match and method == "POST" and match.group(2) == "commit":
            branch = repo["branches"].get(match.group(3))
            if branch is None:
                return req._send(404, {"error": f"Invalid rev id: {match.group(3)}"})
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    assert item["value"]["encoding"] == "base64"
                    branch[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] != "header":
                    self.unexpected.append(("commit item", item["key"]))
            self.commits += 1
            oid = f"{self.commits:040x}"
            return req._send(200, {"commitUrl": f"{self.url}/{match.group(1)}/commit/{oid}", "commitOid": oid})
        self.unexpected.append((method, path))
        return req._send(404, {"error": f"no route {method} {path}"})

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id]["branches"][branch]

    def unpack(self, repo_id: str, out: Path, branch: str = "main") -> Path:
        """The uploaded files as a folder (what `hf download` would give)."""
        for name, data in self.files(repo_id, branch).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        return out


@pytest.fixture
def hub(monkeypatch):
    """A running FakeHub; huggingface_hub online (the suite runs offline), without hf_xet, with a
    fake token in HF_TOKEN."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    fake = FakeHub()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()
    assert not fake.unexpected, f"huggingface_hub made calls the stand-in does not know: {fake.unexpected}"


# ---------------------------------------------------------------------- tiny runs
def _common(**extra):
    """`TOY_TRAINING` cut to 3 steps (1 of warm-up), every loss logged, on the CPU; `extra` on top."""
    return TOY_TRAINING | dict(device="cpu", max_steps=3, warmup_steps=1, log_every=1, eval_every=3) | extra


@pytest.fixture(scope="module")
def runs(toy_dir, toy_data, tmp_path_factory):
    """Real run folders of the three trainers on toy models (a few seconds in all): Medusa-1 with a
    `draftsmith eval` report in OUT/eval, Medusa-2 (LoRA adapter), EAGLE-3 on a 4-layer target
    (the vLLM layout needs three aux layers below the last), EAGLE-1 and a distilled draft."""
    from draftsmith.heads.toy import tiny_model, tiny_tokenizer
    from draftsmith.scripts.cli import main
    from draftsmith.train.draft import DraftRecipe
    from draftsmith.train.draft import train as train_draft
    from draftsmith.train.eagle import EagleRecipe
    from draftsmith.train.eagle import train as train_eagle
    from draftsmith.train.medusa import MedusaRecipe
    from draftsmith.train.medusa import train as train_medusa

    root = tmp_path_factory.mktemp("runs")
    target, data = str(toy_dir / "target"), str(toy_data)
    train_medusa(
        MedusaRecipe(target=target, data=data, out=str(root / "medusa"), num_heads=2, **_common()), progress=False
    )
    evaluate = toy_eval_args(
        "eval",
        toy_dir,
        *("--medusa", root / "medusa" / "heads"),
        target=target,
        limit=2,
        max_new_tokens=8,
        k=2,
        out=root / "medusa" / "eval",
    )
    assert main([str(a) for a in evaluate]) == 0
    train_medusa(
        MedusaRecipe(target=target, data=data, out=str(root / "medusa2"), mode="medusa2", num_heads=2, **_common()),
        progress=False,
    )
    train_eagle(
        EagleRecipe(target=target, data=data, out=str(root / "eagle1"), version="eagle1", eval_depth=2, **_common()),
        progress=False,
    )
    draft = DraftRecipe(
        target=target,
        data=data,
        out=str(root / "draft"),
        draft_path=str(toy_dir / "draft"),
        num_draft_tokens=3,
        **_common(),
    )
    train_draft(draft, progress=False)
    # A 4-layer target: EAGLE-3's default aux layers (1, 2, 3) are what vLLM and SGLang capture.
    deep = root / "target4"
    tiny_model("llama", layers=4).save_pretrained(deep)
    tiny_tokenizer().save_pretrained(deep)
    generate = [
        "generate",
        "--target",
        deep,
        "--prompts",
        toy_dir / "prompts.jsonl",
        "--limit",
        6,
        "--max-new-tokens",
        8,
        "--chat-template",
        "none",
        "--out",
        root / "data4",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main([str(a) for a in generate]) == 0
    eagle3 = EagleRecipe(
        target=str(deep),
        data=str(root / "data4"),
        out=str(root / "eagle3"),
        draft_vocab_size=64,
        ttt_steps=2,
        eval_depth=2,
        **_common(),
    )
    train_eagle(eagle3, progress=False)
    return root


def _card(files: dict):
    from huggingface_hub import ModelCard

    return ModelCard(files["README.md"].decode())


def _copy_run(runs: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs / name, tmp_path / name))


# ---------------------------------------------------------------------- what arrives
RUN_FILES = {"config.json", "model.safetensors", "README.md", "recipe.yaml", "run_info.json"}


def test_medusa_run_arrives_complete_and_loads(runs, hub, tmp_path):
    from draftsmith.heads.medusa import load_medusa

    url = push(runs / "medusa", "toy-org/medusa", endpoint=hub.url, base_model=TARGET_ID)
    assert url == f"{hub.url}/toy-org/medusa"
    files = hub.files("toy-org/medusa")
    assert set(files) == RUN_FILES
    config = json.loads(files["config.json"])
    assert config["model_type"] == "medusa" and config["num_heads"] == 2  # vLLM's layout by default
    pushed = load_medusa(hub.unpack("toy-org/medusa", tmp_path))
    trained = load_medusa(runs / "medusa" / "heads")
    assert all(
        torch.equal(a, b) for a, b in zip(trained.state_dict().values(), pushed.state_dict().values(), strict=True)
    )

    card = _card(files)
    data_hash = json.loads((runs / "medusa" / "heads" / "config.json").read_text())["data_hash"]
    fingerprint = json.loads((runs / "medusa" / "heads" / "config.json").read_text())["target_fingerprint"]
    assert card.data.base_model == TARGET_ID and {"speculative-decoding", "medusa", "medusa1"} <= set(card.data.tags)
    text = card.text
    assert data_hash in text and fingerprint in text and "Medusa-1" in text
    assert (
        f"vllm serve {TARGET_ID} --speculative-config" in text
        and '"method": "medusa", "model": "toy-org/medusa"' in text
    )
    assert "SGLang has no Medusa drafter" in text
    # The run's OUT/eval/report.json is found: its tau and alpha are in the card.
    report = json.loads((runs / "medusa" / "eval" / "report.json").read_text())
    row = next(r for r in report["methods"] if r["method"] == "medusa-chain")
    assert f"| medusa-chain | {row['alpha']:.2f} | {row['acceptance_rate']:.2f} | {row['tau']:.2f} |" in text
    assert "counts the bonus token" in text and "Not evaluated" not in text
    assert '"num_speculative_tokens": 2' in text  # the K it was evaluated at
    assert yaml.safe_load(files["recipe.yaml"])["num_heads"] == 2


def test_eagle3_run_arrives_in_the_vllm_layout(runs, hub, tmp_path):
    from draftsmith.heads.eagle import load_eagle

    push(runs / "eagle3", "toy-org/eagle3", endpoint=hub.url)
    files = hub.files("toy-org/eagle3")
    assert set(files) == RUN_FILES
    config = json.loads(files["config.json"])
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    pushed = load_eagle(hub.unpack("toy-org/eagle3", tmp_path))
    assert pushed.config.draft_vocab_size == 64
    card = _card(files)
    # The target was a local folder: no base_model (the Hub rejects paths there); the card says why.
    assert card.data.base_model is None and {"eagle", "eagle3", "vllm"} <= set(card.data.tags)
    text = card.text
    assert str(runs / "target4") in text and "--base-model ORG/NAME" in text
    assert '"method": "eagle3", "model": "toy-org/eagle3"' in text
    assert "--speculative-algorithm EAGLE3" in text and "draftsmith export eagle3 --format sglang" in text
    assert (
        "Not evaluated with `draftsmith eval` yet" in text
        and f"draftsmith eval --target {runs / 'target4'} --drafter eagle=eagle3" in text
    )
    assert json.loads((runs / "data4" / "summary.json").read_text())["data_hash"] in text


def test_draft_run_arrives_with_its_tokenizer(runs, hub, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A run whose target is a Hub id: base_model comes from the recipe.
    run = _copy_run(runs, "draft", tmp_path)
    recipe = json.loads((run / "recipe.json").read_text())
    (run / "recipe.json").write_text(json.dumps({**recipe, "target": TARGET_ID}))
    push(run, "toy-org/draft", endpoint=hub.url, revision="dev")
    files = hub.files("toy-org/draft", "dev")
    draft_files = {p.name for p in (runs / "draft" / "draft").iterdir()}
    assert "tokenizer.json" in draft_files and set(files) == draft_files | {"README.md", "recipe.yaml", "run_info.json"}
    assert hub.files("toy-org/draft", "main") == {}  # only the branch was written
    out = hub.unpack("toy-org/draft", tmp_path / "pulled", "dev")
    pushed, trained = (
        AutoModelForCausalLM.from_pretrained(out),
        AutoModelForCausalLM.from_pretrained(runs / "draft" / "draft"),
    )
    assert all(
        torch.equal(a, b) for a, b in zip(trained.state_dict().values(), pushed.state_dict().values(), strict=True)
    )
    assert (
        AutoTokenizer.from_pretrained(out).get_vocab()
        == AutoTokenizer.from_pretrained(runs / "draft" / "draft").get_vocab()
    )
    card = _card(files)
    assert (
        card.data.base_model == TARGET_ID
        and card.data.pipeline_tag == "text-generation"
        and "draft-model" in card.data.tags
    )
    assert (
        '"method": "draft_model", "model": "toy-org/draft", "num_speculative_tokens": 3, "revision": "dev"' in card.text
    )
    assert (
        "--speculative-algorithm STANDALONE --speculative-draft-model-path toy-org/draft --speculative-draft-model-revision dev"
        in card.text
    )


def test_token_never_leaves_in_files_or_output(runs, hub, tmp_path, capfd):
    run = _copy_run(runs, "medusa", tmp_path)
    recipe = json.loads((run / "recipe.json").read_text())
    (run / "recipe.json").write_text(json.dumps({**recipe, "hub_token": FAKE_TOKEN, "pad_token_id": 0}))
    info = json.loads((run / "run_info.json").read_text())
    info["command"] = [
        "train/medusa.py",
        "--recipe",
        "r.yaml",
        f"hub_token={FAKE_TOKEN}",
        "--hf-token",
        FAKE_TOKEN,
        "max_new_tokens=8",
        "--wandb-api-key",
        "k3y-value",
        "api_key=other-k3y",
    ]
    info["recipe"]["hub_token"] = FAKE_TOKEN
    (run / "run_info.json").write_text(json.dumps(info))
    push(run, "toy-org/secret", endpoint=hub.url)
    assert hub.auth == {f"Bearer {FAKE_TOKEN}"}  # the token was used ...
    files = hub.files("toy-org/secret")
    assert not [name for name, data in files.items() if FAKE_TOKEN.encode() in data]  # ... and stored nowhere
    out, err = capfd.readouterr()
    assert FAKE_TOKEN not in out + err
    pushed_recipe = yaml.safe_load(files["recipe.yaml"])
    assert "hub_token" not in pushed_recipe and pushed_recipe["pad_token_id"] == 0  # vocabulary keys stay
    command = json.loads(files["run_info.json"])["command"]
    assert command[3:] == [
        "hub_token=<redacted>",
        "--hf-token",
        "<redacted>",
        "max_new_tokens=8",
        "--wandb-api-key",
        "<redacted>",
        "api_key=<redacted>",
    ]


def test_secret_keys_and_scrub():
    for key in (
        "token",
        "hub_token",
        "hf_token",
        "use_auth_token",
        "HF-Token",
        "api_key",
        "wandb_api_key",
        "client_secret",
    ):
        assert is_secret_key(key), key
    for key in (
        "pad_token",
        "eos_token_id",
        "bos_token",
        "max_new_tokens",
        "tokenizer",
        "token_map",
        "num_draft_tokens",
        "add_bos_token",
    ):
        assert not is_secret_key(key), key
    assert scrub({"a": [f"x {FAKE_TOKEN} y"], "b": {"token": "t"}}) == {"a": ["x <redacted> y"], "b": {}}
    assert scrub("with s3cr3t-value", ("s3cr3t-value",)) == "with <redacted>"


def test_private_reaches_the_create_call_and_is_not_silently_dropped(runs, hub, monkeypatch):
    push(runs / "medusa", "toy-org/hidden", endpoint=hub.url, private=True)
    push(runs / "medusa", "toy-org/shown", endpoint=hub.url)
    assert [p.get("visibility") for p in hub.created] == ["private", "public"]
    assert hub.repos["toy-org/hidden"]["private"] and not hub.repos["toy-org/shown"]["private"]
    # A bare NAME lands in the token owner's namespace; the endpoint may come from HF_ENDPOINT.
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    assert push(runs / "medusa", "bare-name") == f"{hub.url}/{FakeHub.user}/bare-name"
    # private=True into an existing public repo: refused before anything is uploaded.
    commits = hub.commits
    with pytest.raises(HubError, match="toy-org/shown already exists and is public"):
        push(runs / "medusa", "toy-org/shown", endpoint=hub.url, private=True)
    assert hub.commits == commits


def test_hub_errors_are_one_clear_message(runs, hub):
    # A commit to a revision the repo does not have: the Hub's answer, in one line, without the token.
    with pytest.raises(HubError, match="pushing to toy-org/rev .* failed: .*Invalid rev id: refs/pr/7") as info:
        push(runs / "medusa", "toy-org/rev", endpoint=hub.url, revision="refs/pr/7")
    assert FAKE_TOKEN not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(HubError, match="pushing to toy-org/down at http://127.0.0.1:9 failed"):
        push(runs / "medusa", "toy-org/down", endpoint="http://127.0.0.1:9")


# ---------------------------------------------------------------------- bad input: clear errors, nothing sent
def test_bad_input_is_a_clear_error_before_any_network_call(runs, hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a run")
    with pytest.raises(HubError, match="neither a draftsmith run folder .* nor an artifact folder"):
        push(stray, "toy-org/x", endpoint=hub.url)
    with pytest.raises(HubError, match="does not exist"):
        push(tmp_path / "missing", "toy-org/x", endpoint=hub.url)
    pickled = _copy_run(runs, "draft", tmp_path)
    torch.save({"w": torch.zeros(2)}, pickled / "draft" / "pytorch_model.bin")
    with pytest.raises(HubError, match=r"holds pickle weights \(pytorch_model.bin\): only safetensors are pushed"):
        push(pickled, "toy-org/x", endpoint=hub.url)
    for bad in (
        "a/b/c",
        "-lead",
        "org/trail.",
        "org/na..me",
        "org/a--b",
        "",
        "org/",
        "sp ace",
        "x" * 97,
        "org/name.git",
    ):
        with pytest.raises(HubError, match="repo id .*expected NAME or ORG/NAME"):
            push(runs / "medusa", bad, endpoint=hub.url)
    with pytest.raises(HubError, match="base model '/local/target': expected the target's Hub id as ORG/NAME"):
        push(runs / "medusa", "toy-org/x", endpoint=hub.url, base_model="/local/target")
    with pytest.raises(HubError, match="format 'sglang': expected one of vllm, medusa, hf for the Medusa-1 heads"):
        push(runs / "medusa", "toy-org/x", endpoint=hub.url, format="sglang")
    with pytest.raises(HubError, match="format 'vllm': expected one of hf for the EAGLE-1 head"):
        push(runs / "eagle1", "toy-org/x", endpoint=hub.url, format="vllm")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"methods": []}))
    with pytest.raises(HubError, match="eval report .*report.json.*expected a 'methods' list"):
        push(runs / "medusa", "toy-org/x", endpoint=hub.url, eval_report=report)
    # No token anywhere (env, stored login): said before anything is staged or sent.
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    with pytest.raises(HubError, match="no Hugging Face token: set HF_TOKEN, run `hf auth login`"):
        push(runs / "medusa", "toy-org/x", endpoint=hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        push(runs / "medusa", "toy-org/x", endpoint=hub.url, token=FAKE_TOKEN)
    assert hub.calls == []


def test_eagle3_on_a_two_layer_target_has_no_server_layout(tmp_path, toy_dir, toy_data):
    from draftsmith.train.eagle import EagleRecipe, train

    out = tmp_path / "e3"
    values = recipe_base(toy_dir / "target", toy_data, out, **_common(draft_vocab_size=64, ttt_steps=2, eval_depth=2))
    train(EagleRecipe(**values), progress=False)
    with pytest.raises(HubError, match="exactly 3 aux hidden states.*push with format 'hf'"):
        stage_run(out, tmp_path / "staged", repo_id="toy-org/x")
    assert not (tmp_path / "staged").exists()  # nothing half-written
    staged = stage_run(out, tmp_path / "staged", repo_id="toy-org/x", format="hf")
    assert json.loads((staged / "config.json").read_text())["model_type"] == "draftsmith_eagle"


# ---------------------------------------------------------------------- staging and the card
def test_staging_layouts_and_replacing_an_earlier_staging(runs, tmp_path):
    from draftsmith.heads.eagle import load_eagle

    staged = stage_run(runs / "eagle3", tmp_path / "s", repo_id="toy-org/e3", format="sglang")
    config = json.loads((staged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and load_eagle(staged).config.aux_layer_ids == [
        1,
        2,
        3,
    ]
    text = (staged / "README.md").read_text()
    assert (
        "--speculative-draft-model-path toy-org/e3 --speculative-num-steps 3" in text
        and "draftsmith export e3 --format vllm" in text
    )
    # A second dry run into the same folder replaces the first; any other non-empty folder is refused.
    staged = stage_run(runs / "medusa", tmp_path / "s", repo_id="toy-org/m", format="medusa")
    assert {p.name for p in staged.iterdir()} == {
        "config.json",
        "medusa_lm_head.safetensors",
        "README.md",
        "recipe.yaml",
        "run_info.json",
    }
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(HubError, match="is not empty"):
        stage_run(runs / "medusa", tmp_path / "busy", repo_id="toy-org/m")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    # A bare artifact folder inside a run is the run; an exported folder elsewhere stands alone.
    bare = stage_run(runs / "medusa" / "heads", tmp_path / "bare", repo_id="toy-org/m")
    assert (bare / "recipe.yaml").is_file()
    alone = stage_run(staged, tmp_path / "alone", repo_id="toy-org/m")
    assert {p.name for p in alone.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert "No run folder came with these weights" in (alone / "README.md").read_text()


def test_medusa2_pushes_its_adapter_and_says_to_merge_it(runs, tmp_path):
    staged = stage_run(runs / "medusa2", tmp_path / "s", repo_id="toy-org/m2")
    assert {p.name for p in (staged / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    text = (staged / "README.md").read_text()
    assert "Medusa-2" in text and "merge_adapter" in text and "KL drift" in text
    assert "vllm serve m2-target --speculative-config" in text


def test_model_card_parses_and_explains_an_eagle1_head(runs):
    from huggingface_hub import ModelCard

    card = ModelCard(model_card(runs / "eagle1", repo_id="toy-org/e1", format=None, base_model=TARGET_ID))
    assert card.data.base_model == TARGET_ID and card.data.library_name == "draftsmith"
    assert {"eagle", "eagle1", "speculative-decoding"} <= set(card.data.tags)
    assert "EAGLE-1" in card.text and "vLLM and SGLang do not load" in card.text and "load_eagle" in card.text
    with pytest.raises(HubError, match="repo id 'a/b/c'"):
        model_card(runs / "eagle1", repo_id="a/b/c", format=None)
    assert check_repo_id("toy-org/Name_1.0") == "toy-org/Name_1.0"


def test_card_metadata_carries_license_datasets_and_the_evaluation(runs, toy_dir, tmp_path):
    """The YAML front matter: the target's license read off its own model card, the prompts' Hub
    dataset, and the `draftsmith eval` results of this drafter as model-index."""
    from huggingface_hub import ModelCard

    run = _copy_run(runs, "medusa", tmp_path)
    target = Path(shutil.copytree(toy_dir / "target", tmp_path / "target"))
    (target / "README.md").write_text(
        "---\nlicense: other\nlicense_name: toy-license\nlicense_link: LICENSE\n---\n# toy\n"
    )
    config = json.loads((run / "heads" / "config.json").read_text())
    config["target_name_or_path"] = str(target)
    (run / "heads" / "config.json").write_text(json.dumps(config))
    data = tmp_path / "data"  # the data's provenance names a Hub dataset as its prompt source
    data.mkdir()
    recipe = json.loads((run / "recipe.json").read_text())
    provenance = json.loads((Path(recipe["data"]) / "provenance.json").read_text())
    provenance["source"]["name"] = "toy-org/prompts"
    (data / "provenance.json").write_text(json.dumps(provenance))
    shutil.copy(Path(recipe["data"]) / "summary.json", data / "summary.json")
    (run / "recipe.json").write_text(json.dumps({**recipe, "data": str(data)}))

    card = ModelCard(model_card(run, repo_id="toy-org/medusa", format=None))
    meta = card.data.to_dict()
    assert (meta["license"], meta["license_name"], meta["license_link"]) == ("other", "toy-license", "LICENSE")
    assert meta["datasets"] == ["toy-org/prompts"]
    report = json.loads((run / "eval" / "report.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    (index,) = meta["model-index"]
    assert index["name"] == "medusa"
    results = {r["task"]["name"]: r for r in index["results"]}
    assert set(results) == {f"speculative decoding ({m})" for m in rows if m.startswith("medusa-")}
    chain = results["speculative decoding (medusa-chain)"]
    assert chain["dataset"] == {"name": "prompts.jsonl", "type": "json"}
    metrics = {m["type"]: m for m in chain["metrics"]}
    assert metrics["mean_accepted_length"]["value"] == pytest.approx(rows["medusa-chain"]["tau"], abs=1e-4)
    assert metrics["acceptance_rate"]["value"] == pytest.approx(rows["medusa-chain"]["alpha"], abs=1e-4)
    assert metrics["speedup"]["value"] == pytest.approx(rows["medusa-chain"]["speedup"], abs=1e-4)
    assert metrics["mean_accepted_length"]["config"] == f"K={report['settings']['num_draft_tokens']}, temperature=0.00"
    assert "| license | `other` |" in card.text
    # --license wins over the target's card; an unevaluated run has no model-index
    card = ModelCard(model_card(runs / "eagle1", repo_id="toy-org/e1", format=None, license="apache-2.0"))
    assert card.data.license == "apache-2.0" and card.data.eval_results is None
    assert "license" not in ModelCard(model_card(runs / "eagle1", repo_id="toy-org/e1", format=None)).data.to_dict()


# ---------------------------------------------------------------------- the command
def test_cli_dry_run_push_and_errors(runs, hub, tmp_path, run_cli):
    code, out, err = run_cli(
        ["push", runs / "eagle3", "--repo-id", "toy-org/e3", "--dry-run", "--out", tmp_path / "staged"]
    )
    assert code == 0, err
    assert "staged 5 files for toy-org/e3" in out and "nothing pushed" in out and "not evaluated" in out
    assert f"--out {runs / 'eagle3' / 'eval'}" in out  # the command that fills RUN/eval/report.json
    assert hub.calls == [] and (tmp_path / "staged" / "model.safetensors").is_file()

    # --eval-report wins over RUN/eval/report.json (here: the run's report with tau edited to 3.21).
    report = json.loads((runs / "medusa" / "eval" / "report.json").read_text())
    next(r for r in report["methods"] if r["method"] == "medusa-chain")["tau"] = 3.21
    (tmp_path / "report.json").write_text(json.dumps(report))
    code, out, err = run_cli(
        [
            "push",
            runs / "medusa",
            "--repo-id",
            "toy-org/m",
            "--endpoint",
            hub.url,
            "--private",
            "--eval-report",
            tmp_path / "report.json",
        ]
    )
    assert code == 0, err
    assert f"pushed {runs / 'medusa'} to {hub.url}/toy-org/m" in out and "not evaluated" not in out
    assert hub.created[-1]["visibility"] == "private" and FAKE_TOKEN not in out + err
    assert "| medusa-chain | " in (card := hub.files("toy-org/m")["README.md"].decode()) and " 3.21 |" in card

    for args, message in (
        (["--repo-id", "a/b/c"], "repo id 'a/b/c': expected NAME or ORG/NAME"),
        (["--repo-id", "toy-org/x", "--dry-run"], "--dry-run writes what would be pushed to --out DIR"),
        (["--repo-id", "toy-org/x", "--out", tmp_path / "o"], "--out applies to --dry-run"),
        (
            ["--repo-id", "toy-org/x", "--format", "onnx", "--dry-run", "--out", tmp_path / "o"],
            "format 'onnx': expected one of vllm, sglang, hf for the EAGLE-3 head",
        ),
        (["--repo-id", "toy-org/x", "--eval-report", tmp_path / "report.json"], "measured medusa="),
    ):
        code, out, err = run_cli(["push", runs / "eagle3", *args])
        assert code == 2 and err.startswith("draftsmith push: error: ") and message in err and err.count("\n") == 1, err
    assert hub.commits == 1  # only the one good push went through


def test_unfinished_run_is_named(tmp_path, runs):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs / "medusa" / "recipe.json", run / "recipe.json")
    with pytest.raises(
        HubError, match="has no heads/, head/ or draft/ with a config.json: its training has not finished"
    ):
        stage_run(run, tmp_path / "s", repo_id="toy-org/x")


def test_a_recipe_with_push_to_hub_pushes_when_training_ends(toy_dir, toy_data, hub, tmp_path, monkeypatch):
    from draftsmith.train.medusa import main as medusa_main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    values = _common(
        target=str(toy_dir / "target"),
        data=str(toy_data),
        out=str(out),
        num_heads=2,
        push_to_hub=True,
        hub_repo_id="toy-org/pushed",
        hub_private=True,
    )
    recipe.write_text(yaml.safe_dump(values))
    assert medusa_main(["--recipe", str(recipe), "--no-progress"]) == 0
    files = hub.files("toy-org/pushed")
    assert "README.md" in files and "config.json" in files and any(name.endswith(".safetensors") for name in files)
    assert hub.repos["toy-org/pushed"]["private"] is True
    assert yaml.safe_load(files["recipe.yaml"])["hub_repo_id"] == "toy-org/pushed"


# ---------------------------------------------------------------------- the one-pass heads: P-EAGLE, DFlash
@pytest.fixture(scope="module")
def onepass(runs):
    """P-EAGLE and DFlash runs on the 4-layer target of `runs` (their aux layers below its last, as
    servers capture them): a few steps each."""
    from draftsmith.train.dflash import DFlashRecipe
    from draftsmith.train.dflash import train as train_dflash
    from draftsmith.train.peagle import PEagleRecipe
    from draftsmith.train.peagle import train as train_peagle

    shared = dict(target=str(runs / "target4"), data=str(runs / "data4"), draft_vocab_size=64, max_anchors=8)
    train_peagle(PEagleRecipe(out=str(runs / "peagle"), num_depths=3, **shared, **_common()), progress=False)
    train_dflash(DFlashRecipe(out=str(runs / "dflash"), block_size=4, **shared, **_common()), progress=False)
    return runs


def test_dflash_run_arrives_in_the_vllm_layout_and_loads(onepass, hub, tmp_path):
    from draftsmith.heads.dflash_formats import load_dflash
    from draftsmith.heads.models import load_causal_lm

    push(onepass / "dflash", "toy-org/dflash", endpoint=hub.url)
    files = hub.files("toy-org/dflash")
    assert set(files) == RUN_FILES
    config = json.loads(files["config.json"])
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    target = load_causal_lm(onepass / "target4", device=torch.device("cpu"), dtype=torch.float32, role="target")
    pushed = load_dflash(hub.unpack("toy-org/dflash", tmp_path), target=target).state_dict()
    trained = load_dflash(onepass / "dflash" / "head", target=target).state_dict()
    assert set(pushed) == set(trained) and all(torch.equal(pushed[k], trained[k]) for k in trained)
    card = _card(files)
    assert {"dflash", "vllm", "speculative-decoding"} <= set(card.data.tags) and card.data.library_name == "draftsmith"
    text = card.text
    assert f"{get_method('dflash').title} for speculative decoding with" in text and "block of 4 slots" in text
    # one block drafts block_size - 1 = 3 tokens: K in the command
    assert '"method": "dflash", "model": "toy-org/dflash", "num_speculative_tokens": 3' in text
    assert "draftsmith writes no SGLang layout of a DFlash head" in text
    assert f"--drafter dflash={'dflash'}" in text and "from draftsmith.heads.dflash_formats import load_dflash" in text
    assert "| `block_size` | 4 |" in text and "top-1 accuracy per block slot" in text
    assert "draftsmith train dflash" in text and "Retrain: draftsmith train dflash" in files["recipe.yaml"].decode()


def test_peagle_run_arrives_in_the_vllm_layout_and_loads(onepass, hub, tmp_path):
    from draftsmith.heads.eagle import PEagleHead, load_eagle

    push(onepass / "peagle", "toy-org/peagle", endpoint=hub.url)
    files = hub.files("toy-org/peagle")
    assert set(files) == RUN_FILES
    config = json.loads(files["config.json"])
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleDraftModel"]
    pushed = load_eagle(hub.unpack("toy-org/peagle", tmp_path))
    trained = load_eagle(onepass / "peagle" / "head")
    assert isinstance(pushed, PEagleHead)
    assert all(torch.equal(pushed.state_dict()[k], v) for k, v in trained.state_dict().items())
    card = _card(files)
    assert {"peagle", "vllm"} <= set(card.data.tags) and "eagle" not in card.data.tags  # its own kind
    text = card.text
    assert f"{get_method('peagle').title} for speculative decoding" in text and "3 trained depths" in text
    assert '"method": "eagle3", "model": "toy-org/peagle", "num_speculative_tokens": 3' in text
    assert '"parallel_drafting": true' in text and "draftsmith writes no SGLang layout of a P-EAGLE head" in text
    assert "--drafter peagle=peagle" in text and "top-1 accuracy per depth" in text


def test_onepass_heads_push_their_draftsmith_layout_and_refuse_sglang(onepass, tmp_path):
    for kind in ("dflash", "peagle"):
        title = get_method(kind).title
        staged = stage_run(onepass / kind, tmp_path / kind, repo_id=f"toy-org/{kind}", format="hf")
        assert json.loads((staged / "config.json").read_text())["model_type"] == f"draftsmith_{kind}"
        text = (staged / "README.md").read_text()
        assert f"draftsmith export {kind} --format vllm --num-speculative-tokens 3 --out {kind}-vllm" in text
        with pytest.raises(HubError, match=f"format 'sglang': expected one of vllm, hf for the {title}"):
            stage_run(onepass / kind, tmp_path / f"{kind}-sglang", repo_id="toy-org/x", format="sglang")
        assert not (tmp_path / f"{kind}-sglang").exists()
