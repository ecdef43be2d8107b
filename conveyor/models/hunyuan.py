"""Tencent's Hunyuan dense models (`hunyuan_v1_dense`: Hunyuan-0.5B/1.8B/4B/7B-Instruct), as transformers runs
them: the Llama layers with RMSNorm over each head of q and k after RoPE (`query_layernorm`, `key_layernorm`),
and RoPE's base stretched by a fixed NTK `alpha` (`rope_type` "dynamic" with an `alpha`: the base times
`alpha ** (d / (d - 2))`, whatever the length; llama.cpp's converter writes that base as the file's). The native
decode stack takes Llama's layers only, so small decode batches run these eagerly."""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.quantization.linear import Weight
from ..layers.rotary import apply_rotary
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class HunyuanDecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)  # (after RoPE, unlike Qwen3's)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin))
        k = self.k_norm(apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = attention.forward(q, k, v, kv_cache, meta, self.scale).reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


def ntk_alpha_base(config: PretrainedConfig, head_dim: int) -> float | None:
    """RoPE's base stretched by the config's fixed NTK `alpha` (transformers' `ntk_alpha`), None without one."""
    rope = config.rope_parameters or {}
    if rope.get("rope_type") != "dynamic" or not rope.get("alpha"):
        return None
    return rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2))


class HunyuanForCausalLM(LlamaForCausalLM):
    """Hunyuan dense (`HunYuanDenseV1ForCausalLM`)."""

    model_types = ("hunyuan_v1_dense",)
    layer_class = HunyuanDecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = ntk_alpha_base(config, head_dim)
        if base is not None:  # (the default RoPE over the stretched base: not the length-dependent NTK)
            config = copy.copy(config)
            config.rope_parameters = {"rope_type": "default", "rope_theta": base}
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        src, dst = f"model.layers.{layer}.self_attn.", f"layers.{layer}."
        out: dict[str, Weight | list[Weight]] = {}
        for hf, ours in (("query_layernorm", "q_norm"), ("key_layernorm", "k_norm")):
            if f"{src}{hf}.weight" not in state_dict:
                raise ValueError(f"the checkpoint has no tensor {src}{hf}.weight")
            out[f"{dst}{ours}.weight"] = state_dict[f"{src}{hf}.weight"]
        return out
