"""DFlash heads on disk: the block heads' formats (`heads.block_formats`, one mechanism) with DFlash's
layout: draftsmith's (`model_type: draftsmith_dflash`) and the vLLM speculators `dflash` one
(`speculators_model_type: dflash`, `architectures: ["DFlashDraftModel"]`, `sample_from_anchor: false`:
block_size - 1 drafts per block), both holding the backbone's keys and tensors and nothing more.

    save_dflash(head, "out/dflash")                 # config.json + weights, without the target's tensors
    export_dflash(head, "out/dflash-vllm")          # for vllm serve TARGET --speculative-config ...
    export_folder("out/dflash", "out/dflash-vllm", "vllm", num_speculative_tokens=7)  # from the folder
    head = load_dflash("out/dflash-vllm", target=target)
"""

from __future__ import annotations

from draftsmith.heads.block_formats import BlockLayout
from draftsmith.heads.dflash import DFlashHead

DFLASH = BlockLayout(DFlashHead, "dflash", "DFlashDraftModel", "DFlash head")

# the block heads' formats (`heads.block_formats`) for DFlash's layout
save_dflash, load_dflash, export_dflash = DFLASH.save, DFLASH.load, DFLASH.export
export_folder, serving_facts = DFLASH.export_folder, DFLASH.serving_facts  # the registry's exporter and server
