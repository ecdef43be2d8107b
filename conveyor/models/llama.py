"""The Llama family (Llama, SmolLM2, SmolLM3, Mistral, Ministral, Qwen2, Qwen3, Seed-OSS, InternLM3) over one
flattened ragged batch, and the pieces other families reuse (the decoder layer, RMSNorm); `CausalLM` is in `base`,
RoPE in `layers.rotary`.
SmolLM3 is Llama with no RoPE in some layers (`no_rope_layers`: every fourth), whose q and k attend as projected.

Input is every scheduled token of every request, concatenated: `[num_tokens]` ids and positions.
Norms, projections and the MLP run on all tokens at once; attention goes through the backend,
which separates requests. q/k/v and gate/up are fused into single matmuls. The arithmetic
follows transformers' eager implementation step by step (RMSNorm in fp32, rotate-half RoPE with
cos/sin from fp32 positions) so greedy outputs match it token for token.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.rotary import apply_rotary
from .base import CausalLM
from .decode_stack import DecodeStack


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: FusedOps | None = None  # native ops (kernels.cpu_fused_ops), set for fp32 on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool, mlp: bool = True) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        if mlp:  # (a mixture-of-experts layer has its own)
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=mlp_bias)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=mlp_bias)
        self.scale = head_dim ** -0.5
        self.softcap: float | None = None
        self.sinks: nn.Parameter | None = None  # gpt-oss's attention sinks, one logit per query head
        self.q_scale: torch.Tensor | None = None  # `[tokens, 1, 1]` after RoPE: Ministral 3's, set each forward
        self.rope = True  # False: a NoPE layer (SmolLM3's), q and k unrotated
        self.fused: FusedOps | None = None  # native ops (kernels.cpu_fused_ops), set for fp32 on CPU

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        """Fused q/k/v projection, optional q/k norms, RoPE, paged attention, output projection (of `rows`
        only, where given)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and self.fused is not None and cos.shape[-1] == self.head_dim:  # in place, on the qkv output
            if self.q_norm is None:  # q's heads and then k's, side by side in each row: one pass over both
                self.fused.rope_(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            else:
                self.fused.rope_(q, cos, sin)
                self.fused.rope_(k, cos, sin)
        elif self.rope:  # (partial rotary: only the first dimensions of each head)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        sinks = None if self.sinks is None else self.sinks.float()  # (the kernels take fp32)
        o = attention.forward(q, k, v, kv_cache, meta, self.scale, self.softcap, sinks).reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o.index_select(0, rows))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for every row of x, or for `rows` only (`models.base.selects_rows`)."""
        h = self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention, rows)
        if rows is not None:
            x = x.index_select(0, rows)
        if self.fused is not None:  # h (a fresh output) becomes x + h, normed in the same pass
            norm = self.post_attention_layernorm
            gate_up = self.gate_up_proj(self.fused.add_rms_norm_(h, x, norm.weight, norm.eps))
            return h + self.down_proj(self.fused.silu_mul(gate_up))
        x = x + h
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(CausalLM):
    """The Llama family; variants (biases, q/k norms, tying) come from the weights."""

    model_types = ("llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3", "seed_oss", "internlm3",
                   # and the language models of Qwen's image-text checkpoints (`multimodal_text`)
                   "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
    partial_rotary = False  # whether the family honours `partial_rotary_factor` with the default RoPE
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(self.layer_class(config, self.head_dim, qkv_bias, o_bias, mlp_bias, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        for layer, rope in zip(self.layers, getattr(config, "no_rope_layers", None) or []):  # SmolLM3's: 0 = NoPE
            layer.rope = bool(rope)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_per_layer_type(config, self.partial_rotary)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run the Llama layers' norms, RoPE and SiLU * up through native fused ops (None: PyTorch)."""
        for module in self.modules():
            if type(module) in (RMSNorm, DecoderLayer):  # not Gemma's subclasses
                module.fused = ops

    def build_decode_stack(self) -> DecodeStack | None:
        return DecodeStack.build(self, (DecoderLayer,))

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "LlamaForCausalLM":
        p = "model.layers.0."
        return cls(config, qkv_bias=f"{p}self_attn.q_proj.bias" in state_dict,
                   o_bias=f"{p}self_attn.o_proj.bias" in state_dict,
                   mlp_bias=f"{p}mlp.gate_proj.bias" in state_dict,
                   qk_norm=f"{p}self_attn.q_norm.weight" in state_dict)
