"""DFlash heads: the block backbone (`heads.blocks`) as it is, drafting block_size - 1 tokens per
forward (DFlash, arXiv 2602.06036; the speculators `dflash` model type).

    head = DFlashHead.for_target(target, num_layers=1, block_size=8, mask_token_id=mid, vocab_map=vmap)
    ctx = head.project(torch.cat([hs[i] for i in head.config.aux_layer_ids], -1))  # [N, C, H]
    logits = head(block_ids, ctx, positions=pos, attention_mask=mask)             # [N, Q, draft_vocab]
    save_dflash(head, "out/dflash")                   # draftsmith.heads.dflash_formats
    head = load_dflash("out/dflash", target=target)

Slot 0 holds the anchor (the previous verification's bonus token), slots 1..B-1 the mask token;
slot k drafts the token at anchor + k. Its errors are the backbone's (`DFlashError` is `BlockError`),
which every head built on the backbone raises for the backbone's checks.
"""

from __future__ import annotations

from draftsmith.heads.blocks import BlockConfig, BlockError, BlockHead

DFlashError = BlockError  # the backbone's checks are all a DFlash head has


class DFlashConfig(BlockConfig):
    """The backbone's keys (`heads.blocks.BlockConfig`); DFlash adds none."""

    model_type = "draftsmith_dflash"

    def __init__(self, **kwargs):  # its own __init__: transformers turns a config class without one into a dataclass
        super().__init__(**kwargs)


class DFlashHead(BlockHead):
    """A DFlash block drafter for one target (`heads.blocks.BlockHead`)."""

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    title = "DFlash head"
