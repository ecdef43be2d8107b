"""Baidu's ERNIE 4.5 dense models (`ernie4_5`, e.g. ERNIE-4.5-0.3B) and mixtures of experts (`ernie4_5_moe`,
below): the Llama layers (biases on every projection where `use_bias`), with RoPE over consecutive pairs
(`pair_rope`), reordered at load so that the Llama path runs them as they are, the native decode stack included
(the dense models'). (transformers rotates in fp32 with fp32
cos/sin and rounds the result; in bf16 the Llama path here rotates as it does for Llama. fp32 is exact.)"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..layers.moe import SparseMoe
from ..layers.quantization.linear import Weight
from .llama import LlamaForCausalLM
from .moe import MoeForCausalLM, routed_experts
from .pair_rope import PairRope


class Ernie45ForCausalLM(PairRope, LlamaForCausalLM):
    """ERNIE 4.5 (`Ernie4_5ForCausalLM`)."""

    model_types = ("ernie4_5",)


class Ernie45MoeForCausalLM(PairRope, MoeForCausalLM):
    """ERNIE 4.5's mixtures of experts (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, 300B-A47B): the attention
    above; sparse layers from `moe_layer_start_index` on, their experts chosen by the softmax plus a per-expert
    correction bias (`moe_statics.e_score_correction_bias`) and weighted by the softmax alone, renormalized
    (at least `moe_norm_min`), beside `moe_num_shared_experts` shared experts as one ungated MLP."""

    model_types = ("ernie4_5_moe",)
    hf_shared_expert = "shared_experts"

    def make_moe(self, config: PretrainedConfig) -> SparseMoe:
        experts, top_k = routed_experts(config)
        shared = config.moe_intermediate_size * (getattr(config, "moe_num_shared_experts", 0) or 0)
        return SparseMoe(config.hidden_size, config.moe_intermediate_size, experts, top_k, True, shared,
                         selection_bias=True, norm_min=config.moe_norm_min, shared_gate=False)

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        out = super().layer_weights(state_dict, layer)
        if self.layers[layer].mlp is not None:
            name = f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"
            if name not in state_dict:
                raise ValueError(f"the checkpoint has no tensor {name!r}")
            out[f"layers.{layer}.mlp.correction_bias"] = state_dict[name].reshape(-1)
        return out
