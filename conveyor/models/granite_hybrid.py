"""IBM Granite 4.0 (`granitemoehybrid`): granite-4.0-h-350m/1b/micro (dense), h-tiny and h-small (experts), and
the attention-only granite-4.0-350m/1b/micro. Granite's four multipliers (`models.granite`) around layers of two
kinds by `layer_types`: attention (NoPE unless `position_embedding_type` is "rope") or a Mamba-2 mixer
(`layers.mamba2`, its state in the KV pool), each followed by the shared MLP (`shared_mlp`, gate and up stacked
in `input_linear`) and, where the config has experts, beside it a sparse block routed by a softmax over the
top-k logits (Granite MoE's). Mamba layers keep `A`, `D` and `dt_bias` in fp32 (as vLLM does), whatever the
model's dtype.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.mamba2 import Mamba2Mixer
from ..layers.moe import Expert, SparseMoe
from ..layers.quantization.linear import Weight
from .base import CausalLM, check_activation
from .decode_stack import DecodeStack
from .granite import GraniteDecoderLayer, GraniteMoeDecoderLayer, GraniteScales, stacked_expert_weights
from .llama import RMSNorm
from .lora import PROJECTIONS
from .moe import MoeDecoderLayer, expert_count, routed_experts, sparse_block_weights

# transformers' layer type names (and the legacy ones configs on the Hub still carry) -> ours
_LAYER_TYPES = {"full_attention": "full_attention", "attention": "full_attention", "linear_attention": "mamba",
                "mamba": "mamba"}


def _layer_types(config: PretrainedConfig) -> list[str]:
    types = list(config.layer_types or ["linear_attention"] * config.num_hidden_layers)
    unknown = set(types) - set(_LAYER_TYPES)
    if unknown:
        raise ValueError(f"granitemoehybrid layer types {sorted(unknown)} are not supported (supported: "
                         f"{', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _mixer(config: PretrainedConfig) -> Mamba2Mixer:
    heads = config.mamba_n_heads
    head_dim = config.mamba_d_head if config.mamba_d_head != "auto" else (
        config.mamba_expand * config.hidden_size // heads)
    return Mamba2Mixer(config.hidden_size, heads, head_dim, config.mamba_d_state, config.mamba_n_groups,
                       config.mamba_d_conv, bool(config.mamba_conv_bias), bool(config.mamba_proj_bias),
                       config.rms_norm_eps, config.time_step_limit)


class MambaInPlaceOfAttention:
    """A layer's attention replaced by the Mamba-2 mixer (its qkv and o projections dropped)."""

    mamba: Mamba2Mixer

    def use_mamba(self, config: PretrainedConfig) -> None:
        del self.qkv_proj, self.o_proj
        self.mamba = _mixer(config)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.mamba(x, kv_cache, meta, rows)


