"""IBM Granite 3.x dense models (`granite`) and their mixture-of-experts kin (`granitemoe`, below): the Llama
(or Mixtral) layers with four scalars, as transformers applies them step by step: the embeddings times
`embedding_multiplier`, attention scaled by `attention_multiplier` (instead of `head_dim ** -0.5`), each block's
output times `residual_multiplier` before its residual add, and the logits divided by `logits_scaling`. The
dense models' small decode batches go through the native decode stack, which takes the residual multiplier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.moe import SparseMoe
from ..layers.quantization.linear import Weight
from .decode_stack import DecodeStack
from .llama import DecoderLayer, LlamaForCausalLM
from .moe import MoeDecoderLayer, MoeForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention, rows)
        h = h * self.residual_multiplier
        if rows is not None:
            x = x.index_select(0, rows)
        if self.fused is not None:  # h (a fresh output) becomes x + h, normed in the same pass
            norm = self.post_attention_layernorm
            gate_up = self.gate_up_proj(self.fused.add_rms_norm_(h, x, norm.weight, norm.eps))
            return h + self.down_proj(self.fused.silu_mul(gate_up)) * self.residual_multiplier
        x = x + h
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up) * self.residual_multiplier


class GraniteScales:
    """Granite's model-level multipliers: the embeddings times `embedding_multiplier`, the logits divided by
    `logits_scaling` (its layers take the other two)."""

    embed_tokens: torch.nn.Module

    def use_granite_scales(self, config: PretrainedConfig) -> None:
        self.embedding_multiplier, self.logits_divisor = config.embedding_multiplier, config.logits_scaling

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(GraniteScales, LlamaForCausalLM):
    """Granite 3.0-3.3 dense (`GraniteForCausalLM`)."""

    model_types = ("granite",)
    layer_class = GraniteDecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.use_granite_scales(config)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        super().use_fused_ops(ops)
        for layer in self.layers:
            layer.fused = ops

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (GraniteDecoderLayer,))


class GraniteMoeDecoderLayer(MoeDecoderLayer):
    """Granite MoE's layer: Mixtral's, with Granite's attention scale and residual multiplier."""

    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 moe: SparseMoe | None) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, qk_norm, moe)
        self.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteMoeForCausalLM(GraniteScales, MoeForCausalLM):
    """Granite 3.x MoE (`GraniteMoeForCausalLM`: granite-3.1-1b-a400m, 3b-a800m): Granite's four multipliers
    around Mixtral's layers, routed by a softmax over the top-k logits alone. Checkpoints stack the experts:
    `block_sparse_moe.input_linear` `[experts, 2 * intermediate, hidden]` (gate, then up),
    `output_linear` `[experts, hidden, intermediate]`, the router `router.layer`."""

    model_types = ("granitemoe",)
    topk_softmax = True

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False) -> None:
        super().__init__(config, qkv_bias, o_bias, qk_norm)
        self.use_granite_scales(config)

    def make_layer(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                   moe: SparseMoe | None) -> MoeDecoderLayer:
        return GraniteMoeDecoderLayer(config, self.head_dim, qkv_bias, o_bias, qk_norm, moe)

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (GraniteMoeDecoderLayer,))

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        if f"model.layers.{layer}.block_sparse_moe.input_linear.weight" not in state_dict:
            return super().layer_weights(state_dict, layer)  # (a GGUF file's experts, split as Mixtral's)
        return stacked_expert_weights(state_dict, layer, self.layers[layer].mlp.num_experts)


def stacked_expert_weights(state_dict: dict[str, Weight], layer: int, num_experts: int) -> dict[str, Weight]:
    """A Granite checkpoint's router and stacked experts (`block_sparse_moe.input_linear` `[experts, 2 *
    intermediate, hidden]`, gate then up; `output_linear`; `router.layer`) by the model's names."""
    src, dst = f"model.layers.{layer}.block_sparse_moe.", f"layers.{layer}.mlp."
    weights: dict[str, Weight] = {f"{dst}router.weight": state_dict[f"{src}router.layer.weight"]}
    gate_up, down = state_dict[f"{src}input_linear.weight"], state_dict[f"{src}output_linear.weight"]
    for e in range(num_experts):
        weights[f"{dst}experts.{e}.gate_up_proj.weight"] = gate_up[e]
        weights[f"{dst}experts.{e}.down_proj.weight"] = down[e]
    return weights
