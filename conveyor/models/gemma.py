"""Gemma (1), Gemma 2 and Gemma 3 text models over one flattened ragged batch.

Hybrid attention: sliding-window and global layers alternate (`config.layer_types`), each kind
served by its own cache allocator. What differs from Llama, following transformers step by step:
embeddings scaled by `sqrt(hidden_size)`, RMSNorm as `norm(x) * (1 + weight)` in fp32, GELU (tanh) MLP;
Gemma (1) is Llama's layer with those alone. Gemma 2 and 3 add a norm after attention and one before
and after the MLP, and the attention scale `query_pre_attn_scalar ** -0.5`; Gemma 2 soft-caps attention
scores and final logits (`tanh(x / cap) * cap`); Gemma 3 adds q/k norms and uses one RoPE base for
sliding layers and another (possibly scaled) for global ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from .base import CausalLM
from .llama import DecoderLayer


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight, applied in fp32 before casting back (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, head_dim, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.q_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, eps) if qk_norm else None
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return self.feed_forward(x + self.post_attention_layernorm(h))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP block with its norms before and after, added to `x` (shared with `gemma_encoder`)."""
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma1DecoderLayer(DecoderLayer):
    """Gemma (1)'s layer: Llama's, with Gemma's norms and GELU (tanh)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, head_dim, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaForCausalLM(CausalLM):
    """Gemma (`gemma`), Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`) causal language models."""

    model_types = ("gemma", "gemma2", "gemma3_text")

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention is not a causal language model")
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} is not supported (supported: gelu_pytorch_tanh)")
        super().__init__(config)
        gemma3 = config.model_type == "gemma3_text"
        layer = Gemma1DecoderLayer if config.model_type == "gemma" else GemmaDecoderLayer
        self.layers = nn.ModuleList(layer(config, self.head_dim, qk_norm=gemma3)
                                    for _ in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.rope_per_layer_type(config)  # Gemma 3 has RoPE settings per layer type; Gemma 2 one set for all layers
        self.embed_scale = config.hidden_size ** 0.5

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "GemmaForCausalLM":
        return cls(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale).to(x.dtype)
