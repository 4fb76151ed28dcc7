"""P-EAGLE heads (parallel EAGLE, arXiv 2602.01469): an EAGLE-3 head that drafts several depths in
ONE forward.

    head = PEagleHead.for_target(target, mask_token_id=mid, num_depths=4, vocab_map=vmap)
    pairs = head.project(aux)                                # the real positions, as EAGLE-3 reads them
    masks = head.mask_features(B, 3)                         # [B, 3, H]: fc(mask_hidden) per placeholder
    ids = cat([tokens, full((B, 3), mid)], 1)                # the placeholders' token is the mask token
    out, logits = head(ids, cat([pairs, masks], 1), position_ids=pos)   # causal: 4 depths at once

What changes against EAGLE-3 (`draftsmith.heads.eagle.model`; speculators' `peagle` model type is its
eagle3 config plus `mask_token_id`):
- a position not drafted yet is a placeholder: its token is `mask_token_id` (an id of the target's
  vocabulary; the embeddings TRAIN, `embed_requires_grad` on, and are saved) and its feature is
  `mask_hidden` [1, 1, n_aux * H] (a trained tensor in the aux states' space, before fc and the
  fc norms, as speculators keeps it) through `project`;
- after the real pairs of a row (pair t = (token_{t+1}, f_t) at position t, the last one at
  position p), K - 1 placeholders at positions p+1..p+K-1 in the same causal forward: the real
  pair's output predicts token p+2 (depth 0, as EAGLE-3), placeholder d predicts token p+2+d;
  each depth's distribution depends on the context only, never on the tokens drafted before it;
- `num_depths` (K) is what the head was trained to draft (speculators' default 8), recorded in
  the config and in the export's proposal (`speculative_tokens`).
- the layer: EAGLE-3's options hold (`for_target(**variant)`); speculators' trainer builds a peagle
  draft on a `qwen3` layer (per-head q/k norms, EAGLE-3's `qk_norm`), so `train/peagle.py` trains
  `qk_norm` on by default, while `for_target` keeps EagleConfig's default (off), as a head saved
  before the option existed loads.
The mask token is chosen as every one-pass head's is (`draftsmith.heads.layers.choose_mask_token`): the
recipe's id, else the tokenizer's mask token, else a reserved unused id; `mask_token_source` says
which. The layouts on disk are EAGLE-3's (`draftsmith.heads.eagle.formats`): `save_eagle`,
`export_eagle(.., "vllm")` (speculators `peagle`, key `mask_hidden` beside EAGLE-3's) and
`load_eagle`, which returns a `PEagleHead` for a P-EAGLE folder.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads.eagle.formats import PROVENANCE_KEY, SpeculatorsExtension, register_extension
from draftsmith.heads.eagle.model import EagleConfig, EagleError, EagleHead
from draftsmith.heads.layers import MASK_SOURCES, describe_mask_head

# The config fields of a P-EAGLE head beyond EAGLE-3's (the export writes them, the import reads them).
PEAGLE_FIELDS = ("mask_token_id", "mask_token_source", "num_depths")
# speculators `peagle`: the eagle3 layout plus `mask_token_id` in the config and the trained
# placeholder feature `mask_hidden` [1, 1, n_aux * H] in the weights.
SPECULATORS_TYPE = "peagle"
PEAGLE_ARCHITECTURE = "PEagleDraftModel"
PEAGLE_KEYS = ("mask_hidden",)


class PEagleConfig(EagleConfig):
    model_type = "draftsmith_peagle"

    def __init__(
        self,
        mask_token_id: int | None = None,  # required by a head; see the module docstring
        mask_token_source: str | None = None,  # recipe | tokenizer | reserved
        num_depths: int = 8,  # tokens one forward drafts (speculators' trainer default)
        embed_requires_grad: bool = True,  # P-EAGLE trains the embeddings (the mask token's row learns)
        **kwargs,
    ):
        kwargs.setdefault("version", "eagle3")
        if kwargs["version"] != "eagle3":
            raise EagleError(f"PEagleConfig: version={kwargs['version']!r}; P-EAGLE is an EAGLE-3 head")
        super().__init__(embed_requires_grad=embed_requires_grad, **kwargs)
        if not isinstance(num_depths, int) or isinstance(num_depths, bool) or num_depths < 1:
            raise EagleError(f"PEagleConfig: num_depths={num_depths!r}; expected an integer >= 1")
        if mask_token_id is not None and not (isinstance(mask_token_id, int) and 0 <= mask_token_id < self.vocab_size):
            raise EagleError(
                f"PEagleConfig: mask_token_id={mask_token_id!r} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        if mask_token_source is not None and mask_token_source not in MASK_SOURCES:
            raise EagleError(f"PEagleConfig: mask_token_source={mask_token_source!r}; expected one of {MASK_SOURCES}")
        self.mask_token_id, self.mask_token_source, self.num_depths = mask_token_id, mask_token_source, num_depths


class PEagleHead(EagleHead):
    """An EAGLE-3 head with a mask token and a trained placeholder feature (module docstring)."""

    config_class = PEagleConfig
    base_model_prefix = "peagle"

    def __init__(self, config: PEagleConfig):
        if config.mask_token_id is None:
            raise EagleError("PEagleConfig.mask_token_id is not set: a P-EAGLE head needs a mask token id")
        super().__init__(config)
        # speculators' init: a standard normal draw in the concatenated aux states' space.
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, config.num_aux * config.aux_hidden_size))

    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        *,
        mask_token_id: int,
        mask_token_source: str | None = None,
        num_depths: int = 8,
        aux_layer_ids=None,
        vocab_map=None,
        target_name_or_path: str | None = None,
        data_hash: str | None = None,
        **variant,
    ) -> PEagleHead:
        """EAGLE-3's head for `target` (`EagleHead.for_target`: embeddings and lm_head rows copied
        in, `variant` its flags) with the mask token and a fresh `mask_hidden`; embeddings trained."""
        variant.setdefault("embed_requires_grad", True)
        base = EagleHead.for_target(
            target,
            "eagle3",
            aux_layer_ids=aux_layer_ids,
            vocab_map=vocab_map,
            target_name_or_path=target_name_or_path,
            data_hash=data_hash,
            **variant,
        )
        fields = {k: v for k, v in base.config.to_dict().items() if k not in ("model_type", "transformers_version")}
        config = PEagleConfig(
            **fields, mask_token_id=mask_token_id, mask_token_source=mask_token_source, num_depths=num_depths
        )
        param = base.fc.weight
        state = dict(base.state_dict())
        state["mask_hidden"] = torch.randn(1, 1, config.num_aux * config.aux_hidden_size).to(param)
        with torch.device("meta"):  # the tensors are the base head's: no second copy, no random init
            head = cls(config)
        head.load_state_dict(state, strict=True, assign=True)
        head.rotary_emb = LlamaRotaryEmbedding(config.layer_config()).to(param.device)
        head._freeze()
        return head

    def _freeze(self) -> None:
        super()._freeze()
        if hasattr(self, "mask_hidden"):  # built after EagleHead.__init__ freezes the rest
            self.mask_hidden.requires_grad_(True)

    def mask_features(self, rows: int, count: int) -> torch.Tensor:
        """[rows, count, H]: the placeholders' feature, project(mask_hidden), for every slot."""
        return self.project(self.mask_hidden).expand(rows, count, -1)

    def describe(self) -> str:
        return describe_mask_head(self, f"P-EAGLE head: {self.config.num_depths} depths per forward")


