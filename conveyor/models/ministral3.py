"""Mistral's Ministral 3 (`ministral3`: the language model of Ministral-3-3B/8B/14B, whose image-text checkpoints
are `mistral3`): Mistral's layers with YaRN, and each query scaled after RoPE by Llama 4's attention temperature,
`1 + beta * log(1 + floor(position / original_max_position_embeddings))` (`llama_4_scaling_beta`), as
transformers applies it. Below the original length (16,384 tokens) the factor is exactly 1, so steps whose
positions all lie below it skip the multiply and may take the native decode stack; longer ones run the eager
layers, which apply it (`DecoderLayer.q_scale`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from ..layers.attention import AttentionBackend, AttentionMetadata
from .llama import LlamaForCausalLM


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Ministral 3 (`Ministral3ForCausalLM`)."""

    model_types = ("ministral3",)

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 mlp_bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__(config, qkv_bias, o_bias, mlp_bias, qk_norm)
        rope = config.rope_parameters
        self.temperature_beta = float(rope.get("llama_4_scaling_beta") or 0.0)
        self.temperature_floor = int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Each token's query factor `[tokens, 1, 1]` in `dtype` (transformers rounds it to the query's dtype);
        None where every factor is 1 (on CUDA it is always computed: reading the positions would sync)."""
        if not self.temperature_beta or not positions.is_cuda and int(positions.max()) < self.temperature_floor:
            return None
        scale = 1 + self.temperature_beta * torch.log(1 + torch.floor(positions / self.temperature_floor))
        return scale.to(dtype)[:, None, None]

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                   metas: Sequence[AttentionMetadata], attention: AttentionBackend,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        scale = self.query_scale(positions, self.dtype)
        for layer in self.layers:
            layer.q_scale = scale
        if scale is None:
            return super().run_layers(input_ids, positions, kv_caches, metas, attention, rows)
        stack, self.decode_stack = self.decode_stack, None  # (the native stack has no query factor)
        try:
            return super().run_layers(input_ids, positions, kv_caches, metas, attention, rows)
        finally:
            self.decode_stack = stack
