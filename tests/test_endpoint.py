"""`draftsmith generate --endpoint`: data from an OpenAI-compatible server.

The server tests start `transformers serve` on the toy target (a subprocess on a free port, one
per module, plus one that is killed mid-run); the unit tests drive the backend with a recorded
server answer per request.
"""

import threading
import time

import pytest
from lifecycle_helpers import generate_cli_args

from draftsmith.distill import data as store
from draftsmith.distill.data import DistillData
from draftsmith.distill.endpoint import EndpointBackend, EndpointError, EndpointSettings, _normalise
from draftsmith.distill.generate import GenerateSettings, TurnRequest
from draftsmith.distill.local_server import free_port, launch_transformers_serve
from draftsmith.heads.models import load_tokenizer

SECRET = "sk-draftsmith-test-3b9f0c1e"


# --- the backend against recorded answers (no server) ------------------------------------------


class Recorded:
    """Stands in for EndpointClient: answers each POST with the next recorded JSON, keeps the bodies."""

    def __init__(self, answers, *, takes=("prompt_ids",)):
        self.settings = EndpointSettings(urls=("http://127.0.0.1:9",), reasoning="keep")
        self.model, self.answers, self.bodies, self.takes = "m", list(answers), [], takes

    def accepts(self, path, body):
        ok = ("prompt_ids" in self.takes and isinstance(body["prompt"], list) and len(body) == 3) or any(
            k in body for k in self.takes
        )
        return {"choices": [{"text": "x", "token_ids": [5] if "return_token_ids" in body else None}]} if ok else None

    def post(self, path, body, retry=True):
        self.bodies.append((path, body))
        return self.answers.pop(0)


@pytest.fixture(scope="module")
def tok(toy_dir):
    return load_tokenizer(toy_dir / "target")


def backend_for(client, tok, reasoning="keep", template=None):
    client.settings = EndpointSettings(urls=client.settings.urls, reasoning=reasoning)
    return EndpointBackend(client, tok, template, GenerateSettings(max_new_tokens=8, seed=3), [2])


def request(ids, messages=None, budget=8):
    return TurnRequest(ids, messages, None if messages else "text", budget, (4, 0, 1))


def test_server_token_ids_are_used_and_prompts_sent_as_ids(tok):
    client = Recorded(
        [{"choices": [{"text": "ab", "token_ids": [7, 8, 2, 9], "finish_reason": "stop"}]}],
        takes=("prompt_ids", "return_token_ids", "stop_token_ids"),
    )
    backend = backend_for(client, tok)
    assert backend.send == "ids" and backend.token_ids == "return_token_ids"
    [answer] = backend([request([1, 5, 6])])
    assert (answer.ids, answer.finish_reason, answer.token_source) == ([7, 8, 2], "stop", "server")
    path, body = client.bodies[-1]
    assert path == "/v1/completions" and body["prompt"] == [1, 5, 6] and body["stop_token_ids"] == [2]
    assert body["return_token_ids"] is True and body["temperature"] == 0.0 and isinstance(body["seed"], int)


def test_logprob_token_ids_and_retokenized_fallback(tok):
    chat = [{"role": "user", "content": "Hi"}]
    answers = [
        {
            "choices": [
                {
                    "message": {"content": "ab"},
                    "finish_reason": "length",
                    "logprobs": {"content": [{"token": "token_id:11"}, {"token": "token_id:12"}]},
                }
            ]
        },
        {"choices": [{"text": "hello", "finish_reason": "stop"}], "usage": {"completion_tokens": 99}},
    ]
    client = Recorded(answers, takes=())
    backend = backend_for(client, tok)
    backend.token_ids = "logprobs"  # what the probe finds on a server started with --return-tokens-as-token-ids
    first, second = backend([request([1], chat), request([1])])
    assert (first.ids, first.finish_reason, first.token_source) == ([11, 12], "length", "server")
    assert client.bodies[0][0] == "/v1/chat/completions" and client.bodies[0][1]["messages"] == chat
    # text only: retokenized, the stop token appended; 99 generated tokens != what the text holds
    assert second.ids == tok("hello", add_special_tokens=False).input_ids + [2] and second.finish_reason == "stop"
    assert second.token_source == "retokenized_inexact"


