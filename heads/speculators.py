"""The parts of a vLLM speculators config.json that every head's speculators export writes alike:
the header naming the format, and the `speculators_config` block (proposals, verifier); and the
draft layer's fields and tensors that every importer reads alike."""

from __future__ import annotations

#: A Llama decoder layer's tensors, relative to the layer, without biases (a head with
#: `attention_bias` adds the four `self_attn.*_proj.bias`) or the extras of a head's own layer.
DECODER_LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


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


def draft_layer_fields(layer: dict, *, sizes: bool = True) -> dict:
    """The config fields of a draft layer given as a HF decoder config dict (speculators'
    `transformer_layer_config`, SpecForge's whole config): norm, attention, RoPE (its
    `rope_parameters`, else the older `rope_scaling` + `rope_theta`), bias, activation, and with
    `sizes` its hidden size, layer count and vocabulary (a caller that reads those from the weights
    passes `sizes=False`). A KeyError names a missing required field."""
    rope = layer.get("rope_parameters") or {
        **(layer.get("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": layer.get("rope_theta", 10000.0),
    }
    fields = dict(
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads"),
        head_dim=layer.get("head_dim"),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=layer["max_position_embeddings"],
        attention_bias=bool(layer.get("attention_bias")),
        hidden_act=layer.get("hidden_act", "silu"),
    )
    if sizes:
        fields.update(
            hidden_size=layer["hidden_size"],
            num_hidden_layers=layer["num_hidden_layers"],
            vocab_size=layer["vocab_size"],
        )
    return fields
