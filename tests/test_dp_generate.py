"""`draftsmith generate` under `accelerate launch`: two processes split the shards and make the
data (the data hash) one process makes, greedy and sampled, fresh and resumed.

Launched like the command in docs/data.md, on CPU: `accelerate launch --multi_gpu --num_processes 2`
of the `draftsmith generate` command line (gloo; the venv's interpreter runs the launcher, so the
children import this checkout).
"""

from __future__ import annotations

import json
import shutil

import pytest
from lifecycle_helpers import accelerate_args, child_env, run_script, toy_generate_args

from draftsmith.distill import data as store
from draftsmith.scripts.cli import main

pytestmark = pytest.mark.slow

# The arguments of the session's `toy_data` (greedy, shards of 4: 6 samples in 2 shards), which
# is the one-process reference; sampled, 2 answers per prompt make 3 shards.


def _args(toy_dir, out, sampled: bool) -> list[str]:
    return toy_generate_args(
        toy_dir, out, extra=["--temperature", 1.0, "--num-samples", 2, "--seed", 3] if sampled else ()
    )


# One launch runs both commands (greedy fresh, sampled resumed): the launch and the imports of
# two processes dominate this test's time, not the generation.
WORKER = """import sys
from draftsmith.scripts.cli import main
for args in {commands!r}:
    if main(args) != 0:
        sys.exit(1)
"""


@pytest.fixture(scope="module")
def runs(toy_dir, toy_data, tmp_path_factory):
    """{name: (one-process folder, two-process folder)} and the launch's stdout."""
    root = tmp_path_factory.mktemp("dp-generate")
    greedy, sampled = (toy_data, root / "greedy-two"), (root / "sampled-one", root / "sampled-two")
    assert main(_args(toy_dir, sampled[0], sampled=True)) == 0
    # a killed sampled run: two shards never renamed into place (one left as a temporary), no summary
    shutil.copytree(sampled[0], sampled[1])
    for k in (1, 2):
        shutil.rmtree(sampled[1] / store.SHARDS / store.shard_name(k))
    (sampled[1] / store.SHARDS / ".shard-00001.killed").mkdir()
    (sampled[1] / store.SUMMARY).unlink()
    worker = root / "worker.py"
    worker.write_text(WORKER.format(commands=[_args(toy_dir, greedy[1], False), _args(toy_dir, sampled[1], True)]))
    launch = accelerate_args(worker, options=["--multi_gpu"])
    done = run_script(launch, env=child_env(ACCELERATE_USE_CPU="true"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("data hash") == 2  # each summary printed by the main process only
    return {"greedy": greedy, "sampled": sampled}, done.stdout


def _summary(out) -> dict:
    return json.loads((out / store.SUMMARY).read_text())


def _writers(out) -> dict[str, int]:
    return {p.name: json.loads((p / store.SHARD_STATS).read_text())["process"] for p in store.complete_shards(out)}


def test_two_processes_make_one_process_greedy_data(runs):
    one, two = runs[0]["greedy"]
    assert _summary(two)["data_hash"] == _summary(one)["data_hash"]
    assert _summary(two)["samples"] == _summary(one)["samples"] == 6
    # shard k is made by process k % 2, each once (a second writer would fail its rename)
    assert _writers(two) == {store.shard_name(k): k % 2 for k in range(2)}
    provenance = [json.loads((out / store.PROVENANCE).read_text()) for out in (one, two)]
    assert provenance[0]["settings"] == provenance[1]["settings"] and provenance[0]["target"] == provenance[1]["target"]


def test_two_processes_resume_sampled_data_to_the_one_process_hash(runs):
    (one, resumed), stdout = runs[0]["sampled"], runs[1]
    assert _summary(one)["num_shards"] == 3 and _summary(one)["samples"] == 12
    assert "resuming: 1 of 3 shards already complete" in stdout
    assert _summary(resumed)["data_hash"] == _summary(one)["data_hash"]
    assert _writers(resumed) == {"shard-00000": 0, "shard-00001": 1, "shard-00002": 0}
    assert not list((resumed / store.SHARDS).glob(".shard-*"))
