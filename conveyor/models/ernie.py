"""Baidu's ERNIE 4.5 dense models (`ernie4_5`, e.g. ERNIE-4.5-0.3B): the Llama layers (biases on every
projection where `use_bias`), with RoPE over consecutive pairs (`pair_rope`), reordered at load so that the
Llama path runs them as they are, the native decode stack included. (transformers rotates in fp32 with fp32
cos/sin and rounds the result; in bf16 the Llama path here rotates as it does for Llama. fp32 is exact.)"""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .pair_rope import PairRope


class Ernie45ForCausalLM(PairRope, LlamaForCausalLM):
    """ERNIE 4.5 (`Ernie4_5ForCausalLM`)."""

    model_types = ("ernie4_5",)
