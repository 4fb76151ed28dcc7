"""The DFlash drafter: the block drafter (`decoding.blocks`) over a DFlash head, one chain of up to
block_size - 1 drafts per call, each slot's from its own logits (no correction)."""

from __future__ import annotations

import torch

from draftsmith.decoding.blocks import BlockDrafter


class DFlashDrafter(BlockDrafter):
    """DFlash drafting (a chain): `BlockDrafter` as it is."""

    def __init__(self, head: torch.nn.Module, *, name: str = "dflash"):
        super().__init__(head, name=name, kind="DFlash")


def dflash_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of a DFlash head: one block chain, `name`."""
    return {name: DFlashDrafter(head, name=name)}