class GraniteMambaLayer(MambaInPlaceOfAttention, GraniteDecoderLayer):
    """A dense model's Mamba layer: the mixer, then the shared MLP, with Granite's residual multiplier."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        GraniteDecoderLayer.__init__(self, config, head_dim, False, False, False, qk_norm=False)
        self.use_mamba(config)


class GraniteMambaMoeLayer(MambaInPlaceOfAttention, GraniteMoeDecoderLayer):
    """A Mamba layer of a model with experts: the mixer, then the sparse block with the shared MLP beside it."""

    def __init__(self, config: PretrainedConfig, head_dim: int, moe: SparseMoe) -> None:
        GraniteMoeDecoderLayer.__init__(self, config, head_dim, False, False, False, moe)
        self.use_mamba(config)


class GraniteHybridForCausalLM(GraniteScales, CausalLM):
    """Granite 4.0: attention and Mamba-2 layers by the config's `layer_types`, dense or with experts."""

    model_types = ("granitemoehybrid",)
    cuda_graphs = False  # prefill chunks scan their states one request at a time; experts count rows on the host
    # LoRA (`models.lora`): PEFT's names in Granite 4.0's checkpoints (the Mamba mixers', the shared MLP's stacked
    # gate/up `input_linear`); a model with experts adapts attention and the mixers
    lora_projections = {
        "qkv_proj": PROJECTIONS["qkv_proj"], "o_proj": PROJECTIONS["o_proj"],
        "mamba.in_proj": ("mamba.in_proj", ("mamba.in_proj",)),
        "mamba.out_proj": ("mamba.out_proj", ("mamba.out_proj",)),
        "gate_up_proj": ("shared_mlp.input_linear", ("shared_mlp.input_linear",)),
        "down_proj": ("shared_mlp.output_linear", ("shared_mlp.output_linear",)),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        check_activation(config, "silu")
        self.layer_types = types = _layer_types(config)
        self.use_granite_scales(config)
        bias = bool(config.attention_bias)
        if expert_count(config):
            experts, top_k = routed_experts(config)
            moes = [SparseMoe(config.hidden_size, config.intermediate_size, experts, top_k, renormalize=False,
                              shared_intermediate_size=config.shared_intermediate_size, topk_softmax=True,
                              shared_gate=False) for _ in types]
            layers: list[nn.Module] = [
                GraniteMoeDecoderLayer(config, self.head_dim, bias, bias, False, moe) if t == "full_attention"
                else GraniteMambaMoeLayer(config, self.head_dim, moe) for t, moe in zip(types, moes)]
        else:  # the dense MLP is the shared one
            dense = copy.deepcopy(config)
            dense.intermediate_size = config.shared_intermediate_size
            layers = [GraniteDecoderLayer(dense, self.head_dim, bias, bias, False, qk_norm=False)
                      if t == "full_attention" else GraniteMambaLayer(dense, self.head_dim) for t in types]
        self.layers = nn.ModuleList(layers)
        for layer in self.layers:  # (Granite 4.0-H's attention is NoPE: its position comes from the Mamba layers)
            layer.rope = config.position_embedding_type == "rope"
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_per_layer_type(config)

    @property
    def cache_windows(self) -> dict[str, int]:
        """A Mamba layer's state: its convolution's ring (`mamba_d_conv` rows), then the SSM state in fp32 (none
        for the attention-only models)."""
        mixer = next((layer.mamba for layer in self.layers if isinstance(layer, MambaInPlaceOfAttention)), None)
        if mixer is None:
            return {}
        r, s = mixer.state_slots(self.num_kv_heads, self.head_dim, torch.tensor([], dtype=self.dtype).element_size())
        return {"mamba": mixer.conv_weight.shape[-1] * r + s}

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        for module in self.modules():
            if type(module) in (RMSNorm, GraniteDecoderLayer, GraniteMambaLayer, GraniteMoeDecoderLayer,
                                GraniteMambaMoeLayer, MoeDecoderLayer, Expert):
                module.fused = ops
            if isinstance(module, SparseMoe):
                module.group_experts()

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (GraniteDecoderLayer, GraniteMoeDecoderLayer),
                                 (GraniteMambaLayer, GraniteMambaMoeLayer))

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "GraniteHybridForCausalLM":
        return cls(config)

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "CausalLM":
        """The dense shared MLP under Llama's names."""
        if not expert_count(config):
            renames = {"shared_mlp.input_linear.": "mlp.gate_up_proj.", "shared_mlp.output_linear.": "mlp.down_proj."}
            state_dict = {_renamed(name, renames): weight for name, weight in state_dict.items()}
        return super().from_state_dict(config, state_dict, dtype, device, quantization, lm_head)

    def load_fp32_parameters(self, state_dict: dict[str, Weight]) -> None:
        """Each Mamba layer's `A` (the checkpoint's `-exp(A_log)`, or a GGUF file's `A`), `D` and `dt_bias`."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, MambaInPlaceOfAttention):
                p = f"model.layers.{i}.mamba."
                a = state_dict.get(f"{p}A")
                a = -torch.exp(_required(state_dict, f"{p}A_log").float()) if a is None else a
                dt_bias = state_dict.get(f"{p}dt_bias")
                dt_bias = _required(state_dict, f"{p}dt.bias") if dt_bias is None else dt_bias
                layer.mamba.set_ssm_parameters(a, _required(state_dict, f"{p}D"), dt_bias)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """A Mamba layer's projections, convolution and norm; a sparse block's router, experts (stacked in
        the checkpoints, one per expert from a GGUF file) and the shared MLP."""
        src, dst = f"model.layers.{layer}.", f"layers.{layer}."
        out: dict[str, Weight | list[Weight]] = {}
        block = self.layers[layer]
        if isinstance(block, MambaInPlaceOfAttention):
            mixer = block.mamba
            for hf, ours, shape in (("in_proj.weight", "in_proj.weight", None), ("in_proj.bias", "in_proj.bias", None),
                                    ("out_proj.weight", "out_proj.weight", None),
                                    ("out_proj.bias", "out_proj.bias", None),
                                    ("conv1d.weight", "conv_weight", mixer.conv_weight.shape),
                                    ("conv1d.bias", "conv_bias", None), ("norm.weight", "norm_weight", (-1,))):
                if f"{src}mamba.{hf}" in state_dict:
                    weight = state_dict[f"{src}mamba.{hf}"]
                    out[f"{dst}mamba.{ours}"] = weight if shape is None else weight.reshape(shape)
        moe = getattr(block, "mlp", None)
        if isinstance(moe, SparseMoe):
            if f"{src}block_sparse_moe.input_linear.weight" in state_dict:  # (a checkpoint's: stacked)
                out |= stacked_expert_weights(state_dict, layer, moe.num_experts)
                out[f"{dst}mlp.shared_expert.gate_up_proj.weight"] = _required(
                    state_dict, f"{src}shared_mlp.input_linear.weight")
                out[f"{dst}mlp.shared_expert.down_proj.weight"] = _required(
                    state_dict, f"{src}shared_mlp.output_linear.weight")
            else:  # (a GGUF file's: one tensor per expert, the shared MLP as a shared expert)
                out |= sparse_block_weights(state_dict, layer, moe, "block_sparse_moe", ["w1", "w3", "w2"])
        return out


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(f".{old}", f".{new}")
    return name


def _required(state_dict: dict[str, Weight], name: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"the checkpoint has no tensor {name!r}")
    return state_dict[name]
