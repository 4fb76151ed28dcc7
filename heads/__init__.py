"""What is trained: the drafters' heads, draft-model builders, and their formats, one module per
method (the methods: `heads.registry.METHODS`).

Importing the package registers the heads that save whole (`Method.auto_model`) with transformers'
auto classes, so a folder in the draftsmith layout (their `save_*`) loads without draftsmith's loaders:

    import draftsmith.heads
    from transformers import AutoConfig, AutoModel
    heads = AutoModel.from_pretrained("runs/demo/heads")   # a MedusaHeads, an EagleHead, ...

A head whose embeddings (and full-vocabulary lm_head) are the target's is not registered: they are
not saved, so it loads only with its target (its method's loader, `Method.load`).
"""

from transformers import AutoConfig, AutoModel

from draftsmith.heads.registry import METHODS

# exist_ok: a second registration of the same classes (a reloaded module) is not an error.
for _method in METHODS.values():
    if _method.auto_model is not None:
        _model = _method.part("auto_model")
        AutoConfig.register(_model.config_class.model_type, _model.config_class, exist_ok=True)
        AutoModel.register(_model.config_class, _model, exist_ok=True)
