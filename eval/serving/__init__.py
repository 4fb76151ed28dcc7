"""Serving at scale, from measured numbers: a continuous-batching load simulator, the highest
load that meets a latency target, the batch size where speculation stops paying, and the cost
of an answer.

    from draftsmith.eval.serving import StepProfile, poisson_requests, simulate, sustainable_load
    # step_seconds: one engine step (draft + verify for every active row), measured per batch size
    spec = StepProfile("KIND", step_seconds={1: 0.021, 8: 0.026, 32: 0.048},
                       tokens_per_step={1: 0.3, 2: 0.2, 3: 0.5}, prefill_seconds_per_token=2e-5)
    base = StepProfile.target_only(step_seconds={1: 0.015, 8: 0.017, 32: 0.030}, prefill_seconds_per_token=2e-5)
    run = simulate(spec, poisson_requests(4.0, 500, prompt_lengths=512, output_lengths=256, seed=0), max_batch=32)
    print(run.summary())
    print(sustainable_load(spec, 10.0, 90, max_batch=32, prompt_lengths=512, output_lengths=256).describe())

One module per part:
- profile.py: `StepProfile` (a method's measured step cost, tokens per step and prefill cost),
  `CostCurve` and the tokens-per-step histograms it is made from;
- simulator.py: `poisson_requests` and `simulate`, the continuous-batching server (its model is
  written there);
- load.py: `saturation_capacity`, `sustainable_load`, and the cost of 1,000 tokens and of an
  answer;
- crossover.py: `crossover`, the batch size where speculation stops paying, in one sentence;
- engine.py: the same measurements on a running OpenAI-compatible server (`draftsmith eval
  --endpoint`), beside the simulator's closed loop at the same concurrency;
- prometheus.py: a server's `/metrics`, and vLLM's speculative-decoding counters made into the
  served acceptance per position.
engine.py and prometheus.py are imported by module name, not from here (engine.py brings the
endpoint client in).
"""

from draftsmith.eval.serving.crossover import Crossover, crossover, describe_crossover
from draftsmith.eval.serving.load import (
    Capacity,
    LoadResult,
    cost_per_1k_tokens,
    cost_per_answer,
    saturation_capacity,
    sustainable_load,
)
from draftsmith.eval.serving.profile import (
    CostCurve,
    StepProfile,
    as_cost_curve,
    batch1_step_seconds,
    histogram_from_alphas,
    tokens_histogram,
)
from draftsmith.eval.serving.simulator import Request, RequestResult, SimulationResult, poisson_requests, simulate

__all__ = [
    "Capacity",
    "CostCurve",
    "Crossover",
    "LoadResult",
    "Request",
    "RequestResult",
    "SimulationResult",
    "StepProfile",
    "as_cost_curve",
    "batch1_step_seconds",
    "cost_per_1k_tokens",
    "cost_per_answer",
    "crossover",
    "describe_crossover",
    "histogram_from_alphas",
    "poisson_requests",
    "saturation_capacity",
    "simulate",
    "sustainable_load",
    "tokens_histogram",
]
