"""Shared test setup: make `import fixtures` work from tests/, cache the tiny models, and group
the tests for pytest-xdist (`./run test` runs them on 2 workers with `--dist loadgroup`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Tests never reach the network: a hub id fails at once instead of retrying for ~20 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from fixtures import tiny_pair  # noqa: E402  (needs the path above)

#: Files whose tests start two training processes of their own: one xdist group, so that at most
#: one such pair runs at a time (beside the other worker) on a 2-core runner.
TWO_PROCESS_FILES = ("test_distributed.py", "test_fsdp2.py", "test_target_sharding.py", "test_dp_generate.py")
#: Groups handed out first under xdist: the longest units of work (the compiled tests share one
#: worker's compiled graphs, see tests/test_static.py), so that neither worker is left alone with
#: one at the end.
FIRST = ("compiled", "two-processes")


def _group(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return marker.args[0] if marker.args else marker.kwargs.get("name", "default")
    return "two-processes" if item.path.name in TWO_PROCESS_FILES else item.path.name


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which appends the group to each test id
def pytest_collection_modifyitems(config, items):
    """Every test gets an xdist group: its marked one, the two-process group, or else its file
    (so that a module-scoped fixture is built on one worker only). Under xdist the tests are
    then ordered longest group first (the FIRST groups, then by test count); a serial run keeps
    the collection order."""
    groups = [_group(item) for item in items]
    for item, group in zip(items, groups):
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        counts = {g: groups.count(g) for g in set(groups)}

        def rank(pair):
            group = pair[1]
            return (FIRST.index(group) if group in FIRST else len(FIRST), -counts[group], group)

        items[:] = [item for item, _ in sorted(zip(items, groups), key=rank)]


@pytest.fixture(scope="session")
def pairs():
    """`pairs(family)` -> (target, draft), built once per session.

    The models are only ever read (eval mode, inference), so tests may share them; a test that
    changes a model's weights or settings must build its own with `fixtures.tiny_pair`.
    """
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = tiny_pair(family)
        return cache[family]

    return get


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models cost per-op overhead, not FLOPs: a second intra-op thread only adds
    synchronisation (measured ~2x slower on a busy 2-core runner). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_cli(capsys):
    """`run_cli(args)` -> (exit code, stdout, stderr) of the `draftsmith` command, in-process;
    argparse's own errors exit through SystemExit."""
    from draftsmith.scripts.cli import main

    def run(args):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """A toy target/draft pair with its tokenizer and prompts.jsonl, written once per session."""
    from fixtures import write_toy

    out = tmp_path_factory.mktemp("toy-pair")
    write_toy(out)
    return out


@pytest.fixture(scope="session")
def toy_data(toy_dir, tmp_path_factory):
    """Self-distillation data of the toy target on 6 of its prompts as raw text (greedy, 8 new
    tokens, shards of 4). Read-only: tests that change data make their own."""
    from lifecycle_helpers import toy_generate_args

    from draftsmith.scripts.cli import main

    out = tmp_path_factory.mktemp("toy-data") / "data"
    assert main(toy_generate_args(toy_dir, out)) == 0
    return out


@pytest.fixture(scope="session")
def served_toy_paths(tmp_path_factory):
    """A toy target whose generation config names its EOS (as real checkpoints do: `transformers
    serve` stops only there): `write_toy`'s paths."""
    from fixtures import write_toy

    paths = write_toy(tmp_path_factory.mktemp("served"))
    config_file = paths["target"] / "generation_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"eos_token_id": 2}))
    return paths


@pytest.fixture(scope="session")
def served_toy(served_toy_paths):
    """`served_toy_paths`' target served by `transformers serve` for the session: (paths, server).
    Shared by the endpoint and engine load tests, so the suite starts it once."""
    from draftsmith.distill.local_server import launch_transformers_serve

    server = launch_transformers_serve(served_toy_paths["target"], device="cpu", dtype="float32")
    try:
        yield served_toy_paths, server.wait_ready()
    finally:
        server.stop()
