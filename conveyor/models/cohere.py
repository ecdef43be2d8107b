"""Cohere's Command R / Aya Expanse (`cohere`) and Command R7B / Aya (`cohere2`) models, as transformers runs
them: one LayerNorm (mean subtracted, no bias, in fp32) before attention and the MLP, which run side by side on
it (`x + attention(n) + mlp(n)`), RoPE over consecutive pairs (`pair_rope`: reordered at load), and the logits
times `logit_scale` (divided by its inverse, exact for the powers of two the released models use). Command R+
normalizes each head of q and k before RoPE (`use_qk_norm`, weights per head, reordered with the rows).
`cohere2` adds sliding layers, three in four, whose neighbours, the full layers, take no RoPE. The native decode
stack takes Llama's layers only, so small decode batches run these eagerly."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.quantization.linear import Weight
from ..layers.rotary import apply_rotary
from .llama import DecoderLayer, LlamaForCausalLM
from .pair_rope import PairRope, reorder_rows


class CohereLayerNorm(nn.Module):
    """LayerNorm without a bias over the last dimension, in fp32; `shape` (heads, head_dim) for q/k norms."""

    def __init__(self, shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class CohereDecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=False)
        eps = config.layer_norm_eps
        self.input_layernorm = CohereLayerNorm(config.hidden_size, eps)
        self.post_attention_layernorm = None  # (one norm feeds both blocks)
        if getattr(config, "use_qk_norm", False):
            self.q_norm = CohereLayerNorm((self.num_heads, head_dim), eps)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, head_dim), eps)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rotary(q.float(), cos.float(), sin.float()).to(q.dtype), apply_rotary(
                k.float(), cos.float(), sin.float()).to(k.dtype)
        o = attention.forward(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), kv_cache, meta,
                              self.scale).reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o.index_select(0, rows))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        n = self.input_layernorm(x)
        h = self.attention(n, cos, sin, kv_cache, meta, attention, rows)
        if rows is not None:
            x, n = x.index_select(0, rows), n.index_select(0, rows)
        gate, up = self.gate_up_proj(n).chunk(2, dim=-1)
        return x + h + self.down_proj(F.silu(gate) * up)


class CohereForCausalLM(PairRope, LlamaForCausalLM):
    """Command R, Aya Expanse (`CohereForCausalLM`) and Command R7B (`Cohere2ForCausalLM`)."""

    model_types = ("cohere", "cohere2")
    layer_class = CohereDecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        config = copy.copy(config)
        config.rms_norm_eps = config.layer_norm_eps  # (what the shared layers read; every norm here is Cohere's)
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        self.norm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)
        self.logits_divisor = 1.0 / config.logit_scale
        if config.model_type == "cohere2" and getattr(config, "sliding_window", None):
            for layer, kind in zip(self.layers, config.layer_types):  # (the full layers: NoPE)
                layer.rope = kind == "sliding_attention"

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """The fused q/k/v reordered for RoPE (`PairRope`), and the q/k norms' weights with their rows."""
        out = super().layer_weights(state_dict, layer)
        for name in ("q_norm", "k_norm"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            if key in state_dict:
                weight = state_dict[key]
                order = self.qk_row_order(weight.numel())
                out[f"layers.{layer}.{name}.weight"] = reorder_rows(weight.reshape(-1), order).reshape(weight.shape)
        return out
