"""Self-distillation data from serving engines: an OpenAI-compatible endpoint answers instead
of a target loaded in this process (vLLM, SGLang, TGI, `transformers serve`).

    draftsmith generate --target DIR --prompts SRC --out DIR --endpoint http://host:8000 \\
                        [--endpoint http://host2:8000] [--served-model NAME] [--api-key-env VAR] \\
                        [--concurrency 8] [--send auto|ids|text] [--reasoning keep|strip|refuse]

The endpoint is one more backend of `distill/generate.py`: prompts, loss masks, shards, resume,
the summary and the data hash are those of local generation. The local target (`--target`)
gives the tokenizer, the chat template and the fingerprint recorded in the provenance; the
server only answers. How a turn travels:
  - "ids": the prompt is rendered locally (chat template and all) and its token ids are sent to
    /v1/completions (vLLM and SGLang take a list of ids as `prompt`): the server sees exactly
    the tokens the data holds;
  - "text": conversations go to /v1/chat/completions (the server renders them with its own chat
    template), raw prompts to /v1/completions as text.
`--send auto` picks "ids" when the server takes them (one probe request).
The answer's ids are the server's own where it returns them (vLLM's `return_token_ids`, or
logprob tokens written as "token_id:N"); otherwise the answer is streamed and its text is
retokenized with the target's tokenizer event by event: where an event holds one token's text
(or the few tokens of one character) this keeps the target's own splits, which retokenizing the
whole text would merge. A server whose stream falls behind may join several tokens' texts in one
event (`transformers serve` does), and then the split inside it is lost: such an answer's ids can
differ from run to run with the server's load, though its text does not. Each row records which
(`token_source`: "server", "retokenized", or "retokenized_inexact" when the server's usage counts
another number of generated tokens than the retokenization holds: joined events that retokenize
to fewer tokens, byte tokens that are not a whole UTF-8 character and come back as U+FFFD).

A turn the server ends (finish_reason other than "length") ends with the stop token: the
server's ids include it, or it is appended (the chat template's end-of-turn token, else EOS:
a server's text never holds it). Requests are spread round-robin over the endpoints, at most
`concurrency` in flight; a failed request is retried on the next endpoint with exponential
backoff. When every try fails the run stops with one line naming the endpoint; complete
shards are kept and the same command resumes.

Reasoning (a `<think>...</think>` block in the answer, or a separate `reasoning_content`):
"keep" trains on it as the target wrote it, "strip" drops it (the rest is retokenized), "refuse"
drops the sample (counted as skipped "reasoning_refused").

The API key is read from the environment variable named by `--api-key-env` and sent as a
Bearer token; neither the key nor the headers are ever written (provenance records the name).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from draftsmith.distill.generate import Answer, GenerateSettings, TurnRequest, end_of_turn_token

SEND_MODES = ("auto", "ids", "text")
REASONING_MODES = ("keep", "strip", "refuse")
# A leading thinking block; some templates write the opening <think> themselves, so it may be absent.
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")  # vLLM/SGLang logprob tokens with --return-tokens-as-token-ids


class EndpointError(ValueError):
    """An endpoint that cannot be used (down, another model, a refused request); one line naming it."""


class RequestRefused(EndpointError):
    """The server answered 4xx: the request itself is wrong for it (retrying cannot help)."""


@dataclass(frozen=True)
class EndpointSettings:
    urls: tuple[str, ...]  # base URLs ("http://host:8000" or ".../v1"); requests are spread over them
    served_model: str | None = None  # the model id to request; default: the one model the endpoints serve
    api_key_env: str | None = None  # name of the environment variable holding the key (never the key)
    concurrency: int = 8  # requests in flight over all endpoints (a server batches them itself)
    timeout: float = 600.0  # seconds per request: a long answer on a loaded server takes minutes
    retries: int = 4  # tries after the first, each on the next endpoint
    backoff: float = 1.0  # seconds before the first retry, doubled each time (a restarting server)
    send: str = "auto"  # how prompts travel: auto | ids | text (see the module docstring)
    reasoning: str = "keep"  # keep | strip | refuse

    def __post_init__(self):
        object.__setattr__(self, "urls", tuple(_base_url(u) for u in self.urls))
        if not self.urls:
            raise ValueError("--endpoint: give at least one URL, e.g. http://localhost:8000")
        checks = {
            "concurrency": self.concurrency >= 1,
            "timeout": self.timeout > 0,
            "retries": self.retries >= 0,
            "backoff": self.backoff >= 0,
            "send": self.send in SEND_MODES,
            "reasoning": self.reasoning in REASONING_MODES,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"endpoint {name} = {getattr(self, name)!r} is out of range")


def _base_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise ValueError(f"--endpoint {url!r} is not an http(s) URL; expected e.g. http://localhost:8000")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_seed(seed: int, key: tuple[int, int, int]) -> int:
    """One seed per (record, sample, turn): the same on a rerun, whatever the order of requests."""
    digest = hashlib.sha256(f"{seed}:{key[0]}:{key[1]}:{key[2]}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class EndpointClient:
    """HTTP to one or more OpenAI-compatible servers: spreading, retries, one-line errors."""

    def __init__(self, settings: EndpointSettings):
        import httpx

        self.settings = settings
        headers = {}
        if settings.api_key_env:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise EndpointError(
                    f"--api-key-env {settings.api_key_env}: the environment variable is not set or empty"
                )
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(settings.timeout, connect=min(10.0, settings.timeout)),
            limits=httpx.Limits(max_connections=settings.concurrency + len(settings.urls)),
        )
        self._turn = 0
        self._lock = threading.Lock()
        self.model = self._check_models()

    def close(self) -> None:
        self._http.close()

    def _check_models(self) -> str:
        """The served model id, after checking /v1/models of every endpoint."""
        import httpx

        served = {}
        for url in self.settings.urls:
            try:
                r = self._http.get(f"{url}/v1/models", timeout=min(10.0, self.settings.timeout))
            except httpx.HTTPError as err:
                raise EndpointError(
                    f"endpoint {url} is down or unreachable ({_short(err)}); start the server or fix --endpoint"
                ) from None
            if r.status_code in (401, 403):
                raise EndpointError(f"endpoint {url} refused the API key (HTTP {r.status_code}); check --api-key-env")
            if r.status_code >= 400:
                raise EndpointError(f"endpoint {url}/v1/models answered HTTP {r.status_code}: {_detail(r)}")
            try:
                served[url] = [m["id"] for m in r.json()["data"]]
            except (ValueError, KeyError, TypeError):
                raise EndpointError(
                    f"endpoint {url}/v1/models is not an OpenAI-compatible model list: {r.text[:120]!r}"
                ) from None
        want = self.settings.served_model
        for url, ids in served.items():
            if want is not None and want not in ids:
                raise EndpointError(f"endpoint {url} serves {ids}, not {want!r} (--served-model)")
            if want is None and len(ids) != 1:
                raise EndpointError(f"endpoint {url} serves {len(ids)} models {ids}: name one with --served-model")
        if want is None:
            models = {ids[0] for ids in served.values()}
            if len(models) > 1:
                raise EndpointError(
                    f"the endpoints serve different models ({served}); give --served-model, or one kind of server"
                )
            want = models.pop()
        return want

    def post(self, path: str, body: dict, *, retry: bool = True) -> dict:
        """POST `body` (with the model) to the next endpoint; retried on the next ones on network
        errors, timeouts, 408, 429 and 5xx. Other 4xx answers are errors at once."""
        import httpx

        with self._lock:
            first, self._turn = self._turn, self._turn + 1
        body = {"model": self.model, **body}
        tries = self.settings.retries + 1 if retry else 1
        last = ""
        for attempt in range(tries):
            url = self.settings.urls[(first + attempt) % len(self.settings.urls)]
            try:
                status, answer, detail = self._send(url + path, body)
            except (httpx.HTTPError, ValueError) as err:  # ValueError: a body cut off mid-JSON
                last = f"{url}: {_short(err)}"
            else:
                if status < 400:
                    return answer
                if status not in (408, 429) and status < 500:
                    raise RequestRefused(f"endpoint {url}{path} refused the request: HTTP {status}: {detail}")
                last = f"{url}: HTTP {status}: {detail}"
            if attempt + 1 < tries:
                time.sleep(self.settings.backoff * 2**attempt)
        raise EndpointError(
            f"endpoint request {path} failed {tries} time(s), last {last}; "
            "complete shards are kept, rerun the same command to resume"
        )

    def get_text(self, url: str, path: str) -> tuple[int, str]:
        """GET one endpoint's `path` (e.g. /metrics): (status, body); EndpointError when it is unreachable."""
        import httpx

        try:
            r = self._http.get(url + path, timeout=min(10.0, self.settings.timeout))
        except httpx.HTTPError as err:
            raise EndpointError(f"endpoint {url}{path} is unreachable ({_short(err)})") from None
        return r.status_code, r.text

    def _send(self, url: str, body: dict) -> tuple[int, dict | None, str]:
        """(status, answer, error detail); a streamed answer is {"chunks": [the SSE events],
        "chunk_times": [time.perf_counter() as each arrived]} (a load test's TTFT)."""
        if not body.get("stream"):
            r = self._http.post(url, json=body)
            return (r.status_code, r.json(), "") if r.status_code < 400 else (r.status_code, None, _detail(r))
        with self._http.stream("POST", url, json=body) as r:
            if r.status_code >= 400 or r.headers.get("content-type", "").startswith("application/json"):
                r.read()
                return (r.status_code, r.json(), "") if r.status_code < 400 else (r.status_code, None, _detail(r))
            chunks, times = [], []
            for line in r.iter_lines():
                data = line[len("data:") :].strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    break
                if data:
                    chunks.append(json.loads(data))
                    times.append(time.perf_counter())
            return r.status_code, {"chunks": chunks, "chunk_times": times}, ""

    def accepts(self, path: str, body: dict) -> dict | None:
        """The answer to a probe request, or None when the server refuses it (4xx)."""
        try:
            return self.post(path, body, retry=False)
        except RequestRefused:
            return None


