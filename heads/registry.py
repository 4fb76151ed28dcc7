"""The drafter methods: one entry each, and everything else iterates over this table.

    from draftsmith.heads.registry import METHODS, get_method, method_of_folder

    method = get_method("dflash")
    head = method.load(folder, target=target, device=device, dtype=dtype)
    drafters = method.rows(head, target, "dflash", RowOptions())  # {row name: Drafter}

An entry names where each of its parts lives, as "module:attribute" strings resolved on first
use: the head's loader (`draftsmith.heads`), its drafter rows (`draftsmith.decoding`), its trainer
and parameter count (`draftsmith.train`), its exporter. The table sits at the bottom layer so that
every layer can read it; a reference is imported only by the layer that calls it.

Adding a method: its own files (head, drafter, trainer, recipe) and one `Method(...)` below. The
CLI (`--drafter KIND[:NAME]=DIR`, `draftsmith train KIND`), tune, the sweep's costs, the memory
estimate, export, the serving commands (`server`), on-policy post-training (`replay`), push and the contract test
(tests/test_method_contract.py) then take it.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path


class RegistryError(ValueError):
    """A method kind, or a folder of no known method; the message names what was expected."""


@dataclass(frozen=True)
class Method:
    kind: str  # the CLI's KIND (`--drafter KIND=DIR`, `draftsmith train KIND`) and the default row name
    title: str  # how reports and cards name it
    trainer: str  # the training module: main(argv) is its command line (`accelerate launch -m` runs it)
    recipe: str  # "module:Class" of its recipe
    loader: str  # "module:function": (folder, *, target, device, dtype) -> the trained drafter
    error: str  # "module:Exception" the loader raises on a folder it cannot use
    rows_of: str  # "module:function": (drafter, target, name, RowOptions) -> {row name: Drafter}
    parameters: str  # "module:function": (recipe, target) -> (trainable, frozen) parameter counts
    run_folder: str  # the sub-folder of a training run's `out` that holds the artifact
    model_types: tuple[str, ...] = ()  # config.json `model_type`s of its folders (empty: any transformers model)
    speculators_types: tuple[str, ...] = ()  # config.json `speculators_model_type`s it loads (vLLM speculators)
    architectures: tuple[str, ...] = ()  # config.json `architectures` of other layouts it loads
    config_keys: tuple[str, ...] = ()  # a key that marks another toolkit's layout (e.g. medusa_num_heads)
    export_formats: tuple[str, ...] = ("hf",)  # pushed layouts, the default (what a server loads) first
    exporter: str | None = None  # "module:function": (folder, out, fmt, *, num_speculative_tokens, target) -> Path
    row_suffix: str = ""  # "-chain" when the method also decodes trees (rows NAME-chain, NAME-tree)
    tree_spec: str | None = None  # what `--tree KIND=SPEC` takes for its tree rows (None: no trees)
    sized_trees: bool = False  # its trees are built from measured accuracies to a node budget (tune sizes them)
    default_k: int = 4  # K in serving commands when no evaluation says otherwise
    typical: bool = False  # takes Medusa's (lossy) typical acceptance
    trained_on_target: bool = True  # records the target it was trained on (checked before decoding)
    precheck: str | None = None  # "module:function": (target_folder, folder, target_tokenizer=) before the target loads
    recipe_names: tuple[str, ...] = ()  # its recipes in a family folder (recipes/<family>/<name>.yaml); () = (kind,)
    default_tree: str | None = None  # the tree spec a report uses when it decodes this kind as a tree
    tune_trees: tuple[str, ...] = ()  # the tree specs `tune` decodes (a tree whose tau is measured, not modelled)
    smoke_recipe: tuple[tuple[str, object], ...] = ()  # its own recipe keys of a seconds-long run on a toy target
    server: str | None = None  # "module:function": (folder, config, setting, k) -> how servers load it (publish.serve)
    format_tags: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (export format, its Hub tags) beyond vllm/sglang
    replay: str | None = None  # "module:attribute" of its `train.draft_opd.Replay`: on-policy post-training takes it
    auto_model: str | None = None  # "module:Class" of a head saved whole: `import draftsmith.heads` registers it
    # (and its config_class) with transformers' AutoModel / AutoConfig

    # ------------------------------------------------------------------ the named parts
    @property
    def recipe_files(self) -> tuple[str, ...]:
        return self.recipe_names or (self.kind,)

    def part(self, field: str):
        """The object a "module:attribute" field names, imported now."""
        ref = getattr(self, field)
        if ref is None:
            raise RegistryError(f"method {self.kind!r} has no {field}")
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name) if name else importlib.import_module(module)

    def load(self, folder, *, target, device=None, dtype=None):
        return self.part("loader")(folder, target=target, device=device, dtype=dtype)

    def rows(self, drafter, target, name: str, options=None) -> dict:
        return self.part("rows_of")(drafter, target, name, options)

    def serving(self, folder, config: dict, setting: dict, k: int) -> dict:
        """What serves a folder of this method, as plain data (`publish.serve` writes the commands)."""
        return self.part("server")(folder, config, setting, k)

    def head_parameters(self, recipe, target) -> tuple[int, int]:
        return self.part("parameters")(recipe, target)

    def export(self, folder, out, fmt: str, *, num_speculative_tokens: int | None = None, target=None) -> Path:
        """`folder` (any layout of this method) written to `out` (a new or empty folder) as `fmt`;
        K defaults to the method's. `target`: the loaded target, or a zero-argument callable loading
        it, which the exporter calls only when the layout needs its weights (Medusa heads sharing
        its lm_head); the exporter always receives the callable."""
        if target is not None and hasattr(target, "get_output_embeddings"):  # a model, not a loader
            model, target = target, lambda: model
        if fmt not in self.export_formats:
            raise RegistryError(f"format {fmt!r}: expected one of {', '.join(self.export_formats)} ({self.title})")
        k = num_speculative_tokens or self.default_k
        return self.part("exporter")(folder, out, fmt, num_speculative_tokens=k, target=target)

    @property
    def has_own_layout(self) -> bool:
        """Its folders are told by their config.json (a head's layouts), not by any model_type (a draft model)."""
        return bool(self.model_types or self.speculators_types or self.architectures or self.config_keys)

    def matches(self, config: dict) -> bool:
        """Whether a folder's config.json is one of this method's layouts."""
        return (
            config.get("model_type") in self.model_types
            or config.get("speculators_model_type") in self.speculators_types
            or any(a in self.architectures for a in config.get("architectures") or ())
            or any(key in config for key in self.config_keys)
        )


def _block_method(kind: str, title: str, recipe: str, **fields) -> Method:
    """A block head's method (a drafter on the block backbone, `heads.blocks`), whose parts follow its
    kind: heads/{kind}.py with heads/{kind}_formats.py (load_{kind}, export_folder, serving_facts),
    decoding/{kind}.py ({kind}_rows) and train/{kind}.py (the recipe class, head_parameters, REPLAY).
    Its head's errors derive from the backbone's BlockError, which its checks raise."""
    formats = f"draftsmith.heads.{kind}_formats"
    return Method(
        kind=kind,
        title=title,
        trainer=f"draftsmith.train.{kind}",
        replay=f"draftsmith.train.{kind}:REPLAY",
        recipe=f"draftsmith.train.{kind}:{recipe}",
        loader=f"{formats}:load_{kind}",
        error="draftsmith.heads.blocks:BlockError",
        rows_of=f"draftsmith.decoding.{kind}:{kind}_rows",
        parameters=f"draftsmith.train.{kind}:head_parameters",
        run_folder="head",
        model_types=(f"draftsmith_{kind}",),
        exporter=f"{formats}:export_folder",
        server=f"{formats}:serving_facts",
        **fields,
    )


METHODS: dict[str, Method] = {
    m.kind: m
    for m in (
        Method(
            kind="draft",
            title="draft model",
            trainer="draftsmith.train.draft",
            recipe="draftsmith.train.draft:DraftRecipe",
            loader="draftsmith.heads.models:load_draft_model",
            error="draftsmith.heads.models:ModelLoadError",
            rows_of="draftsmith.decoding.drafters:draft_model_rows",
            parameters="draftsmith.train.draft:head_parameters",
            smoke_recipe=(("draft_init", "truncate"), ("draft_layers", 1), ("num_draft_tokens", 2), ("lr", 1e-3)),
            run_folder="draft",
            trained_on_target=False,
            precheck="draftsmith.heads.models:check_vocab_compatible",
            exporter="draftsmith.heads.draft:export_draft",
            server="draftsmith.heads.draft:serving_facts",
        ),
        Method(
            kind="medusa",
            title="Medusa heads",
            trainer="draftsmith.train.medusa",
            recipe="draftsmith.train.medusa:MedusaRecipe",
            loader="draftsmith.heads.medusa:load_medusa",
            error="draftsmith.heads.medusa:MedusaError",
            rows_of="draftsmith.decoding.medusa:medusa_rows",
            parameters="draftsmith.train.medusa:head_parameters",
            smoke_recipe=(("num_heads", 2), ("lr", 1e-2)),
            default_tree="auto",
            run_folder="heads",
            model_types=("draftsmith_medusa", "medusa"),
            architectures=("MedusaModel",),
            config_keys=("medusa_num_heads",),
            export_formats=("vllm", "medusa", "hf"),
            exporter="draftsmith.heads.medusa:export_folder",
            server="draftsmith.heads.medusa:serving_facts",
            format_tags=(("medusa", ("tgi",)),),
            auto_model="draftsmith.heads.medusa:MedusaHeads",
            row_suffix="-chain",
            tree_spec='"auto" (from the heads\' measured accuracies) or JSON paths, e.g. [[0],[1],[0,0]]',
            typical=True,
            sized_trees=True,
        ),
        Method(
            kind="eagle",
            title="EAGLE head",
            trainer="draftsmith.train.eagle",
            replay="draftsmith.train.eagle:REPLAY",
            recipe="draftsmith.train.eagle:EagleRecipe",
            loader="draftsmith.heads.eagle:load_eagle",
            error="draftsmith.heads.eagle:EagleError",
            rows_of="draftsmith.decoding.eagle:eagle_rows",
            parameters="draftsmith.train.eagle:head_parameters",
            smoke_recipe=(
                ("version", "eagle3"),
                ("draft_vocab_size", 64),
                ("ttt_steps", 2),
                ("eval_depth", 2),
                ("lr", 3e-3),
            ),
            recipe_names=("eagle3", "eagle1", "eagle"),
            default_tree="3,4,16",
            tune_trees=("2,4,8", "3,4,8", "3,4,16", "4,4,16", "5,8,32"),
            run_folder="head",
            model_types=("draftsmith_eagle",),
            speculators_types=("eagle", "eagle3"),
            auto_model="draftsmith.heads.eagle:EagleHead",
            architectures=("LlamaForCausalLMEagle3",),
            export_formats=("vllm", "sglang", "hf"),
            exporter="draftsmith.heads.eagle:export_folder",
            server="draftsmith.heads.eagle.formats:serving_facts",
            row_suffix="-chain",
            tree_spec="DEPTH,TOP_K,TOTAL_TOKENS of an EAGLE-2 dynamic tree, e.g. 4,4,16",
            typical=True,
            default_k=3,
        ),
        Method(
            kind="peagle",
            title="P-EAGLE head",
            trainer="draftsmith.train.peagle",
            recipe="draftsmith.train.peagle:PEagleRecipe",
            loader="draftsmith.heads.eagle:load_eagle",
            error="draftsmith.heads.eagle:EagleError",
            rows_of="draftsmith.decoding.peagle:peagle_rows",
            parameters="draftsmith.train.peagle:head_parameters",
            smoke_recipe=(("num_depths", 3), ("lr", 3e-3)),
            run_folder="head",
            model_types=("draftsmith_peagle",),
            speculators_types=("peagle",),
            auto_model="draftsmith.heads.eagle:PEagleHead",
            export_formats=("vllm", "hf"),
            exporter="draftsmith.heads.eagle:export_folder",
            server="draftsmith.heads.eagle.peagle:serving_facts",
        ),
        _block_method(
            "dflash",
            "DFlash head",
            "DFlashRecipe",
            smoke_recipe=(("block_size", 4), ("max_anchors", 8), ("lr", 3e-3)),
            speculators_types=("dflash",),
            export_formats=("vllm", "hf"),
        ),
        _block_method(
            "dspark",
            "DSpark head",
            "DSparkRecipe",
            smoke_recipe=(("block_size", 3), ("max_anchors", 8), ("markov_rank", 8), ("lr", 3e-3)),
            speculators_types=("dspark",),
            export_formats=("vllm", "hf"),
        ),
        _block_method(
            "domino",
            "Domino head",
            "DominoRecipe",
            smoke_recipe=(("block_size", 4), ("max_anchors", 8), ("gru_hidden", 16), ("proj_dim", 8), ("lr", 3e-3)),
            architectures=("DominoDraftModel",),  # SpecForge's layout (no speculators class exists)
            export_formats=("hf", "specforge"),  # no server layout to default to: vLLM has no Domino drafter
            format_tags=(("specforge", ("specforge",)),),
        ),
        _block_method(
            "dflash2",
            "DFlash2 head",
            "DFlash2Recipe",
            smoke_recipe=(
                ("block_size", 4),
                ("max_anchors", 8),
                ("selector_rank", 8),
                ("selector_top_k", 4),
                ("lr", 3e-3),
            ),
            speculators_types=("dflash2",),
            export_formats=("vllm", "hf"),
        ),
    )
}


def get_method(kind: str) -> Method:
    """The entry of `kind`, else RegistryError naming the kinds there are."""
    try:
        return METHODS[kind]
    except KeyError:
        raise RegistryError(f"unknown drafter kind {kind!r}: expected one of {', '.join(METHODS)}") from None


def read_folder_config(folder) -> dict:
    """config.json of a drafter folder ({} when it is missing or not a JSON object)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def method_of_config(config: dict) -> Method | None:
    """The method whose layout a config.json is: a head method's, else (any model_type) a draft model."""
    for method in METHODS.values():
        if method.matches(config):
            return method
    return METHODS["draft"] if config.get("model_type") else None


def method_of_folder(folder) -> Method | None:
    return method_of_config(read_folder_config(folder))


@dataclass(frozen=True)
class RowOptions:
    """What `eval` asks of the rows a drafter decodes: its tree, if any, and lossy acceptance."""

    tree: str | None = None  # the method's tree spec (medusa: "auto" or JSON paths; eagle: "DEPTH,TOP_K,TOTAL")
    tree_nodes: int = 16  # node budget of an "auto" tree
    typical: tuple[float, float] | None = None  # typical acceptance (epsilon, delta): lossy
