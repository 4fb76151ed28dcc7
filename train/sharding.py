"""Where the frozen target sits, and whether it fits, estimated before anything loads.

    target_sharding: none        # whole on every process (the default)
    target_sharding: device_map  # one process; its decoder layers spread over the visible GPUs
    target_sharding: fsdp2       # every decoder layer partitioned over the processes (torch fully_shard)
    target_sharding: zero3       # the same, partitioned by DeepSpeed ZeRO-3

- `device_map` is accelerate's big-model loading: the device map is computed from the config on
  the meta device (no decoder layer split, each GPU filled up to its free memory), the trained head
  sits on the device of the target's last hidden state, and the target's outputs (hidden states,
  logits) are moved there.
- `fsdp2` builds the target on the meta device, then loads one decoder layer at a time from the
  checkpoint onto the CPU and shards it over every process with `fully_shard`: no process ever holds
  more than its share plus one layer. A layer's forward all-gathers it and frees it again after
  (under no_grad: the target never gets gradients). The embeddings, the final norm and lm_head
  (about 5% of a 70B model) stay whole on every process, because the heads copy or share them.
  Every process must run the target's forward the same number of times (the trainers do).
- `zero3` loads the target the same way, one decoder layer at a time, but partitions each with
  DeepSpeed ZeRO-3 (`deepspeed.zero.Init(module=layer)`: every parameter flattened and split over
  the processes). Hooks gather a layer's parameters for its forward (`GatheredParameters`) and
  partition them again after. What stays whole, and the same-number-of-forwards rule, are fsdp2's.
  No DeepSpeed engine is built for the target (one over the whole model would partition the
  embeddings and lm_head too), so there is no prefetch of the next layer and no parameter offload.

The estimate (`estimate_memory`): the target's parameter bytes at the recipe's dtype, counted on the
meta device from the real config, divided over the shards, plus the trained head (its trainer's
`head_parameters`, train/<method>.py, from the recipe's shape keys: trainable parameters x 16 bytes,
fp32 weight, gradient and AdamW's two moments; frozen copies x 4) and an activation allowance (see
`activation_bytes`). fsdp2 and zero3 count alike: layers divided over the processes, plus one
gathered layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.heads.layers import layer_value
from draftsmith.heads.registry import get_method

TARGET_SHARDINGS = ("none", "device_map", "fsdp2", "zero3")
PARTITIONED = ("fsdp2", "zero3")  # every decoder layer split over the processes, gathered for its forward
HEADROOM = 0.9  # of a device's free memory: the CUDA context, fragmentation and the allocator's cache
GIB = 1024**3


class ShardingError(ValueError):
    """The target cannot be placed as the recipe asks; the message names the numbers."""


# --------------------------------------------------------------------------- the estimate


@dataclass
class MemoryEstimate:
    """Bytes per process (for device_map: on the fullest device)."""

    sharding: str
    shards: int  # processes (fsdp2, zero3) or devices (device_map) the target is spread over
    dtype: str
    target_bytes: int  # the whole target at `dtype`
    replicated_bytes: int  # what is not a decoder layer (embeddings, final norm, lm_head): never split
    layer_bytes: int  # one decoder layer
    num_layers: int
    trainable_params: int  # the head's, counted by its trainer (train/<method>.py `head_parameters`)
    frozen_head_params: int
    activations: int

    @property
    def target_share(self) -> int:
        layers = self.target_bytes - self.replicated_bytes
        if self.sharding in PARTITIONED:
            return self.replicated_bytes + math.ceil(layers / self.shards)
        if self.sharding == "device_map":  # layers never split: the fullest device holds ceil(L / devices)
            return self.replicated_bytes + math.ceil(self.num_layers / self.shards) * self.layer_bytes
        return self.target_bytes

    @property
    def gathered_layer(self) -> int:
        return self.layer_bytes if self.sharding in PARTITIONED else 0

    @property
    def head_bytes(self) -> int:
        return 16 * self.trainable_params + 4 * self.frozen_head_params

    @property
    def total(self) -> int:
        return self.target_share + self.gathered_layer + self.head_bytes + self.activations

    def with_shards(self, shards: int) -> MemoryEstimate:
        return dataclasses.replace(self, shards=shards)

    def describe(self) -> str:
        share = gib(self.target_share)
        if self.shards > 1:
            share = f"{gib(self.target_bytes)} over {self.shards} -> {share}"
        gathered = f" + one gathered layer {gib(self.gathered_layer)}" if self.gathered_layer else ""
        head = (
            f"head {gib(self.head_bytes)} ({self.trainable_params / 1e6:.1f}M trained x 16 B, "
            f"{self.frozen_head_params / 1e6:.1f}M frozen x 4 B)"
        )
        return (
            f"memory per process (estimate, target_sharding={self.sharding}): target {share} ({self.dtype}){gathered}"
            f" + {head} + activations {gib(self.activations)} = {gib(self.total)}"
        )


def gib(n: int) -> str:
    """Bytes in GiB (MiB or KiB below them: the toy models' sizes read too)."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def held_bytes(model) -> int:
    """The bytes of `model`'s parameters this process holds (its shards under fsdp2 and zero3)."""

    def local(p):  # a DTensor's shard (fsdp2); a ZeRO-3 parameter keeps its partition in ds_tensor
        return p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)

    return sum(local(p).numel() * p.element_size() for p in model.parameters())


