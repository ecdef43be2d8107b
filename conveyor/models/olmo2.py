"""AI2's OLMo 2 (`olmo2`) and OLMo 3 (`olmo3`), as transformers runs them step by step: the Llama layers with the
norms after the blocks instead of before (`x + norm(attention(x))`, then `x + norm(mlp(x))`, no input norm), and
q/k norms over the whole projection (all heads together) before RoPE. Their RMSNorm multiplies by the weight in
fp32 before casting back. OLMo 3 adds sliding-window layers (three in four), whose RoPE has no scaling where the
full layers' has (`rope_per_layer_type`). The native decode stack takes Llama's pre-norm layers only, so small
decode batches run these eagerly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.rotary import apply_rotary
from .llama import DecoderLayer, LlamaForCausalLM


class Olmo2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class PostNorm(DecoderLayer):
    """A layer whose norms come after its blocks (OLMo 2 and 3, EXAONE 4.0): `x + norm(attention(x))`, then
    `x + norm(mlp(x))`; no input norm."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.post_attention_layernorm(self.attention(x, cos, sin, kv_cache, meta, attention, rows))
        x = (x if rows is None else x.index_select(0, rows)) + h
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.silu(gate) * up))


class Olmo2DecoderLayer(PostNorm):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=False)
        eps = config.rms_norm_eps
        self.input_layernorm = None  # (post-norm: the blocks' outputs are normed instead)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.q_norm = Olmo2RMSNorm(self.q_size, eps)
        self.k_norm = Olmo2RMSNorm(self.kv_size, eps)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_norm(k).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = attention.forward(q, k, v, kv_cache, meta, self.scale).reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`)."""

    model_types = ("olmo2", "olmo3")
    layer_class = Olmo2DecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
