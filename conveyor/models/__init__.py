"""Model code owned by the engine, and weight loading."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ..layers.quantization.linear import Weight
from .arcee import ArceeForCausalLM
from .base import CausalLM
from .cohere import CohereForCausalLM
from .encoder import EncoderModel
from .ernie import Ernie45ForCausalLM, Ernie45MoeForCausalLM
from .exaone4 import Exaone4ForCausalLM
from .gemma import GemmaForCausalLM
from .glm import Glm4ForCausalLM, GlmForCausalLM
from .gpt_oss import GptOssForCausalLM
from .granite import GraniteForCausalLM, GraniteMoeForCausalLM
from .granite_hybrid import GraniteHybridForCausalLM
from .hunyuan import HunyuanForCausalLM
from .lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from .llama import LlamaForCausalLM
from .ministral3 import Ministral3ForCausalLM
from .moe import MoeForCausalLM
from .olmo2 import Olmo2ForCausalLM
from .phi3 import Phi3ForCausalLM
from .pooling import ENCODERS, encoder_class
from .starcoder2 import Starcoder2ForCausalLM

FAMILIES: tuple[type[CausalLM] | type[EncoderModel], ...] = (
    LlamaForCausalLM, GemmaForCausalLM, MoeForCausalLM, GptOssForCausalLM, Phi3ForCausalLM, GraniteForCausalLM,
    Olmo2ForCausalLM, Ernie45ForCausalLM, GlmForCausalLM, Glm4ForCausalLM, Ministral3ForCausalLM, Exaone4ForCausalLM,
    GraniteMoeForCausalLM, HunyuanForCausalLM, CohereForCausalLM, Starcoder2ForCausalLM, ArceeForCausalLM,
    Ernie45MoeForCausalLM, Lfm2ForCausalLM, Lfm2MoeForCausalLM, GraniteHybridForCausalLM, *ENCODERS.values())
MODEL_CLASSES = {t: cls for cls in FAMILIES for t in cls.model_types}


def build_model(config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                device: torch.device, quantization: str = "none", lm_head: bool = True) -> CausalLM | EncoderModel:
    """The engine's model for a checkpoint, by its `model_type`; `quantization` as `LLM` resolved it;
    `lm_head=False` for a pooling model."""
    cls = encoder_class(config) or MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(MODEL_CLASSES))})")
    return cls.from_state_dict(config, state_dict, dtype, device, quantization, lm_head)
