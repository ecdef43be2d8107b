"""LG's EXAONE 4.0 (`exaone4`: EXAONE-4.0-1.2B and 32B), as transformers runs it: Llama's attention with RMSNorm
over each head of q and k, and the norms after the blocks instead of before (`x + norm(attention(x))`, then
`x + norm(mlp(x))`, no input norm). With a sliding window (the 32B's three sliding layers in four), the full
layers take no RoPE (their q and k attend as projected, `DecoderLayer.rope`); without one every layer rotates.
The native decode stack takes pre-norm layers only, so small decode batches run these eagerly."""

from __future__ import annotations

from transformers import PretrainedConfig

from .llama import LlamaForCausalLM, RMSNorm
from .olmo2 import PostNorm


class Exaone4DecoderLayer(PostNorm):
    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, mlp_bias, qk_norm=True)
        self.input_layernorm = None  # (post-norm: the blocks' outputs are normed instead)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
