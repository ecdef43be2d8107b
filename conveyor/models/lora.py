"""PEFT LoRA adapters on a loaded model (docs/design/lora.md): the block linears wrapped in `LoRALinear`
(`enable_lora`), and an adapter directory (`adapter_config.json` + `adapter_model.safetensors`) read,
checked against the model and turned into the slot weights of each linear (`load_adapter`).

PEFT names a module by the transformers model's path (`model.layers.3.self_attn.q_proj`); the layers here
hold q/k/v and gate/up fused, so `q_proj` is the first slice of `qkv_proj`, and a checkpoint that is fused
itself (Phi-3's `qkv_proj`, `gate_up_proj`) has one adapter over the whole projection. The scaling is
PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, r the module's rank (its A's rows,
so `rank_pattern` needs nothing more). Where the model reorders q's and k's rows at load (`models.pair_rope`),
their B rows are reordered the same way.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import ConfigError
from ..layers.lora import LoRALinear, LoRAState, SlotPart
from ..lora_request import LoRAConfig, LoRARequest

# A decoder layer's projection -> (PEFT's name of it fused, PEFT's names of its slices), relative to the layer;
# a family with other names sets its own (`lora_projections`: LFM2's).
PROJECTIONS = {
    "qkv_proj": ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "o_proj": ("self_attn.o_proj", ("self_attn.o_proj",)),
    "gate_up_proj": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "down_proj": ("mlp.down_proj", ("mlp.down_proj",)),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)\.weight$")
UNSUPPORTED_OPTIONS = (("use_dora", "DoRA"), ("alpha_pattern", "per-module lora_alpha (alpha_pattern)"),
                       ("modules_to_save", "modules_to_save (full copies of other modules)"))


@dataclass(frozen=True)
class Target:
    """Where a PEFT module's adapter goes: our `LoRALinear`'s name, its block, its first output row and
    the shape its B and A must have; the order its B's rows take where the model reorders the base's."""

    module: str
    block: int
    row: int
    out_rows: int
    in_features: int
    row_order: torch.Tensor | None = None


@dataclass
class LoRATargets:
    """The model's LoRA linears by our names, and PEFT's module names they take."""

    linears: dict[str, LoRALinear] = field(default_factory=dict)
    by_peft_name: dict[str, Target] = field(default_factory=dict)

    @property
    def leaf_names(self) -> list[str]:
        """The PEFT target names the model takes (`q_proj`, ...)."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.by_peft_name})


@dataclass
class LoRAAdapter:
    """A loaded adapter: per `LoRALinear` (our name) its `set_slot` parts, the tensors as stored (no torch op
    runs on them until the engine's thread copies them into a slot: see DEVELOPERS.md on OpenMP teams); its
    largest rank."""

    request: LoRARequest
    rank: int
    parts: dict[str, list[SlotPart]]


