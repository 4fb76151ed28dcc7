"""`transformers serve` on a local target folder, as a subprocess: what the endpoint tests and
`scripts/endpoint_check.py` measure against (a real OpenAI-compatible server, no network).

    with serve_transformers("runs/toy/target", device="cpu", dtype="float32") as server:
        print(server.url)        # http://127.0.0.1:PORT, /v1/models answers
        server.kill()            # SIGKILL, as a crashed server
    servers = [launch_transformers_serve(t) for t in targets]   # started together, loading in parallel
    for s in servers: s.wait_ready()

`transformers serve PATH` loads the folder at start and lists it under the id PATH (the string
as given) at /v1/models; it takes `--host`, `--port`, `--device` and `--dtype`. It stops only on
the EOS of the model's generation config and takes no stop-token list per request, so a target
whose generation config names no EOS (the toy models) is served from an overlay folder: links
to its files and a generation config naming `stop_token_ids`, the ids local generation stops on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


class ServerStartError(RuntimeError):
    """The server exited or did not answer /v1/models in time; the message holds its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    url: str
    model_id: str
    process: subprocess.Popen
    log: Path
    _folder: tempfile.TemporaryDirectory

    def wait_ready(self, timeout: float = 300.0) -> LocalServer:
        """Until /v1/models answers; ServerStartError when the process exits or time runs out."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(f"transformers serve exited with {self.process.returncode}: {_tail(self.log)}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"transformers serve did not answer /v1/models in {timeout:.0f} s: {_tail(self.log)}"
                )
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL (no graceful shutdown: requests in flight die with it)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._folder.cleanup()


def _overlay(target: Path, stop_token_ids: list[int], into: Path) -> Path:
    into.mkdir()
    for entry in target.iterdir():
        if entry.name != "generation_config.json":
            (into / entry.name).symlink_to(entry.resolve())
    config_file = target / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config["eos_token_id"] = list(stop_token_ids)
    (into / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return into


def launch_transformers_serve(
    target,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    port: int | None = None,
    stop_token_ids: list[int] | None = None,
    continuous_batching: bool = False,
) -> LocalServer:
    """Start `transformers serve TARGET` on 127.0.0.1 and return at once (`wait_ready` waits):
    servers started together load in parallel. `stop_token_ids`: served through an overlay
    whose generation config stops on them (see the module docstring). `continuous_batching`:
    batch concurrent requests (paged attention); without it the server answers one at a time."""
    target = Path(target).resolve()
    tmp = tempfile.TemporaryDirectory(prefix="draftsmith-serve-")
    folder = _overlay(target, stop_token_ids, Path(tmp.name) / target.name) if stop_token_ids else target
    port = port or free_port()
    log = Path(tmp.name) / "server.log"
    command = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
    ] + (["--continuous-batching"] if continuous_batching else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return LocalServer(f"http://127.0.0.1:{port}", str(folder), process, log, tmp)


@contextlib.contextmanager
def serve_transformers(target, *, startup_timeout: float = 300.0, **options):
    """`launch_transformers_serve(target, **options)`, ready; stopped on exit."""
    server = launch_transformers_serve(target, **options)
    try:
        yield server.wait_ready(startup_timeout)
    finally:
        server.stop()


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(lines[-3:]) or "(no output)"
