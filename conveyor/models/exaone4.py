"""LG's EXAONE 4.0 (`exaone4`: EXAONE-4.0-1.2B and 32B), as transformers runs it: Llama's attention with RMSNorm
over each head of q and k, and the norms after the blocks instead of before (`x + norm(attention(x))`, then
`x + norm(mlp(x))`, no input norm). With a sliding window (the 32B's three sliding layers in four), the full
layers take no RoPE (their q and k attend as projected, `DecoderLayer.rope`); without one every layer rotates.
The native decode stack takes pre-norm layers only, so small decode batches run these eagerly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from .llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class Exaone4DecoderLayer(DecoderLayer):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=True)
        self.input_layernorm = None  # (post-norm: the blocks' outputs are normed instead)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.post_attention_layernorm(self.attention(x, cos, sin, kv_cache, meta, attention, rows))
        x = (x if rows is None else x.index_select(0, rows)) + h
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.silu(gate) * up))


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 (`Exaone4ForCausalLM`)."""

    model_types = ("exaone4",)
    layer_class = Exaone4DecoderLayer

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        if getattr(config, "sliding_window", None):  # (hybrid: the full layers are NoPE)
            for layer, kind in zip(self.layers, config.layer_types):
                layer.rope = kind == "sliding_attention"