def meta_target(recipe):
    """The target built from its config on the meta device: shapes without memory."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.heads.models import ModelLoadError, _check_folder, resolve_dtype

    where = _check_folder(recipe.target, "target")
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the target config {str(where)!r}: {str(err).splitlines()[0]}") from None
    dtype = resolve_dtype(recipe.dtype, _device(recipe))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=recipe.trust_remote_code)
    model.tie_weights()  # lost on the meta device: a tied lm_head would count twice
    return model


def _device(recipe) -> torch.device:
    return torch.device("cpu" if recipe.device == "cpu" or not torch.cuda.is_available() else "cuda")


def parameter_bytes(module) -> int:
    """Parameters (a tied weight once) x their element size."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def decoder_layers(model) -> list:
    """The model's decoder layers: the modules of its `_no_split_modules` classes (what HF's own
    device maps never split and accelerate's FSDP wraps one by one)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def activation_bytes(recipe, text_config, dtype_bytes: int) -> int:
    """The stated allowance for one micro-batch of B = batch_size rows of T = max_length tokens:
    B x T x ((layers + 1) x hidden x dtype bytes, the target's output_hidden_states, plus
    3 x vocab x 4, its fp32 logits and the drafter's logits with their gradient). The loss's own
    chunks, attention buffers and the layer activations freed as the forward goes are inside it."""
    H, L, V = text_config.hidden_size, text_config.num_hidden_layers, text_config.vocab_size
    return recipe.batch_size * recipe.max_length * ((L + 1) * H * dtype_bytes + 3 * V * 4)


def target_dims(target) -> tuple:
    """(text config, hidden size H, output vocabulary V) of `target` (meta is fine): what a head count reads."""
    tc = target.config.get_text_config()
    return tc, tc.hidden_size, target.get_output_embeddings().weight.shape[0]


def layer_params(text_config, in_features: int) -> int:
    """A Llama-shaped decoder layer (attention reading `in_features`, gated MLP, two norms)."""
    H, I = text_config.hidden_size, text_config.intermediate_size
    heads = text_config.num_attention_heads
    kv = layer_value(text_config, "num_key_value_heads") or heads
    hd = layer_value(text_config, "head_dim") or H // heads
    return in_features * (heads + 2 * kv) * hd + heads * hd * H + 3 * H * I + 2 * H


def draft_vocab(recipe, vocab_size: int) -> int:
    """The draft vocabulary a head is built with: the recipe's `draft_vocab_size`, else the size of its
    `vocab_map` file (read from the file's header, nothing loaded), else the target's `vocab_size`."""
    if recipe.draft_vocab_size:
        return recipe.draft_vocab_size
    if recipe.vocab_map:
        from safetensors import safe_open

        try:
            with safe_open(str(Path(recipe.vocab_map).expanduser()), framework="pt") as f:
                return f.get_slice("d2t").get_shape()[0]
        except Exception:  # noqa: BLE001 - a missing or bad file is the trainer's error to report; count it full
            return vocab_size
    return vocab_size


def estimate_memory(recipe, method: str, shards: int | None = None, target=None) -> MemoryEstimate:
    """The per-process estimate for `recipe` of `method` (a kind of heads/registry.py; its trainer
    counts the head: `head_parameters`), see the module docstring. `shards`: the processes
    (fsdp2, zero3; default: this launch's WORLD_SIZE) or the GPUs (device_map; default: the visible ones)."""
    target = meta_target(recipe) if target is None else target
    tc = target.config.get_text_config()
    dtype = next(target.parameters()).dtype
    layers = decoder_layers(target)
    total = parameter_bytes(target)
    if shards is None:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        launched = {"fsdp2": processes, "zero3": processes, "device_map": max(1, torch.cuda.device_count())}
        shards = launched.get(recipe.target_sharding, 1)
    trainable, frozen = get_method(method).head_parameters(recipe, target)  # train/<method>.py's count
    return MemoryEstimate(
        recipe.target_sharding,
        shards,
        str(dtype).removeprefix("torch."),
        total,
        total - sum(parameter_bytes(m) for m in layers),
        parameter_bytes(layers[0]) if layers else 0,
        len(layers),
        trainable,
        frozen,
        activation_bytes(recipe, tc, torch.finfo(dtype).bits // 8),
    )


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(free bytes, what they are) of the device a process trains on: CUDA's free memory, or on
    the CPU the machine's available RAM shared by the processes started on it."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:  # MemAvailable counts the page cache the kernel would give back; MemFree does not
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0, "unknown (no /proc/meminfo: not checked)"
    return int(line.split()[1]) * 1024 // local, f"available RAM per process ({local} on this machine)"


def fitting_shards(estimate: MemoryEstimate, free: int, most: int = 1024) -> int | None:
    """The fewest processes (fsdp2, zero3) or devices (device_map) with which the estimate fits `free`."""
    if estimate.sharding not in (*PARTITIONED, "device_map"):
        return None
    return next((n for n in range(1, most + 1) if estimate.with_shards(n).total <= HEADROOM * free), None)


def check_fits(estimate: MemoryEstimate, free: int, where: str) -> None:
    """A refusal naming the numbers when the estimate exceeds HEADROOM of `free` (0: unknown, no check)."""
    if free <= 0 or estimate.total <= HEADROOM * free:
        return
    need = fitting_shards(estimate, free)
    if estimate.sharding == "none":
        hint = "; set target_sharding: fsdp2 or zero3 (several processes) or device_map (one process, several GPUs)"
    elif need is not None:
        hint = f"; {need} {'processes' if estimate.sharding in PARTITIONED else 'devices'} of this size would fit"
    else:
        hint = "; even one layer per device does not fit: a smaller dtype, batch_size or max_length"
    raise ShardingError(
        f"the target does not fit: {estimate.describe()}, more than {HEADROOM:.0%} of the {gib(free)} {where}{hint}"
    )


def estimate_report(recipe, method: str, shards: int | None, device_gib: float | None) -> str:
    """`--estimate-memory`: the per-process estimate and, given a device size, the fewest
    processes (fsdp2, zero3) or GPUs (device_map) that fit, or whether one device does (none)."""
    estimate = estimate_memory(recipe, method, shards=shards)
    if device_gib is None:
        return estimate.describe()
    free = int(device_gib * GIB)
    if recipe.target_sharding == "none":
        verdict = "fits" if estimate.total <= HEADROOM * free else "does not fit"
        return f"{estimate.describe()}\n{verdict} one {device_gib:g} GiB device ({HEADROOM:.0%} usable)"
    need = fitting_shards(estimate, free)
    what = "processes" if recipe.target_sharding in PARTITIONED else "GPUs in one process"
    if need is None:
        return f"{estimate.describe()}\nno number of {device_gib:g} GiB devices fits"
    fits = f"fits with {need} {what} of {device_gib:g} GiB ({HEADROOM:.0%} usable)"
    return f"{estimate.describe()}\n{fits}: {estimate.with_shards(need).describe()}"


def check_process_count(sharding: str, processes: int) -> None:
    if sharding == "device_map" and processes > 1:
        raise ShardingError(
            f"target_sharding = device_map spreads the target over the GPUs of one process, but {processes} were "
            "started: use fsdp2 or zero3"
        )
    if sharding in PARTITIONED and processes == 1:
        raise ShardingError(
            f"target_sharding = {sharding} partitions the target over processes, but 1 was started: "
            "launch N with accelerate launch --num_processes N"
        )


# --------------------------------------------------------------------------- loading


def plan_device_map(recipe, target, dtype: torch.dtype) -> tuple[dict, torch.device]:
    """(device map, device of the target's last hidden state) from the meta `target`: accelerate's
    placement over the visible GPUs (the CPU when there is none or device = cpu), no decoder layer
    split, each device filled up to HEADROOM of its free memory. A target that would spill to the
    CPU or the disk is refused."""
    from accelerate import infer_auto_device_map

    on_gpu = torch.cuda.is_available() and recipe.device != "cpu"
    if on_gpu:
        budget = {i: int(HEADROOM * torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())}
    else:
        budget = {"cpu": int(HEADROOM * available_bytes(torch.device("cpu"))[0]) or 2**60}
    layers = sorted({type(m).__name__ for m in decoder_layers(target)})
    device_map = infer_auto_device_map(target, max_memory=budget, no_split_module_classes=layers, dtype=dtype)
    spilled = sorted({str(d) for d in device_map.values()} - {str(k) for k in budget})
    if spilled:
        free = ", ".join(f"{'cuda:' if on_gpu else ''}{k} {gib(v)}" for k, v in budget.items())
        raise ShardingError(
            f"target_sharding = device_map: the target ({gib(parameter_bytes(target))} in "
            f"{str(dtype).removeprefix('torch.')}) does not fit {HEADROOM:.0%} of the free memory ({free}); "
            f"accelerate would put part of it on {', '.join(spilled)}. "
            "Use more GPUs, or target_sharding: fsdp2 over several processes"
        )
    names = {id(m): name for name, m in target.named_modules()}
    last = names[id(target.get_output_embeddings())]
    owner = max((k for k in device_map if k == "" or last == k or last.startswith(k + ".")), key=len)
    placed = device_map[owner]
    return device_map, torch.device(f"cuda:{placed}" if isinstance(placed, int) else placed)


def load_device_map(recipe, dtype: torch.dtype, device_map: dict, head_device: torch.device):
    """The target loaded by `device_map` (`plan_device_map`), its outputs moved to `head_device`."""
    from draftsmith.heads.models import load_causal_lm

    model = load_causal_lm(
        recipe.target,
        device=None,
        dtype=dtype,
        role="target",
        trust_remote_code=recipe.trust_remote_code,
        device_map=device_map,
    )
    model.register_forward_hook(_outputs_to(head_device))
    return model


def _outputs_to(device: torch.device):
    """A forward hook moving the target's logits and hidden states (each layer's on its own
    device) to `device`, where the trained head reads them."""

    def hook(module, args, output):
        if getattr(output, "logits", None) is not None:
            output.logits = output.logits.to(device)
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h.to(device) for h in output.hidden_states)
        return output

    return hook


class Checkpoint:
    """The tensors of a safetensors checkpoint folder, read one by one by name."""

    def __init__(self, folder: Path, sharding: str):
        from safetensors import safe_open

        self.folder, self.sharding, self.where = folder, sharding, {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        else:
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), file.name))
        if not self.where:
            raise ShardingError(
                f"target_sharding = {sharding} reads safetensors: {str(folder)!r} has no *.safetensors file"
            )

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise ShardingError(
                f"target_sharding = {self.sharding}: the checkpoint {str(self.folder)!r} has no tensor {name!r} "
                "(its names differ from the model's; load it with target_sharding: none or device_map)"
            )
        with safe_open(str(self.folder / self.where[name]), framework="pt") as f:
            return f.get_tensor(name)


def _local_folder(path: str) -> Path:
    from draftsmith.heads.models import is_hub_id

    if not is_hub_id(path):
        return Path(path).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))