class EndpointBackend:
    """`generate_shard`'s backend for an endpoint: TurnRequests in, Answers out, concurrently."""

    def __init__(
        self, client: EndpointClient, tokenizer, template: str | None, settings: GenerateSettings, stop_ids: list[int]
    ):
        self.client, self.tokenizer, self.template, self.settings = client, tokenizer, template, settings
        self.stop_ids = set(stop_ids)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (min(stop_ids) if stop_ids else None)
        self.chat_end = end_of_turn_token(tokenizer, template) if template is not None else None
        self.chat_end = eos if self.chat_end is None else self.chat_end
        self.text_end = eos
        self._probe(stop_ids)
        self._pool = ThreadPoolExecutor(max_workers=client.settings.concurrency, thread_name_prefix="endpoint")

    # --- what the server can do ------------------------------------------------------------------

    def _probe(self, stop_ids: list[int]) -> None:
        """One-token requests: ids as a prompt? token ids in the answer (two ways)? stop token ids?"""
        s, c = self.client.settings, self.client
        hello = self.tokenizer("Hello", add_special_tokens=False).input_ids or [0]
        base = {"max_tokens": 1, "temperature": 0.0}
        takes_ids = s.send != "text" and c.accepts("/v1/completions", base | {"prompt": hello}) is not None
        if s.send == "ids" and not takes_ids:
            raise EndpointError(
                f"endpoint {s.urls[0]} does not take token ids as a /v1/completions prompt (--send ids); "
                "use --send text"
            )
        self.send = "ids" if takes_ids else "text"
        prompt = hello if takes_ids else "Hello"
        self.extra: dict = {}
        answer = c.accepts("/v1/completions", base | {"prompt": prompt, "return_token_ids": True})
        if answer is not None and isinstance(_choice(answer).get("token_ids"), list):
            self.token_ids = "return_token_ids"
            self.extra["return_token_ids"] = True
        else:
            answer = c.accepts("/v1/completions", base | {"prompt": prompt, "logprobs": 1})
            tokens = ((_choice(answer).get("logprobs") or {}).get("tokens") or []) if answer else []
            self.token_ids = "logprobs" if tokens and all(_TOKEN_ID.match(str(t)) for t in tokens) else None
        stops = {"prompt": prompt, "stop_token_ids": list(stop_ids)}
        if stop_ids and c.accepts("/v1/completions", base | stops) is not None:
            self.extra["stop_token_ids"] = list(stop_ids)  # servers stop on their own EOS otherwise
        if self.settings.top_k:
            self.extra["top_k"] = self.settings.top_k  # not OpenAI's: a server that refuses it says so
        # Without the server's ids, stream: an event holds the text of one token (or of the few
        # that make a whole character) unless the server joined some, so retokenizing event by
        # event keeps the target's own splits where retokenizing the whole text would merge them.
        self.stream = self.token_ids is None
        if self.stream:
            self.extra |= {"stream": True, "stream_options": {"include_usage": True}}

    def provenance(self) -> dict:
        """Provenance keys: "generator" (what made the answers: a rerun must match it to resume)
        and "endpoints" (where the first run sent them: a resumed run may use others)."""
        generator = {
            "backend": "endpoint",
            "served_model": self.client.model,
            "prompts_sent_as": self.send,
            "token_ids_from": self.token_ids or "retokenized streamed text",
            "reasoning": self.client.settings.reasoning,
            "api_key_env": self.client.settings.api_key_env,  # the variable's name; the key is never written
        }
        return {"generator": generator, "endpoints": list(self.client.settings.urls)}

    def describe(self) -> str:
        return f"endpoint {', '.join(self.client.settings.urls)} ({self.client.model})"

    # --- answering ----------------------------------------------------------------------------

    def __call__(self, requests: list[TurnRequest]) -> list[Answer]:
        futures = [self._pool.submit(self._answer, r) for r in requests]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def _answer(self, req: TurnRequest) -> Answer:
        s = self.settings
        seed = request_seed(s.seed, req.key)
        body = {"max_tokens": req.budget, "temperature": s.temperature, "top_p": s.top_p, "seed": seed}
        chat = self.send == "text" and req.messages is not None
        if chat:
            body["messages"] = req.messages
            if self.token_ids == "logprobs":
                body |= {"logprobs": True, "top_logprobs": 0}
        else:
            body["prompt"] = req.prompt_ids if self.send == "ids" else req.prompt
            if self.token_ids == "logprobs":
                body["logprobs"] = 1
        out = self.client.post("/v1/chat/completions" if chat else "/v1/completions", body | self.extra)
        choice, pieces = _assemble(out["chunks"], chat) if "chunks" in out else (_choice(out), None)
        usage = next((c["usage"] for c in reversed(out.get("chunks", [out])) if c.get("usage")), None)
        if choice.get("finish_reason") in ("abort", "error"):
            raise EndpointError(f"endpoint aborted request {req.key} (finish_reason {choice['finish_reason']!r})")
        if chat:
            message = choice.get("message") or {}
            text = message.get("content") or ""
            apart = message.get("reasoning_content") or message.get("reasoning")
        else:
            text, apart = choice.get("text") or "", None
        ids = self._server_ids(choice, chat)
        reasoning = self.client.settings.reasoning
        inline = _THINK.match(text) if "</think>" in text else None
        if apart or inline:
            if reasoning == "refuse":
                return Answer([], "stop", refused="reasoning_refused")
            if reasoning == "strip":
                text, ids, pieces = (text[inline.end() :] if inline else text), None, None
            elif apart and ids is None:
                raise EndpointError(
                    "the endpoint returns the reasoning in a separate field and no token ids, so the thinking tokens "
                    "cannot be recovered exactly; serve without a reasoning parser, or use --reasoning strip|refuse"
                )
        end = self.chat_end if req.messages is not None else self.text_end
        retokenized = retokenize(self.tokenizer, pieces if pieces is not None else [text])
        answer = _normalise(ids, retokenized, choice.get("finish_reason"), req.budget, self.stop_ids, end)
        seen = (usage or {}).get("prompt_tokens")
        if seen is not None and seen != len(req.prompt_ids):
            raise EndpointError(
                f"the endpoint read request {req.key} (record, sample, turn) as {seen} prompt tokens, the target's "
                f"tokenizer and chat template as {len(req.prompt_ids)}: the server renders prompts differently from "
                "--target; serve the same tokenizer and template, or use --send ids (vLLM, SGLang)"
            )
        counted = (usage or {}).get("completion_tokens")
        if answer.token_source == "retokenized" and not (apart or inline) and counted is not None:
            # The server generated another number of tokens than its text retokenizes to: the
            # text does not hold the target's ids (e.g. byte tokens that are no whole character).
            if counted != len(retokenized) + (answer.finish_reason == "stop"):
                answer = Answer(answer.ids, answer.finish_reason, "retokenized_inexact")
        # Throughput counts what the server generated (its usage), not the retokenized length.
        return Answer(answer.ids, answer.finish_reason, answer.token_source, generated=counted)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _server_ids(self, choice: dict, chat: bool) -> list[int] | None:
        if isinstance(choice.get("token_ids"), list):
            return [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs") or {}
        tokens = [t.get("token") for t in logprobs.get("content") or []] if chat else logprobs.get("tokens")
        if tokens and all(_TOKEN_ID.match(str(t)) for t in tokens):
            return [int(_TOKEN_ID.match(str(t)).group(1)) for t in tokens]
        return None


def retokenize(tokenizer, pieces: list[str]) -> list[int]:
    """The ids of a server's text, each piece (a streamed event) tokenized on its own."""
    return [t for piece in pieces for t in tokenizer(piece, add_special_tokens=False).input_ids]


def _normalise(ids, retokenized, finish, budget, stop_ids, end) -> Answer:
    """The answer as local generation writes it: through the first stop token ("stop"), or cut
    at the budget ("length"). A server's text never holds the stop token: it is appended."""
    source = "server"
    if ids is None:
        ids, source = retokenized, "retokenized"
    ids = list(ids)[:budget]
    stop = next((i for i, t in enumerate(ids) if t in stop_ids), None)
    if stop is not None:
        return Answer(ids[: stop + 1], "stop", source)
    if finish == "length" or end is None or len(ids) >= budget:
        return Answer(ids, "length", source)
    return Answer(ids + [end], "stop", source)


def _assemble(chunks: list[dict], chat: bool) -> tuple[dict, list[str]]:
    """A streamed answer as one choice, and its text event by event."""
    pieces, reasoning, finish = [], [], None
    for chunk in chunks:
        if chunk.get("error"):
            raise EndpointError(f"the endpoint failed mid-answer: {str(chunk['error'])[:200]}")
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}) if chat else choice
            piece = delta.get("content") if chat else delta.get("text")
            if piece:
                pieces.append(piece)
            if chat and (delta.get("reasoning_content") or delta.get("reasoning")):
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning"))
            finish = choice.get("finish_reason") or finish
    text = "".join(pieces)
    if chat:
        return {
            "message": {"content": text, "reasoning_content": "".join(reasoning) or None},
            "finish_reason": finish,
        }, pieces
    return {"text": text, "finish_reason": finish}, pieces


def _choice(answer: dict | None) -> dict:
    try:
        return answer["choices"][0] or {}
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"the endpoint's answer has no choices: {str(answer)[:120]!r}") from None


def _detail(response) -> str:
    try:
        data = response.json()
        detail = data.get("detail") or data.get("error") or data.get("message") or data
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
    except ValueError:
        detail = response.text
    return str(detail).replace("\n", " ")[:200]


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"[:200]
