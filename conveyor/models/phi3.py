"""Phi-3 and Phi-4 (`model_type` "phi3"; Phi-4 and Phi-4-mini use the Phi-3 architecture).

The Llama decoder layer as it is: checkpoints store q/k/v and gate/up fused (`qkv_proj`,
`gate_up_proj`), which the layer holds fused anyway, so they load as stored. What differs is RoPE:
LongRoPE's short and long factors (Phi-3-*-128k, Phi-3.5, Phi-4-mini), switched by each request's
length (`layers.rotary`), and a `partial_rotary_factor` (Phi-4-mini: 0.75), with which only the first
dimensions of each head rotate. Phi-3-mini-4k's `sliding_window` makes every layer sliding, as in
transformers. No biases; the activation is SiLU.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .base import check_activation
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    model_types = ("phi3",)
    partial_rotary = True

    def __init__(self, config: PretrainedConfig) -> None:
        check_activation(config, "silu")
        super().__init__(config)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "Phi3ForCausalLM":
        return cls(config)

    @property
    def rope_switch(self) -> int | None:
        """LongRoPE's `original_max_position_embeddings`: transformers' Phi-3 drops its cache when the
        sequence passes it (`prepare_inputs_for_generation`) and recomputes every token with the long
        factors; the engine does the same (`Engine.schedule`)."""
        return self.rotary.threshold if self.rotary.rope_type == "longrope" else None
