"""The parts of a vLLM speculators config.json that every head's speculators export writes alike:
the header naming the format, and the `speculators_config` block (proposals, verifier)."""

from __future__ import annotations


def speculators_header(architecture: str, model_type: str, version: str) -> dict:
    """The first keys of a speculators config.json: which draft model class reads it."""
    return {"architectures": [architecture], "speculators_model_type": model_type, "speculators_version": version}


def speculators_block(algorithm: str, proposal: dict, config) -> dict:
    """`speculators_config`: the one greedy `proposal` (its type and counts) and the verifier, the
    target recorded in the head's `config`."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", **proposal}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": config.target_name_or_path, "architectures": config.target_architectures or []},
    }
