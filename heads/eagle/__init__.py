"""EAGLE heads (EAGLE-1, EAGLE-3 and its variants, EAGLE-3.1 among them): the model (`model.py`)
and its layouts on disk (`formats.py`)."""

from draftsmith.heads.eagle.formats import (
    EXPORT_FORMATS,
    LAYER_KEYS,
    PROVENANCE_KEY,
    SGLANG_ARCHITECTURE,
    SGLANG_KEYS,
    SPECULATORS_ARCHITECTURE,
    SPECULATORS_VERSION,
    VLLM_KEYS,
    VOCAB_MAP_KEYS,
    WEIGHTS,
    export_eagle,
    load_eagle,
    save_eagle,
)
from draftsmith.heads.eagle.model import (
    EagleAttention,
    EagleConfig,
    EagleDecoderLayer,
    EagleError,
    EagleHead,
    VARIANT_FLAGS,
    VERSIONS,
    default_aux_layer_ids,
)

__all__ = [
    "EXPORT_FORMATS",
    "EagleAttention",
    "EagleConfig",
    "EagleDecoderLayer",
    "EagleError",
    "EagleHead",
    "LAYER_KEYS",
    "PROVENANCE_KEY",
    "SGLANG_ARCHITECTURE",
    "SGLANG_KEYS",
    "SPECULATORS_ARCHITECTURE",
    "SPECULATORS_VERSION",
    "VARIANT_FLAGS",
    "VERSIONS",
    "VLLM_KEYS",
    "VOCAB_MAP_KEYS",
    "WEIGHTS",
    "default_aux_layer_ids",
    "export_eagle",
    "load_eagle",
    "save_eagle",
]
