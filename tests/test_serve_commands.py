"""`draftsmith export` and `draftsmith tune --write` print the vLLM and SGLang commands that serve
what they wrote: the JSON of `--speculative-config` parses, and every path in it is the folder
written (absolute) or the target; a printed conversion runs and writes the folder served."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import tiny_model
from lifecycle_helpers import toy_eval_args

from draftsmith.eval import sweep
from draftsmith.heads.eagle import EagleHead, save_eagle
from draftsmith.heads.medusa import MedusaHeads, save_medusa
from draftsmith.heads.models import load_causal_lm
from draftsmith.publish.serve import serving_commands


@pytest.fixture(scope="module")
def target(toy_dir):
    return load_causal_lm(toy_dir / "target", device="cpu", dtype=torch.float32, role="target")


def commands(stdout: str) -> list[list[str]]:
    """The printed commands (`    vllm serve ...`, `    python -m sglang...`, `    draftsmith export ...`) as argv."""
    starts = ("vllm serve ", "python -m sglang.launch_server ", "draftsmith export ")
    return [shlex.split(line.strip()) for line in stdout.splitlines() if line.strip().startswith(starts)]


def vllm_spec(argv: list[str]) -> tuple[str, dict]:
    assert argv[:2] == ["vllm", "serve"]
    return argv[2], json.loads(argv[argv.index("--speculative-config") + 1])


def sglang_args(argv: list[str]) -> dict:
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    return {argv[i]: argv[i + 1] for i in range(3, len(argv), 2)}


def test_export_eagle3_prints_commands_for_the_folder_written(tmp_path, run_cli, monkeypatch):
    deep = tiny_model("llama", layers=4)  # the servers read 3 aux layers below the last
    deep.save_pretrained(tmp_path / "target4")
    monkeypatch.chdir(tmp_path)  # the head records its target as a relative path; the commands say where it is
    head = EagleHead.for_target(deep, "eagle3", target_name_or_path="target4")
    head_dir = save_eagle(head, tmp_path / "head")
    out = tmp_path / "served" / "e3"
    code, stdout, err = run_cli(["export", head_dir, "--format", "vllm", "--num-speculative-tokens", 2, "--out", out])
    assert code == 0, err
    vllm, export, sglang = commands(stdout)
    served, spec = vllm_spec(vllm)
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 2}
    assert served == str((tmp_path / "target4").resolve()) and (Path(served) / "config.json").is_file()
    assert (Path(spec["model"]) / "config.json").is_file() and Path(spec["model"]).is_absolute()
    # SGLang reads another layout: the printed export converts, and its --out is the path served
    assert export[:2] == ["draftsmith", "export"] and export[export.index("--format") + 1] == "sglang"
    code, _, err = run_cli(export[1:])
    assert code == 0, err
    flags = sglang_args(sglang)
    assert flags["--speculative-draft-model-path"] == export[export.index("--out") + 1]
    assert json.loads((Path(flags["--speculative-draft-model-path"]) / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert (flags["--speculative-num-steps"], flags["--speculative-num-draft-tokens"]) == ("2", "3")  # K, K + 1
    assert flags["--model-path"] == served


def test_export_medusa_vllm_and_the_faster_decoding_layout(toy_dir, target, tmp_path, run_cli):
    heads = MedusaHeads.for_target(target, 3, 1, False, target_name_or_path="toy-org/target")
    heads_dir = save_medusa(heads, tmp_path / "heads")
    code, stdout, err = run_cli(["export", heads_dir, "--format", "vllm", "--out", tmp_path / "m-vllm"])
    assert code == 0, err
    (vllm,) = commands(stdout)
    served, spec = vllm_spec(vllm)
    assert served == "toy-org/target"  # a Hub id stays as recorded
    assert spec == {"method": "medusa", "model": str((tmp_path / "m-vllm").resolve()), "num_speculative_tokens": 3}
    assert "SGLang has no Medusa drafter" in stdout
    code, stdout, err = run_cli(["export", heads_dir, "--format", "medusa", "--out", tmp_path / "m-fd"])
    assert code == 0, err
    export, vllm = commands(stdout)
    code, _, err = run_cli(export[1:])  # FasterDecoding's layout -> vLLM's, as printed
    assert code == 0, err
    _, spec = vllm_spec(vllm)
    assert spec["model"] == export[export.index("--out") + 1]
    assert json.loads((Path(spec["model"]) / "config.json").read_text())["model_type"] == "medusa"


def test_draft_and_eagle1_and_what_tune_recorded(toy_dir, target, tmp_path):
    eagle1 = save_eagle(EagleHead.for_target(target, "eagle1"), tmp_path / "e1")
    served = serving_commands(eagle1)
    assert not served.vllm and not served.sglang and "EAGLE-1 head has no server layout" in served.text()
    draft = tmp_path / "draft"
    shutil.copytree(toy_dir / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config["draftsmith"] = {"speculation": {"num_speculative_tokens": 5, "kind": "chain"}}
    (draft / "config.json").write_text(json.dumps(config))
    served = serving_commands(draft, target=toy_dir / "target")
    target_path, spec = vllm_spec(shlex.split(served.vllm[0]))
    assert spec == {"method": "draft_model", "model": str(draft.resolve()), "num_speculative_tokens": 5}
    flags = sglang_args(shlex.split(served.sglang[0]))
    assert flags["--speculative-algorithm"] == "STANDALONE" and flags["--model-path"] == target_path
    assert flags["--speculative-draft-model-path"] == str(draft.resolve()) and flags["--speculative-num-steps"] == "5"


def test_tune_write_prints_the_serving_commands(toy_dir, tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr(sweep, "measure_verify_curve", lambda target, context, sizes, **_: {n: 1.0 for n in sizes})
    draft = tmp_path / "self-draft"
    shutil.copytree(toy_dir / "target", draft)  # the target drafting for itself: alpha = 1, K = k_max wins
    code, stdout, err = run_cli(
        toy_eval_args("tune", toy_dir, "--draft", draft, limit=2, max_new_tokens=6, extra=["--k-max", 2, "--write"])
    )
    assert code == 0, err
    vllm, sglang = commands(stdout)
    served, spec = vllm_spec(vllm)
    assert spec == {"method": "draft_model", "model": str(draft.resolve()), "num_speculative_tokens": 2}
    assert served == str((toy_dir / "target").resolve())
    assert sglang_args(sglang)["--speculative-num-draft-tokens"] == "3"
