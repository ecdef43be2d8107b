"""Liquid AI's LFM2 (`lfm2`: LFM2-350M to 2.6B), as transformers runs it: Llama's pre-norm layers (RMSNorm,
SwiGLU MLP, per-head q/k norms before RoPE, tied embeddings) where most layers replace attention with a short
convolution (`layer_types` "conv"): `in_proj` makes B, C and x, and the block's output is
`out_proj(C * conv(B * x))`, `conv` a causal depthwise convolution over the last `conv_L_cache` (3) inputs
(`layers.short_conv`, its state in the KV pool). The final norm is `embedding_norm`. The MLP's width is
`intermediate_size` adjusted as the config says (`block_auto_adjust_ff_dim`). LFM2-MoE (`lfm2_moe`) keeps the
layers and replaces the MLP of all but the first `num_dense_layers` with sigmoid-routed experts (`layers.moe`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.moe import Expert, SparseMoe
from ..layers.quantization.linear import Weight
from ..layers.short_conv import short_conv, state_slots_per_row
from .base import CausalLM, check_activation
from .decode_stack import DecodeStack
from .llama import DecoderLayer, RMSNorm
from .lora import PROJECTIONS
from .moe import MoeDecoderLayer, hf_expert_names, routed_experts, sparse_block_weights

# LFM2's names for the tensors Llama's layers hold, by `CausalLM.from_state_dict`'s (Hugging Face) names.
_RENAMES = (("self_attn.out_proj", "self_attn.o_proj"), ("self_attn.q_layernorm", "self_attn.q_norm"),
            ("self_attn.k_layernorm", "self_attn.k_norm"), ("feed_forward.w1", "mlp.gate_proj"),
            ("feed_forward.w3", "mlp.up_proj"), ("feed_forward.w2", "mlp.down_proj"),
            ("operator_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))


def mlp_width(config: PretrainedConfig) -> int:
    """The feed-forward width transformers' Lfm2MLP builds from the config."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):  # (LFM2-MoE's dense layers take it as it is)
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * -(-width // config.block_multiple_of)
    return width


def _layer_types(config: PretrainedConfig) -> list[str]:
    types = list(config.layer_types)
    unknown = set(types) - {"full_attention", "conv"}
    if unknown:
        raise ValueError(f"LFM2 layer types {sorted(unknown)} are not supported (supported: full_attention, conv)")
    return types


def _hf_name(name: str) -> str:
    if name == "model.embedding_norm.weight":
        return "model.norm.weight"
    for old, new in _RENAMES:
        name = name.replace(f".{old}.", f".{new}.")
    return name


class ShortConv(nn.Module):
    """The block in place of attention: `out_proj(C * conv(B * x))`, B, C and x the thirds of `in_proj(x)`."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.conv_bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, 1, config.conv_L_cache))
        self.conv_bias = nn.Parameter(torch.empty(hidden)) if bias else None

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        y = c * short_conv(b * h, self.conv_weight, kv_cache, meta, self.conv_bias)
        return self.out_proj(y if rows is None else y.index_select(0, rows))


class ConvInPlaceOfAttention:
    """A Llama layer's attention replaced by the short convolution (its qkv and o projections dropped)."""

    conv: ShortConv

    def use_conv(self, config: PretrainedConfig) -> None:
        del self.qkv_proj, self.o_proj
        self.conv = ShortConv(config)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.conv(x, kv_cache, meta, rows)


class ShortConvLayer(ConvInPlaceOfAttention, DecoderLayer):
    """A conv layer: the short convolution in place of attention; the norms and the MLP are Llama's."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        DecoderLayer.__init__(self, config, head_dim, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        self.use_conv(config)


class ShortConvMoeLayer(ConvInPlaceOfAttention, MoeDecoderLayer):
    """LFM2-MoE's conv layer: the short convolution, then the sparse block (or, on a dense layer, the MLP)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, moe: SparseMoe | None) -> None:
        MoeDecoderLayer.__init__(self, config, head_dim, qkv_bias=False, o_bias=False, qk_norm=False, moe=moe)
        self.use_conv(config)


class Lfm2ForCausalLM(CausalLM):
    """LFM2: attention and conv layers by the config's `layer_types`."""

    model_types = ("lfm2",)
    # LoRA (`models.lora`): PEFT's names of the projections in LFM2's checkpoints (conv layers' in_proj/out_proj)
    lora_projections = {
        "qkv_proj": PROJECTIONS["qkv_proj"],
        "o_proj": ("self_attn.out_proj", ("self_attn.out_proj",)),
        "conv.in_proj": ("conv.in_proj", ("conv.in_proj",)),
        "conv.out_proj": ("conv.out_proj", ("conv.out_proj",)),
        "gate_up_proj": ("feed_forward.gate_up_proj", ("feed_forward.w1", "feed_forward.w3")),
        "down_proj": ("feed_forward.w2", ("feed_forward.w2",)),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.layer_types = types = _layer_types(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.head_dim, False, False, False, qk_norm=True) if t == "full_attention"
            else ShortConvLayer(config, self.head_dim) for t in types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_per_layer_type(config)

    @property
    def cache_windows(self) -> dict[str, int]:
        """A conv layer's ring: `conv_L_cache` rows of `state_slots_per_row` slots."""
        r = state_slots_per_row(self.config.hidden_size, self.num_kv_heads, self.head_dim)
        return {"conv": self.config.conv_L_cache * r}

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        for module in self.modules():
            if type(module) in (RMSNorm, DecoderLayer, ShortConvLayer):
                module.fused = ops

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (DecoderLayer,), (ShortConvLayer,))

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "Lfm2ForCausalLM":
        return cls(config)

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "CausalLM":
        """LFM2's tensors under Llama's names; the config with the MLP width the layers have and the norms'
        eps under Llama's name (a copy: the caller's config is unchanged)."""
        config = copy.deepcopy(config)
        config.rms_norm_eps, config.intermediate_size = config.norm_eps, mlp_width(config)
        renamed = {_hf_name(name): weight for name, weight in state_dict.items()}
        return super().from_state_dict(config, renamed, dtype, device, quantization, lm_head)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """A conv layer's tensors (a missing one is named by the strict load)."""
        src, dst = f"model.layers.{layer}.conv.", f"layers.{layer}.conv."
        names = (("in_proj.weight", "in_proj.weight"), ("in_proj.bias", "in_proj.bias"),
                 ("out_proj.weight", "out_proj.weight"), ("out_proj.bias", "out_proj.bias"),
                 ("conv.weight", "conv_weight"), ("conv.bias", "conv_bias"))
        return {dst + ours: state_dict[src + hf] for hf, ours in names if src + hf in state_dict}


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (`lfm2_moe`: LFM2-8B-A1B): LFM2's layers, the first `num_dense_layers` with the dense MLP, the
    others a sparse block of sigmoid-routed experts (a per-expert bias choosing them, the chosen scores
    renormalized, `routed_scaling_factor`)."""

    model_types = ("lfm2_moe",)
    cuda_graphs = False  # each expert's rows are counted on the host

    def __init__(self, config: PretrainedConfig) -> None:
        CausalLM.__init__(self, config)  # (LFM2's layers are built here, with their sparse blocks)
        self.layer_types = _layer_types(config)
        experts, top_k = routed_experts(config)
        check_activation(config, "silu")
        moes = [SparseMoe(config.hidden_size, config.moe_intermediate_size, experts, top_k, config.norm_topk_prob,
                          selection_bias=config.use_expert_bias, sigmoid_scale=config.routed_scaling_factor)
                if i >= config.num_dense_layers else None for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(
            MoeDecoderLayer(config, self.head_dim, False, False, qk_norm=True, moe=moe) if t == "full_attention"
            else ShortConvMoeLayer(config, self.head_dim, moe) for t, moe in zip(self.layer_types, moes))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_per_layer_type(config)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        for module in self.modules():
            if type(module) in (RMSNorm, MoeDecoderLayer, ShortConvMoeLayer, Expert):
                module.fused = ops
            if isinstance(module, SparseMoe):
                module.group_experts()

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (MoeDecoderLayer,), (ShortConvMoeLayer,))

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """The conv layer's tensors, and a sparse block's router, experts and choosing bias."""
        out = super().layer_weights(state_dict, layer) if self.layer_types[layer] == "conv" else {}
        moe = self.layers[layer].mlp
        if moe is not None:
            block, *experts = hf_expert_names("lfm2_moe")
            out |= sparse_block_weights(state_dict, layer, moe, block, experts)
            bias = f"model.layers.{layer}.{block}.expert_bias"
            if bias in state_dict:
                out[f"layers.{layer}.mlp.correction_bias"] = state_dict[bias]
        return out
