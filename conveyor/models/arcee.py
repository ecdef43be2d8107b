"""Arcee's AFM (`arcee`: AFM-4.5B), as transformers runs it: the Llama layers with an MLP of no gate,
`down(relu(up(x)) ** 2)` (Nemotron's). A LoRA adapter may adapt every projection but `up_proj`. The native
decode stack takes the gated MLP only, so small decode batches run these eagerly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.quantization.linear import Weight
from .base import check_activation
from .llama import DecoderLayer, LlamaForCausalLM


class ArceeDecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm, mlp=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention, rows)
        x = (x if rows is None else x.index_select(0, rows)) + h
        return x + self.down_proj(F.relu(self.up_proj(self.post_attention_layernorm(x))).square())


class ArceeForCausalLM(LlamaForCausalLM):
    """AFM (`ArceeForCausalLM`)."""

    model_types = ("arcee",)
    layer_class = ArceeDecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        check_activation(config, "relu2")
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "ArceeForCausalLM":
        p = "model.layers.0."
        return cls(config, qkv_bias=f"{p}self_attn.q_proj.bias" in state_dict,
                   o_bias=f"{p}self_attn.o_proj.bias" in state_dict, mlp_bias=f"{p}mlp.up_proj.bias" in state_dict)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        src, dst = f"model.layers.{layer}.mlp.", f"layers.{layer}."
        return {f"{dst}up_proj.{kind}": state_dict[f"{src}up_proj.{kind}"] for kind in ("weight", "bias")
                if f"{src}up_proj.{kind}" in state_dict}