def load_partitioned(recipe, device: torch.device, dtype: torch.dtype):
    """The target built on the meta device, each decoder layer loaded whole onto the CPU and at
    once partitioned over every process (fsdp2: `fully_shard`, resharded after each forward; zero3:
    DeepSpeed's `zero.Init`, gathered around each forward); the rest loaded whole on `device`. Its
    fingerprint is taken from the whole tensors as they pass (a partitioned model cannot sample its
    own full weights without a collective)."""
    import torch.distributed as dist
    from accelerate.utils import set_module_tensor_to_device

    from draftsmith.heads.models import ModelLoadError, check_safetensors, fingerprint_of, fingerprint_sample

    how = recipe.target_sharding
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardingError(
            f"target_sharding = {how} partitions the target over processes: start them with accelerate launch"
        )
    partition = _fsdp2_partitioner(device) if how == "fsdp2" else _zero3_partitioner(dtype)
    folder = _local_folder(recipe.target)
    check_safetensors(folder, "target", ModelLoadError)
    target = meta_target(recipe)
    checkpoint = Checkpoint(folder, how)
    prefix = {id(m): name for name, m in target.named_modules()}
    samples, placed = {}, set()

    def load(name: str, to) -> None:
        value = checkpoint.tensor(name).to(dtype)
        samples[name] = fingerprint_sample(value)
        set_module_tensor_to_device(target, name, to, value=value)
        placed.add(name)

    for layer in decoder_layers(target):
        for local, _ in list(layer.named_parameters()):
            load(f"{prefix[id(layer)]}.{local}", "cpu")
        partition(layer)
    for name, _ in list(target.named_parameters()):
        if name not in placed:
            load(name, device)
    for name, _ in list(target.named_buffers()):
        set_module_tensor_to_device(target, name, device)
    if getattr(target.config.get_text_config(), "tie_word_embeddings", False):
        target.tie_weights()
    target.draftsmith_fingerprint = fingerprint_of(target.config, samples)
    return target.eval()