def _speculators_keys(config: PEagleConfig) -> dict:
    """Its keys of a speculators config.json beside EAGLE-3's."""
    return {"mask_token_id": config.mask_token_id}


def _speculators_fields(path, raw: dict) -> dict:
    """PEagleConfig's own fields of a speculators `peagle` config.json (speculators' default: trained
    embeddings)."""
    provenance = raw.get(PROVENANCE_KEY) or {}
    if raw.get("mask_token_id") is None:
        raise EagleError(f"{str(path / 'config.json')!r}: a peagle head needs mask_token_id (none is set)")
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {
        "embed_requires_grad": raw.get("embed_requires_grad", True),
        "mask_token_id": raw["mask_token_id"],
        "mask_token_source": provenance.get("mask_token_source"),
        "num_depths": provenance.get("num_depths") or methods[0].get("speculative_tokens") or 8,
    }


register_extension(
    SpeculatorsExtension(
        head=PEagleHead,
        model_type=SPECULATORS_TYPE,
        architecture=PEAGLE_ARCHITECTURE,
        title="P-EAGLE",
        weight_keys=PEAGLE_KEYS,
        fields=PEAGLE_FIELDS,
        write_keys=_speculators_keys,
        read_fields=_speculators_fields,
    )
)


def serving_facts(folder, config: dict, setting: dict, k: int) -> dict:
    """How servers load a P-EAGLE head (`publish.serve` writes the commands): vLLM serves the
    speculators `peagle` layout as an EAGLE-3 head drafting every depth in one pass
    (`parallel_drafting`); SGLang has no P-EAGLE layout here."""
    exported = "speculators_model_type" in config
    return {
        "layout": f"a P-EAGLE head in the {'speculators' if exported else 'draftsmith'} layout",
        "vllm": {"method": "eagle3", "options": {"parallel_drafting": True}, "export": not exported},
        "notes": [
            "SGLang has no P-EAGLE layout here",
            "the head reads the target's hidden states at fixed layers: serve it with exactly this target",
        ],
    }