@pytest.mark.parametrize("mode", ["keep", "strip", "refuse"])
def test_reasoning_is_kept_stripped_or_refused(tok, mode):
    text = "<think>\nso</think>\n\nyes"
    client = Recorded([{"choices": [{"text": text, "finish_reason": "stop"}]}], takes=())
    [answer] = backend_for(client, tok, reasoning=mode)([request([1], budget=64)])
    if mode == "refuse":
        assert answer.refused == "reasoning_refused"
    else:
        kept = text if mode == "keep" else "yes"
        assert answer.ids == tok(kept, add_special_tokens=False).input_ids + [2] and answer.refused is None


def test_reasoning_apart_without_token_ids_cannot_be_kept(tok):
    answer = {"choices": [{"message": {"content": "yes", "reasoning_content": "so"}, "finish_reason": "stop"}]}
    with pytest.raises(EndpointError, match="separate field and no token ids"):
        backend_for(Recorded([answer], takes=()), tok)([request([1], [{"role": "user", "content": "Hi"}])])


def test_a_server_that_renders_the_prompt_otherwise_is_refused(tok):
    answer = {
        "choices": [{"text": "x", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    with pytest.raises(EndpointError, match="as 9 prompt tokens, the target's tokenizer and chat template as 3"):
        backend_for(Recorded([answer], takes=()), tok)([request([1, 5, 6])])


def test_normalise_cuts_at_the_first_stop_and_flags_length():
    assert _normalise([3, 2, 4], [], "stop", 8, {2}, 2).ids == [3, 2]
    cut = _normalise([3, 4, 5], [], "length", 2, {2}, 2)
    assert (cut.ids, cut.finish_reason) == ([3, 4], "length")


def test_streamed_text_is_retokenized_event_by_event(tok):
    # A target that wrote "    " as four one-space tokens: the whole text retokenizes to fewer.
    space = tok(" ", add_special_tokens=False).input_ids
    events = [{"choices": [{"text": " ", "finish_reason": None}]} for _ in range(4)]
    events.append({"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 4}})
    client = Recorded([{"chunks": events}], takes=())
    backend = backend_for(client, tok)
    assert backend.stream and client.bodies == []
    [answer] = backend([request([1], budget=4)])
    assert len(space) == 1 and len(tok("    ", add_special_tokens=False).input_ids) < 4
    assert (answer.ids, answer.finish_reason, answer.token_source, answer.generated) == (
        space * 4,
        "length",
        "retokenized",
        4,
    )
    assert client.bodies[0][1]["stream"] is True


def test_events_a_lagging_server_joined_are_flagged_inexact(tok):
    # The same four one-space tokens, sent by a server that fell behind as two events of two: their
    # split is lost (each "  " retokenizes to fewer tokens), and the count says so.
    space = tok(" ", add_special_tokens=False).input_ids
    assert len(tok("  ", add_special_tokens=False).input_ids) < 2
    events = [{"choices": [{"text": "  ", "finish_reason": None}]} for _ in range(2)]
    events.append({"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 4}})
    [answer] = backend_for(Recorded([{"chunks": events}], takes=()), tok)([request([1], budget=4)])
    assert answer.ids != space * 4 and (answer.token_source, answer.generated) == ("retokenized_inexact", 4)
    assert tok.decode(answer.ids) == tok.decode(space * 4)  # the text survives


def test_bad_endpoint_flags_and_a_down_endpoint_exit_2(run_cli, toy_dir, tmp_path, monkeypatch):
    base = generate_cli_args(toy_dir)
    code, _, err = run_cli(base + ["--out", tmp_path / "a", "--endpoint", "ftp://x"])
    assert code == 2 and "--endpoint 'ftp://x' is not an http(s) URL" in err
    down = f"http://127.0.0.1:{free_port()}"
    code, _, err = run_cli(base + ["--out", tmp_path / "b", "--endpoint", down, "--retries", "0"])
    assert code == 2 and f"endpoint {down} is down or unreachable" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delenv("DRAFTSMITH_NO_SUCH_KEY", raising=False)
    code, _, err = run_cli(
        base + ["--out", tmp_path / "c", "--endpoint", down, "--api-key-env", "DRAFTSMITH_NO_SUCH_KEY"]
    )
    assert code == 2 and "--api-key-env DRAFTSMITH_NO_SUCH_KEY: the environment variable is not set" in err
    assert not any((tmp_path / d).exists() for d in "abc")


# --- against `transformers serve` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(served_toy_paths, request):
    """The session's served toy target (conftest.py), and a second server of it that a test
    kills, started first: the two load in parallel."""
    doomed = launch_transformers_serve(served_toy_paths["target"], device="cpu", dtype="float32")
    try:
        paths, server = request.getfixturevalue("served_toy")
        yield paths, server, doomed.wait_ready()
    finally:
        doomed.stop()


def generate_args(paths, out, *extra):
    return [
        "generate",
        "--target",
        paths["target"],
        "--out",
        out,
        "--max-new-tokens",
        12,
        "--device",
        "cpu",
        "--no-progress",
        *extra,
    ]


@pytest.mark.slow
def test_generation_through_the_server_matches_local_prompts_and_text(served, run_cli, tmp_path, monkeypatch):
    paths, server, _ = served
    monkeypatch.setenv("DRAFTSMITH_TEST_KEY", SECRET)
    for prompts, template in ((paths["prompts"], "none"), (paths["chats"], "auto")):
        common = ["--prompts", prompts, "--limit", 4, "--chat-template", template, "--shard-size", 2]
        local_dir, remote_dir = tmp_path / f"local-{template}", tmp_path / f"remote-{template}"
        assert run_cli(generate_args(paths, local_dir, *common, "--batch-size", 4))[0] == 0
        code, out, err = run_cli(
            generate_args(
                paths,
                remote_dir,
                *common,
                "--endpoint",
                server.url,
                "--endpoint",
                server.url + "/v1",
                "--api-key-env",
                "DRAFTSMITH_TEST_KEY",
                "--concurrency",
                3,
            )
        )
        assert code == 0, err
        local, remote = DistillData(local_dir), DistillData(remote_dir)
        prov = remote.provenance
        assert (
            prov["generator"]["served_model"] == str(paths["target"].resolve())
            and prov["generator"]["api_key_env"] == "DRAFTSMITH_TEST_KEY"
        )
        assert prov["generator"]["prompts_sent_as"] == "text" and prov["endpoints"] == [server.url, server.url]
        assert prov["target"]["fingerprint"] == local.provenance["target"]["fingerprint"]
        assert prov["settings"] | {"batch_size": 4} == local.provenance["settings"] and len(remote) == len(local) == 4
        tok = load_tokenizer(paths["target"])
        same_prompt = 0
        for x, y in zip(local.dataset, remote.dataset):
            assert (x["record_index"], x["sample_index"], x["token_source"]) == (
                y["record_index"],
                y["sample_index"],
                "local",
            )
            assert y["token_source"] in ("retokenized", "retokenized_inexact")  # transformers serve returns text only
            p, q = x["prompt_length"], y["prompt_length"]
            if x["input_ids"][:p] != y["input_ids"][:q]:  # a later turn after a first answer cut differently
                assert x["num_turns"] > 1 or y["num_turns"] > 1
                continue
            same_prompt += 1
            assert y["loss_mask"][:q] == x["loss_mask"][:p] and set(y["loss_mask"][q:]) == {1}
            # the same greedy text; a retokenization longer than the budget is cut (mid-character at worst)
            mine = tok.decode(x["input_ids"][p:], skip_special_tokens=True)
            theirs = tok.decode(y["input_ids"][q:], skip_special_tokens=True)
            assert mine.startswith(theirs.rstrip("\ufffd")), (mine, theirs)
            if y["token_source"] == "retokenized":  # as many tokens as the server counted: its own ids
                assert y["input_ids"][q:] == x["input_ids"][p:] and y["finish_reason"] == x["finish_reason"]
        assert same_prompt >= 3
        assert remote.summary["token_sources"] and sum(remote.summary["token_sources"].values()) == 4
        remote.verify_hash()
        for path in remote_dir.rglob("*"):
            assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_wrong_model_is_one_line_naming_the_endpoint(served, run_cli, tmp_path):
    paths, server, _ = served
    code, _, err = run_cli(
        generate_args(
            paths,
            tmp_path / "d",
            "--prompts",
            paths["prompts"],
            "--endpoint",
            server.url,
            "--served-model",
            "org/other",
        )
    )
    assert (
        code == 2
        and f"endpoint {server.url} serves ['{paths['target'].resolve()}'], not 'org/other' (--served-model)" in err
    )
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


@pytest.mark.slow
def test_server_killed_mid_run_then_the_rerun_resumes(served, run_cli, tmp_path):
    from draftsmith.distill.jobs import GenerateJob, run_generate

    paths, server, doomed = served
    settings = GenerateSettings(max_new_tokens=40, shard_size=2)
    job = dict(
        target=str(paths["target"]),
        prompts=str(paths["prompts"]),
        settings=settings,
        limit=12,
        chat_template="none",
        device="cpu",
        progress=False,
    )
    out = tmp_path / "resumed"
    failure = []
    endpoint = EndpointSettings(urls=(doomed.url,), concurrency=1, retries=1, backoff=0.05)

    def run():
        try:
            run_generate(GenerateJob(out=str(out), endpoint=endpoint, **job))
        except EndpointError as err:
            failure.append(str(err))

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 120
    while not (out / store.SHARDS / store.shard_name(0)).is_dir() and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.02)
    doomed.kill()
    worker.join(timeout=120)
    assert failure and doomed.url in failure[0] and "rerun the same command to resume" in failure[0]
    done = len(store.complete_shards(out))
    assert 1 <= done < 6 and not (out / store.SUMMARY).exists()
    # the rerun (another server of the same model) finishes the folder; the data is an uninterrupted run's
    flags = ["--prompts", paths["prompts"], "--limit", 12, "--chat-template", "none", "--shard-size", 2]
    flags += ["--max-new-tokens", 40, "--endpoint", server.url]
    code, out_text, err = run_cli(generate_args(paths, out, *flags))
    assert code == 0, err
    assert f"resuming: {done} of 6 shards already complete" in out_text
    whole = tmp_path / "whole"
    assert run_cli(generate_args(paths, whole, *flags))[0] == 0
    # The same rows, prompts and answer texts as an uninterrupted run. Not always the same ids:
    # `transformers serve` returns text, and a stream that fell behind joins tokens' texts in one
    # event (see distill/endpoint.py), so a retokenized answer's ids vary with the server's load.
    resumed, uninterrupted = DistillData(out), DistillData(whole)
    resumed.verify_hash()
    assert len(resumed) == len(uninterrupted) == 12
    tok = load_tokenizer(paths["target"])
    for x, y in zip(resumed.dataset, uninterrupted.dataset):
        assert (x["record_index"], x["sample_index"]) == (y["record_index"], y["sample_index"])
        p = x["prompt_length"]
        assert p == y["prompt_length"] and x["input_ids"][:p] == y["input_ids"][:p]
        mine, theirs = (tok.decode(r["input_ids"][p:], skip_special_tokens=True) for r in (x, y))
        if "length" in (x["finish_reason"], y["finish_reason"]):  # cut at the budget: one may hold more
            mine, theirs = sorted((mine.rstrip("\ufffd"), theirs.rstrip("\ufffd")), key=len)
            assert theirs.startswith(mine), (mine, theirs)
        else:
            assert mine == theirs
        if x["token_source"] == y["token_source"] == "retokenized":  # both as many tokens as generated
            assert x["input_ids"] == y["input_ids"]