def _fsdp2_partitioner(device: torch.device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return lambda layer: fully_shard(layer, mesh=mesh, reshard_after_forward=True)  # the root default keeps it whole


def _zero3_partitioner(dtype: torch.dtype):
    """ZeRO-3 partitioning of one layer at a time, moved to DeepSpeed's device for this process
    (accelerate has set it) and split there, with the hooks that gather it for its forward."""
    try:
        import deepspeed
    except ImportError:
        raise ShardingError('target_sharding = zero3 needs DeepSpeed: pip install -e ".[deepspeed]"') from None
    # Stage 3 without an optimizer: only the parameter partitioning is used (no engine, no batch sizes).
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }

    def partition(layer) -> None:
        deepspeed.zero.Init(module=layer, config_dict_or_path=config, dtype=dtype)
        layer.register_forward_pre_hook(_gather_zero3)
        layer.register_forward_hook(_release_zero3, always_call=True)

    return partition


def _gather_zero3(layer, args) -> None:
    """Every process all-gathers the layer's partitions before its forward (a collective: all run it)."""
    import deepspeed

    layer._zero3_gathered = deepspeed.zero.GatheredParameters(list(layer.parameters()), modifier_rank=None)
    layer._zero3_gathered.__enter__()


def _release_zero3(layer, args, output) -> None:
    """After the forward each process keeps its own partition again (nothing is written back)."""
    gathered = layer.__dict__.pop("_zero3_gathered", None)
    if gathered is not None:
        gathered.__exit__(None, None, None)
