"""BigCode's StarCoder2 (`starcoder2`: starcoder2-3b/7b/15b), as transformers runs it: Mistral's attention with
biases on every projection, LayerNorms with biases, and a plain MLP, `c_proj(gelu_tanh(c_fc(x)))` with biases
(no gate). A LoRA adapter may adapt the attention's projections (its MLP's names are not the gated MLP's). The
native decode stack takes Llama's layers only, so small decode batches run these eagerly."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.quantization.linear import Weight
from .base import check_activation
from .llama import DecoderLayer, LlamaForCausalLM


class Starcoder2DecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=False, mlp=False)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, bias=mlp_bias)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, bias=mlp_bias)
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention, rows)
        x = (x if rows is None else x.index_select(0, rows)) + h
        return x + self.c_proj(F.gelu(self.c_fc(self.post_attention_layernorm(x)), approximate="tanh"))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 (`Starcoder2ForCausalLM`)."""

    model_types = ("starcoder2",)
    layer_class = Starcoder2DecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        check_activation(config, "gelu_pytorch_tanh")
        config = copy.copy(config)
        config.rms_norm_eps = config.norm_epsilon  # (what the shared layers read; every norm here is a LayerNorm)
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, bias=mlp_bias)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "Starcoder2ForCausalLM":
        bias = getattr(config, "use_bias", True)
        return cls(config, qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        src, dst = f"model.layers.{layer}.mlp.", f"layers.{layer}."
        out: dict[str, Weight | list[Weight]] = {}
        for name in ("c_fc", "c_proj"):
            for kind in ("weight", "bias"):
                if f"{src}{name}.{kind}" in state_dict:
                    out[f"{dst}{name}.{kind}"] = state_dict[f"{src}{name}.{kind}"]
        return out
