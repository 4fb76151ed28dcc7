"""What is trained: Medusa heads, EAGLE heads, draft-model builders, and their formats.

Importing the package registers the heads with transformers' auto classes, so a folder that
`save_medusa` / `save_eagle` (the draftsmith layout, P-EAGLE heads too) wrote loads without draftsmith's loaders:

    import draftsmith.heads
    from transformers import AutoConfig, AutoModel
    heads = AutoModel.from_pretrained("runs/demo-medusa/heads")   # a MedusaHeads

A DFlash head is not registered: its embeddings (and full-vocabulary lm_head) are the target's and
are not saved, so it loads only with its target (`heads.dflash_formats.load_dflash`).
"""

from transformers import AutoConfig, AutoModel

from draftsmith.heads.eagle.model import EagleConfig, EagleHead
from draftsmith.heads.eagle.peagle import PEagleConfig, PEagleHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads

# exist_ok: a second registration of the same classes (a reloaded module) is not an error.
for _config, _model in ((MedusaConfig, MedusaHeads), (EagleConfig, EagleHead), (PEagleConfig, PEagleHead)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
