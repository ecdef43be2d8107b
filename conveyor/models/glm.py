"""Zhipu's GLM-4 (`glm`: glm-4-9b-chat-hf and its kin) and GLM-4-0414 (`glm4`: GLM-4-9B-0414, GLM-Z1): the Llama
layers with q/k/v biases, gate and up stored fused, and RoPE over consecutive pairs of the first half of each
head (`partial_rotary_factor` 0.5; `pair_rope`: reordered at load). GLM-4-0414 adds a norm after each block
(`post_self_attn_layernorm`, `post_mlp_layernorm`) before its residual add. Partial rotary keeps small decode
batches off the native decode stack (it rotates whole heads), on the eager layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.quantization.linear import Weight
from .base import check_activation
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from .pair_rope import PairRope


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention, rows)
        x = (x if rows is None else x.index_select(0, rows)) + self.post_self_attn_layernorm(h)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.post_mlp_layernorm(self.down_proj(F.silu(gate) * up))


class GlmForCausalLM(PairRope, LlamaForCausalLM):
    """GLM-4 (`GlmForCausalLM`)."""

    model_types = ("glm",)
    partial_rotary = True

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        check_activation(config, "silu")
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "GlmForCausalLM":
        return cls(config, qkv_bias="model.layers.0.self_attn.q_proj.bias" in state_dict)


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414 (`Glm4ForCausalLM`)."""

    model_types = ("glm4",)
    layer_class = Glm4DecoderLayer

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        out = super().layer_weights(state_dict, layer)
        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            key = f"model.layers.{layer}.{name}.weight"
            if key not in state_dict:
                raise ValueError(f"the checkpoint has no tensor {key!r}")
            out[f"layers.{layer}.{name}.weight"] = state_dict[key]
        return out
