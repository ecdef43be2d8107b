"""A GGUF file's metadata as a Hugging Face config, and its tensor names as Hugging Face names (the loader's
GGUF half reads the tensors themselves): the keys every architecture's converter writes here, what differs by
architecture in `gguf_families`, the experts' keys in `gguf_experts`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import transformers

from . import gguf_bert, gguf_experts, gguf_families


class MissingMetadata(ValueError):
    """A metadata key the file needs and lacks."""


# GGUF `general.architecture` -> HF config class. llama.cpp writes Mistral-style
# models and SmolLM2 as `llama`, so LlamaConfig covers them.
ARCHITECTURES: dict[str, type[transformers.PretrainedConfig]] = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen2vl": transformers.Qwen2Config,  # Qwen2/2.5-VL's language model (text positions: plain RoPE)
    "qwen3": transformers.Qwen3Config,
    "smollm3": transformers.SmolLM3Config,
    "granite": transformers.GraniteConfig,
    "seed_oss": transformers.SeedOssConfig,
    "exaone4": transformers.Exaone4Config,
    "hunyuan-dense": transformers.HunYuanDenseV1Config,
    "command-r": transformers.CohereConfig,
    "cohere2": transformers.Cohere2Config,
    "starcoder2": transformers.Starcoder2Config,
    "arcee": transformers.ArceeConfig,
    "mistral3": transformers.MistralConfig,  # Mistral Small 3.x; Ministral 3 where the file has its temperature
    "olmo2": transformers.Olmo2Config,
    "gemma": transformers.GemmaConfig,
    "gemma2": transformers.Gemma2Config,
    "gemma3": transformers.Gemma3TextConfig,
    "phi3": transformers.Phi3Config,
    "ernie4_5": transformers.Ernie4_5Config,
    "glm4": transformers.Glm4Config,
    "lfm2": transformers.Lfm2Config,
    "granitehybrid": transformers.GraniteMoeHybridConfig,  # Granite 4.0, dense or with experts
    "bert": transformers.BertConfig,  # encoders (`gguf_bert`)
    "jina-bert-v2": transformers.BertConfig,
    "nomic-bert": transformers.NomicBertConfig,
    "nomic-bert-moe": transformers.NomicBertConfig,
    **gguf_experts.ARCHITECTURES,
}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# (a few tensors have no suffix: Mamba-2's `ssm_a` and `ssm_d`)
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")

_REQUIRED = object()


def hf_config(metadata: Mapping[str, Any], tensors: Sequence[Any], arch: str) -> transformers.PretrainedConfig:
    """The HF config of a GGUF file of `arch` (one of `ARCHITECTURES`) from its metadata and tensor list, as
    transformers' own GGUF mapping reads it: `MissingMetadata` naming a required key the file lacks, ValueError
    (or transformers' validation error) for values it cannot take."""

    def field(key: str, default: Any = _REQUIRED) -> Any:
        value = metadata.get(key)
        if value is None:
            if default is _REQUIRED:
                raise MissingMetadata(f"GGUF metadata field {key!r} is missing")
            return default
        return value

    if arch in gguf_bert.ARCHITECTURES:
        return gguf_bert.hf_config(field, tensors, arch)
    hidden = field(f"{arch}.embedding_length")
    n_head = field(f"{arch}.attention.head_count")
    head_dim = field(
        f"{arch}.attention.key_length", field(f"{arch}.rope.dimension_count", hidden // n_head)
    )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = field(f"{arch}.vocab_size", len(tokens) if tokens is not None else _REQUIRED)
    has_output = any(t.name == "output.weight" for t in tensors)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", n_head),
        head_dim=head_dim,
        max_position_embeddings=field(f"{arch}.context_length"),
        **({gguf_families.LAYER_NORM[arch]: field(f"{arch}.attention.layer_norm_epsilon")}
           if arch in gguf_families.LAYER_NORM
           else {"rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon")}),
        rope_parameters={"rope_type": "default", "rope_theta": field(f"{arch}.rope.freq_base", 10000.0)},
        bos_token_id=field("tokenizer.ggml.bos_token_id", None),
        eos_token_id=field("tokenizer.ggml.eos_token_id", None),
        pad_token_id=field("tokenizer.ggml.padding_token_id", None),
        tie_word_embeddings=not has_output,
    )
    if arch in ("qwen2", "qwen2vl"):
        # Qwen2 always has Q/K/V biases (hardcoded in transformers' Qwen2 model).
        kwargs["attention_bias"] = True
    # RoPE scaling, what differs by architecture (`gguf_families`), experts (`gguf_experts`)
    kwargs["rope_parameters"] = gguf_families.rope_parameters(field, arch)
    kwargs.update(gguf_families.arch_config(arch, field, tensors, kwargs))
    experts = gguf_experts.config_fields(arch, field, {t.name for t in tensors}, kwargs["num_hidden_layers"])
    if arch == "llama" and experts:  # llama.cpp writes Mixtral as llama with experts
        return transformers.MixtralConfig(**kwargs, **experts)
    if arch == "olmo2" and "layer_types" in kwargs:  # and OLMo 3 as olmo2 with sliding layers
        return transformers.Olmo3Config(**kwargs)
    if arch == "mistral3" and "llama_4_scaling_beta" in kwargs["rope_parameters"]:
        return transformers.Ministral3Config(**kwargs)
    return ARCHITECTURES[arch](**kwargs, **experts)


def hf_name(name: str, arch: str) -> str | None:
    """The HF name a GGUF tensor of `arch` stands for; None for the tensors not read this way (experts:
    `gguf_experts`)."""
    if arch in gguf_bert.ARCHITECTURES:
        return gguf_bert.hf_name(name, arch)
    global_tensors = GLOBAL_TENSORS | gguf_families.ARCH_GLOBAL_TENSORS.get(arch, {})
    if name in global_tensors:
        return global_tensors[name]
    match = LAYER_TENSOR.fullmatch(name)
    modules = LAYER_MODULES | gguf_families.ARCH_LAYER_MODULES.get(arch, {})
    if match is None or match[2] not in modules:
        return None
    return f"model.layers.{match[1]}.{modules[match[2]]}" + (f".{match[3]}" if match[3] else "")