def enable_lora(model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> LoRATargets:
    """Wrap every q/k/v, o, gate/up and down projection of the model's decoder layers (those it has: a
    mixture-of-experts layer has no dense gate/up) in a `LoRALinear` with `config.max_loras` slots; the
    model's `lora_state` is what they read each step. The native decode stack, where the model has one,
    reads the same slots."""
    state = LoRAState()
    model.lora_state = state
    targets = LoRATargets()
    for i, layer in enumerate(model.layers):
        for name, (fused, parts) in getattr(model, "lora_projections", PROJECTIONS).items():
            base = _submodule(layer, name)
            if base is None or not hasattr(base, "in_features"):
                continue
            out = base.out_features
            slices = ([layer.q_size, layer.kv_size, layer.kv_size] if name == "qkv_proj"
                      else [out // 2, out // 2] if name == "gate_up_proj" else [out])
            wrapped = LoRALinear(base, base.in_features, slices, config.max_loras, config.max_lora_rank, dtype,
                                 device, state)
            layer.set_submodule(name, wrapped)
            ours = f"layers.{i}.{name}"
            targets.linears[ours] = wrapped
            prefix = f"model.layers.{i}."
            orders = _row_orders(model, slices) if name == "qkv_proj" else [None] * len(slices)
            whole = None  # the fused projection's row order: each block's, after the blocks before it
            if any(o is not None for o in orders):
                starts = [sum(slices[:b]) for b in range(len(slices))]
                whole = torch.cat([start + (torch.arange(n) if o is None else o)
                                   for o, n, start in zip(orders, slices, starts)])
            targets.by_peft_name[prefix + fused] = Target(ours, 0, 0, out, base.in_features, whole)
            if len(parts) > 1:
                for block, part in enumerate(parts):
                    lo, hi = wrapped.slice_range(block)
                    targets.by_peft_name[prefix + part] = Target(ours, block, lo, hi - lo, base.in_features,
                                                                 orders[block])
    if not targets.linears:
        raise ConfigError(f"{type(model).__name__} has no decoder-layer linears LoRA can adapt")
    stack = getattr(model, "decode_stack", None)
    if stack is not None:  # decode steps with adapter rows stay on the native stack
        stack.attach_lora(model.layers, dtype)
    return targets


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    """`layer`'s module at dotted `name`, None where it has none (a conv layer's attention projections)."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _row_orders(model: nn.Module, slices: list[int]) -> list[torch.Tensor | None]:
    """The order of q's, k's and v's rows as the model holds them (`models.pair_rope`), None where stored."""
    order = getattr(model, "qk_row_order", None)
    if order is None:
        return [None] * len(slices)
    return [order(slices[0]), order(slices[1]), None]


def read_adapter_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise ConfigError(f"LoRA adapter path {str(path)!r} is not a directory (it must hold adapter_config.json "
                          "and adapter_model.safetensors)")
    if not config_file.is_file():
        raise ConfigError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    if not (path / "adapter_model.safetensors").is_file():
        raise ConfigError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors (save it with "
                          "safe_serialization=True, PEFT's default)")
    return json.loads(config_file.read_text())


def load_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter: a LoRA, of rank <= `max_rank`, whose every module is one of the
    model's LoRA linears with the base's shapes; `ConfigError` naming the limit or the module otherwise."""
    path = Path(request.lora_path).expanduser()
    config = read_adapter_config(path)
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for option, what in UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise ConfigError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")
    rank = int(config.get("r", 0))
    if rank > max_rank:
        raise ConfigError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank} (raise --max-lora-rank)")
    alpha, rslora = float(config.get("lora_alpha", rank)), bool(config.get("use_rslora", False))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / "adapter_model.safetensors")).items():
        match = _KEY.match(key)
        if match is None:
            raise ConfigError(f"{where}: tensor {key!r} is not a LoRA A or B weight of a linear (supported: "
                              f"{', '.join(targets.leaf_names)})")
        tensors.setdefault(match.group(1), {})[match.group(2)] = tensor
    parts: dict[str, list[SlotPart]] = {}
    largest = 0
    for module, pair in sorted(tensors.items()):
        target = targets.by_peft_name.get(module)
        if target is None:
            raise ConfigError(f"{where}: target module {module!r} is not in the model's LoRA layers (supported "
                              f"target_modules: {', '.join(targets.leaf_names)})")
        if set(pair) != {"lora_A", "lora_B"}:
            raise ConfigError(f"{where}: module {module!r} lacks its {'lora_B' if 'lora_A' in pair else 'lora_A'}")
        a, b = pair["lora_A"], pair["lora_B"]
        r = a.shape[0]
        if r > max_rank:
            raise ConfigError(f"{where}: module {module!r} has rank {r}, over max_lora_rank={max_rank} "
                              "(raise --max-lora-rank)")
        if a.shape[1] != target.in_features or tuple(b.shape) != (target.out_rows, r):
            raise ConfigError(f"{where}: module {module!r} does not match the base model: A {list(a.shape)} and B "
                              f"{list(b.shape)}, the base takes A [r, {target.in_features}] and B "
                              f"[{target.out_rows}, r]")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if target.row_order is not None:
            b = b.index_select(0, target.row_order)
        parts.setdefault(target.module, []).append(SlotPart(target.block, target.row, a, b, scale))
        largest = max(largest, r)
    if not parts:
        raise ConfigError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request, largest, parts)
