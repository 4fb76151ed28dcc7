"""`transformers serve` on a local target folder, as a subprocess: what the endpoint tests and
`scripts/endpoint_check.py` measure against (a real OpenAI-compatible server, no network).

    with serve_transformers("runs/toy/target", device="cpu", dtype="float32") as server:
        print(server.url)        # http://127.0.0.1:PORT, /v1/models answers
        server.kill()            # SIGKILL, as a crashed server

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

    def kill(self) -> None:
        """SIGKILL (no graceful shutdown: requests in flight die with it)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


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


@contextlib.contextmanager
def serve_transformers(target, *, device: str = "cpu", dtype: str = "float32", port: int | None = None,
                       stop_token_ids: list[int] | None = None, continuous_batching: bool = False,
                       startup_timeout: float = 300.0):  # fmt: skip
    """Start `transformers serve TARGET` on 127.0.0.1 and wait until /v1/models lists it; yields
    a LocalServer and ends the process on exit. `stop_token_ids`: served through an overlay
    whose generation config stops on them (see the module docstring). `continuous_batching`:
    batch concurrent requests (paged attention); without it the server answers one at a time."""
    import httpx

    target = Path(target).resolve()
    with tempfile.TemporaryDirectory(prefix="draftsmith-serve-") as tmp:
        folder = target
        if stop_token_ids:
            folder = _overlay(target, stop_token_ids, Path(tmp) / target.name)
        port = port or free_port()
        log = Path(tmp) / "server.log"
        command = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder),
            "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype,
        ] + (["--continuous-batching"] if continuous_batching else [])  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        server = LocalServer(f"http://127.0.0.1:{port}", str(folder), process, log)
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if process.poll() is not None:
                    raise ServerStartError(f"transformers serve exited with {process.returncode}: {_tail(log)}")
                try:
                    if httpx.get(f"{server.url}/v1/models", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(f"transformers serve did not answer /v1/models in {startup_timeout:.0f} s: {_tail(log)}")
                time.sleep(0.5)
            yield server
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(lines[-3:]) or "(no output)"
