"""Gemma 3 run both ways (`use_bidirectional_attention`: EmbeddingGemma), as a pooling model (`models.encoder`).

The layers, their weights and their loading are the causal Gemma 3's (`models.gemma`, built from the same
config with the flag off); only the attention differs: every token of a prompt attends to the whole prompt in
the global layers and to the tokens less than `sliding_window` away in the sliding ones (transformers halves
the checkpoint's window for this model: its config holds the half plus one), over the pass's own keys and
values, with Gemma's scale, q/k norms and RoPE per layer type. Its sentence-transformers files (mean pooling,
two Dense projections, Normalize) make the embedding (`models.sentence_transformers`).
"""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..layers.quantization.linear import Weight
from ..layers.rotary import apply_rotary
from .encoder import EncoderModel, bidirectional_attention
from .gemma import GemmaDecoderLayer, GemmaForCausalLM


class Gemma3EncoderModel(EncoderModel):
    model_types = ("gemma3_text",)  # (with use_bidirectional_attention: `is_bidirectional_gemma`)

    def __init__(self, config: PretrainedConfig, decoder: GemmaForCausalLM) -> None:
        super().__init__(config)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ConfigError("a bidirectional Gemma with attn_logit_softcapping is not supported")
        self.head_dim = decoder.head_dim
        self.decoder = decoder
        self.windows = [config.sliding_window - 1 if t == "sliding_attention" else None for t in config.layer_types]

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "Gemma3EncoderModel":
        """The causal Gemma 3 of the same weights, loaded as any (`lm_head` must be False), run both ways."""
        if lm_head:
            raise ConfigError("a bidirectional Gemma (use_bidirectional_attention) embeds prompts (runner='pooling', "
                              "--runner pooling), it cannot generate text")
        causal = copy.copy(config)
        causal.use_bidirectional_attention = False
        decoder = GemmaForCausalLM.from_state_dict(causal, state_dict, dtype, device, quantization, lm_head=False)
        model = cls(config, decoder)
        model.dtype = dtype
        return model

    @classmethod
    def classifier(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> None:
        return None

    @classmethod
    def default_pooling(cls, config: PretrainedConfig) -> str:
        return "MEAN"  # (EmbeddingGemma's; its sentence-transformers files say so too)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.decoder.embed(input_ids)
        rotary = self.decoder.rotary_for_layer(positions, x.dtype)
        for layer, (cos, sin), window in zip(self.decoder.layers, rotary, self.windows):
            x = self.layer(layer, x, cos, sin, lengths, window)
        return self.decoder.norm(x)

    @staticmethod
    def layer(layer: GemmaDecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
              window: int | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = layer.qkv_proj(layer.input_layernorm(x)).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        q = apply_rotary(layer.q_norm(q.view(t, layer.num_heads, layer.head_dim)), cos, sin)
        k = apply_rotary(layer.k_norm(k.view(t, layer.num_kv_heads, layer.head_dim)), cos, sin)
        v = v.view(t, layer.num_kv_heads, layer.head_dim)
        h = layer.o_proj(bidirectional_attention(q, k, v, lengths, window, layer.scale))
        return layer.feed_forward(x + layer.post_attention_layernorm(h))


def is_bidirectional_gemma(config: PretrainedConfig) -> bool:
    return config.model_type == "gemma3_text" and bool(getattr(config, "use_bidirectional_attention", False))
