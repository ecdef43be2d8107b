"""What llama.cpp's converter (`convert_hf_to_gguf.py`) writes differently per GGUF architecture, read back
into the Hugging Face form the loader gives everything downstream.

- RoPE: `{arch}.rope.freq_base`, and a scaling the converter writes for the full-attention layers
  (`rope.scaling.type` linear or yarn with its factor, original length and YaRN's betas and attention factor).
  Llama 3's scaling is no metadata: the converter computes its per-frequency factors and stores them as the
  tensor `rope_freqs`, which divide the inverse frequencies (`rope_freq_factors` in the config,
  `layers.rotary`).
- Gemma (`gemma`, its layer norms `attn_norm` and `ffn_norm` alone) and Gemma 2/3 (`gemma2`, `gemma3`): the
  norm weights are stored plus one (llama.cpp's RMSNorm multiplies by the weight, Gemma's by 1 + weight);
  Gemma 2/3's layer norms named `ffn_norm` (before the MLP), `post_attention_norm`,
  `post_ffw_norm`; soft-capping and the sliding window from the metadata. Gemma 3's sliding layers have
  their own RoPE base (`rope.freq_base_swa`, llama.cpp's 10000 where an older file lacks it), every sixth
  layer is global unless the file lists `attention.sliding_window_pattern`. The query scale is not stored:
  llama.cpp takes `hidden / heads` for the 27B models (46 and 62 layers) and `head_dim` otherwise.
- Llama (`llama`), SmolLM3 (`smollm3`), Granite (`granite`, `granitemoe`) and AFM (`arcee`, its MLP `ffn_up` and
  `ffn_down` alone): q and k rows permuted to llama.cpp's RoPE layout (the loader undoes it). SmolLM3's NoPE
  layers are no metadata: llama.cpp takes every fourth (`no_rope_layer_interval`). Granite's multipliers are
  `attention.scale`, `embedding_scale`, `residual_scale` and `logit_scale` (1 where absent, as transformers'
  defaults).
- EXAONE 4.0 (`exaone4`): norms after the blocks, `post_attention_norm` and `post_ffw_norm`; q/k unpermuted;
  `attention.sliding_window` with one flag a layer in `sliding_window_pattern` (the full layers NoPE).
- Hunyuan dense (`hunyuan-dense`): q/k unpermuted; their norms (after RoPE) `attn_q_norm`, `attn_k_norm`; the
  file's RoPE base is already stretched by the model's NTK alpha.
- Cohere (`command-r`: Command R, Aya Expanse; `cohere2`: Command R7B): LayerNorms (`layer_norm_epsilon`); q and k
  as the checkpoint has them (pairs, llama.cpp's own RoPE layout; the model reorders them); `logit_scale`;
  Command R+'s q/k norms (`attn_q_norm`, one row a head); Command R7B's window with llama.cpp's pattern, every
  fourth layer full.
- StarCoder2 (`starcoder2`): LayerNorms with biases (`output_norm.bias` too), the plain MLP's `c_fc` and `c_proj`
  as `ffn_up` and `ffn_down`, q/k unpermuted; no window (llama.cpp runs every layer in full).
- Seed-OSS (`seed_oss`): the norm before the MLP is named `post_attention_norm`.
- Mistral 3 (`mistral3`: Ministral 3, and Mistral Small 3.x from newer converters): Llama's layout. Ministral 3's
  query temperature is `attention.temperature_scale` (Llama 4's beta; the original YaRN length is its floor), its
  YaRN `mscale_all_dim` `rope.scaling.yarn_log_multiplier` (taken for `mscale` too: the released configs set
  both, and they cancel).
- OLMo 2 (`olmo2`): norms after the blocks, named `post_attention_norm` and `post_ffw_norm`; q/k unpermuted.
  OLMo 3 is written as `olmo2` with `attention.sliding_window` (and a `sliding_window_pattern`, else llama.cpp's
  every fourth layer full): its sliding layers' RoPE is the file's base (`rope.freq_base_swa` where given)
  without the scaling the full layers have.
- gpt-oss (`gpt-oss`): the experts' gate and up stacked apart (the checkpoints interleave them), with biases,
  in MXFP4; the router `ffn_gate_inp` with a bias; `attn_sinks`; `post_attention_norm`; sliding layers on
  the even indices (llama.cpp's pattern) with the file's window; YaRN without truncation, as gpt-oss's.
- ERNIE 4.5 (`ernie4_5`) and GLM-4-0414 (`glm4`): q and k as the checkpoint has them (RoPE over consecutive
  pairs, which is llama.cpp's own layout; the model reorders them, `models.pair_rope`). GLM-4's gate and up
  fused in `ffn_up`, its norms after the blocks `post_attention_norm` and `post_ffw_norm` (`ffn_norm` is the
  one before the MLP), `rope.dimension_count` the rotated half of each head.
- Granite 4.0 (`granitehybrid`, dense or with experts): Granite's multipliers; `attention.head_count_kv` one count
  a layer, 0 for the Mamba-2 layers, whose tensors are `ssm_in`, `ssm_conv1d` (stored `[channels, kernel]`),
  `ssm_dt` (its bias), `ssm_a` (`-exp(A_log)`, no suffix), `ssm_d`, `ssm_norm` (one row a group) and `ssm_out`;
  the shared MLP is `ffn_{gate,up,down}` in a dense model and `ffn_*_shexp` beside the experts; RoPE only where
  `rope.scaling.finetuned` is set (the converter's flag for it; Granite 4.0-H's attention is NoPE).
- LFM2 (`lfm2`, and LFM2-MoE as `lfm2moe`: its experts in `gguf_experts`): `attention.head_count_kv` one count a
  layer, 0 for the conv layers; the conv layers'
  `shortconv.conv` (stored `[hidden, L]`), `shortconv.in_proj` and `shortconv.out_proj`; the final norm is
  `token_embd_norm`; `feed_forward_length` the MLP's width as built; q/k unpermuted.
- Phi-3 (`phi3`): q/k/v fused in `attn_qkv`, gate and up in `ffn_up` (no `ffn_gate`), as the checkpoint has
  them; `rope.dimension_count` the rotated dimensions (partial rotary); LongRoPE's factors as the tensors
  `rope_factors_long`/`rope_factors_short` and its original length as `rope.scaling.original_context_length`
  (the attention factor follows from the lengths, as transformers computes it); `attention.sliding_window`
  0 for none (Phi-4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Field = Callable[..., Any]  # field(key, default=required): a metadata value of the file

# GGUF layer tensor kinds whose Hugging Face module differs from the common table's, by architecture.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# LFM2's own names: its conv layers' blocks, the attention's output and q/k norms, the MLP's w1, w3, w2.
_LFM2_LAYERS = {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                "shortconv.out_proj": "conv.out_proj", "attn_norm": "operator_norm",
                "attn_output": "self_attn.out_proj",
                "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm", "ffn_norm": "ffn_norm",
                "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}
ARCH_LAYER_MODULES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    "exaone4": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "hunyuan-dense": {"attn_q_norm": "self_attn.query_layernorm", "attn_k_norm": "self_attn.key_layernorm"},
    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},  # (the norm before the MLP)
    "glm4": {"ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
             "post_ffw_norm": "post_mlp_layernorm"},
    "lfm2": _LFM2_LAYERS,
    "lfm2moe": _LFM2_LAYERS,
    "granitehybrid": {"ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj", "ssm_conv1d": "mamba.conv1d",
                      "ssm_norm": "mamba.norm", "ssm_dt": "mamba.dt", "ssm_a": "mamba.A", "ssm_d": "mamba.D"},
}
# Global tensors whose Hugging Face name differs from the common table's, by architecture.
ARCH_GLOBAL_TENSORS = {arch: {"token_embd_norm.weight": "model.embedding_norm.weight"}
                       for arch in ("lfm2", "lfm2moe")}
# Architectures whose short convolutions' kernels `shortconv.conv` are stored `[hidden, L]` (the checkpoints'
# `[hidden, 1, L]`).
CONV_KERNELS = ("lfm2", "lfm2moe")
NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")  # architectures whose `*norm.weight` tensors are stored plus one
# architectures whose converter permutes q and k rows (LlamaModel's)
# Architectures whose norms are LayerNorms (`attention.layer_norm_epsilon`), and their configs' name for its eps.
LAYER_NORM = {"command-r": "layer_norm_eps", "cohere2": "layer_norm_eps", "starcoder2": "norm_epsilon"}
PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe", "granitehybrid", "mistral3", "arcee")
SMOLLM3_NOPE_INTERVAL = 4  # llama.cpp's `n_no_rope_layer_step` for smollm3
_BIG_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: queries scaled by hidden / heads


def rope_parameters(field: Field, arch: str) -> dict[str, Any]:
    """transformers' `rope_parameters` (of the full-attention layers) from the file's RoPE metadata."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": field(f"{arch}.rope.freq_base", 10000.0)}
    kind = field(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        rope |= {"rope_type": "linear", "factor": field(f"{arch}.rope.scaling.factor")}
    elif kind == "yarn":
        rope |= {"rope_type": "yarn", "factor": field(f"{arch}.rope.scaling.factor"),
                 "original_max_position_embeddings": field(f"{arch}.rope.scaling.original_context_length")}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            value = field(f"{arch}.rope.scaling.{key}", None)
            if value is not None:
                rope[name] = value
    elif kind not in ("none", "longrope"):  # LongRoPE: Phi-3's factor tensors (`arch_config`)
        raise ValueError(f"GGUF RoPE scaling type {kind!r} is not supported (supported: none, linear, yarn, longrope)")
    return rope


def arch_config(arch: str, field: Field, tensors: Sequence[Any], common: dict[str, Any]) -> dict[str, Any]:
    """The config fields of `arch` beyond (or instead of) the `common` ones the loader read."""
    freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    out = {} if freqs is None else {"rope_freq_factors": np.asarray(freqs.data, dtype=np.float32).tolist()}
    if arch in ("gemma2", "gemma3"):
        out |= _gemma(arch, field, common)
    elif arch == "phi3":
        out |= _phi3(field, tensors, common)
    elif arch == "smollm3":
        out["no_rope_layer_interval"] = SMOLLM3_NOPE_INTERVAL
    elif arch == "olmo2":
        out |= _olmo3(field, common)
    elif arch == "gpt-oss":
        rope = dict(common["rope_parameters"])
        if rope.get("rope_type") == "yarn":
            rope["truncate"] = False  # (gpt-oss's YaRN keeps the correction range unrounded)
        out |= {"sliding_window": field("gpt-oss.attention.sliding_window"), "attention_bias": True,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(common["num_hidden_layers"])],
                "intermediate_size": field("gpt-oss.expert_feed_forward_length", common["intermediate_size"]),
                "rope_parameters": rope}
    elif arch == "glm4":
        head_dim = field("glm4.attention.key_length", common["hidden_size"] // common["num_attention_heads"])
        rotated = field("glm4.rope.dimension_count", head_dim // 2)
        out |= {"head_dim": head_dim, "rope_parameters": dict(common["rope_parameters"],
                                                              partial_rotary_factor=rotated / head_dim)}
    elif arch == "exaone4":
        window = field("exaone4.attention.sliding_window", 0)
        pattern = field("exaone4.attention.sliding_window_pattern", None) or [False] * common["num_hidden_layers"]
        out |= {"sliding_window": window or None,
                "layer_types": ["sliding_attention" if window and swa else "full_attention" for swa in pattern]}
    elif arch in ("command-r", "cohere2"):
        out["logit_scale"] = field(f"{arch}.logit_scale", 1.0)
        out["use_qk_norm"] = any(t.name.endswith(".attn_q_norm.weight") for t in tensors)  # (Command R+)
        if arch == "cohere2":
            layers = common["num_hidden_layers"]
            out |= {"sliding_window": field("cohere2.attention.sliding_window"),
                    "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]}
    elif arch == "mistral3":
        out |= _mistral3(field, common)
    elif arch in ("lfm2", "lfm2moe"):  # (the KV heads listed a layer, 0 for a conv layer; the MLP's width as built)
        kv_heads = common["num_key_value_heads"]
        out |= {"num_key_value_heads": max(kv_heads), "norm_eps": common["rms_norm_eps"],
                "layer_types": ["full_attention" if n else "conv" for n in kv_heads],
                "conv_L_cache": field(f"{arch}.shortconv.l_cache")}
        if arch == "lfm2":
            out["block_auto_adjust_ff_dim"] = False
    elif arch in ("granite", "granitemoe", "granitehybrid"):
        out |= {"attention_multiplier": field(f"{arch}.attention.scale", 1.0),
                "embedding_multiplier": field(f"{arch}.embedding_scale", 1.0),
                "residual_multiplier": field(f"{arch}.residual_scale", 1.0),
                "logits_scaling": field(f"{arch}.logit_scale", 1.0)}
        if arch == "granitehybrid":
            out |= _granite_hybrid(field, common)
    return out


def _granite_hybrid(field: Field, common: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0's Mamba-2 layers (0 KV heads in `attention.head_count_kv`'s list), their `ssm.*` shape, the
    shared MLP's width, and RoPE only where `rope.scaling.finetuned` says so (the converter's flag for it)."""
    kv_heads = common["num_key_value_heads"]
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * common["num_hidden_layers"]
    def ssm(key: str) -> int:
        return field(f"granitehybrid.ssm.{key}")

    heads, inner = ssm("time_step_rank"), ssm("inner_size")
    return {"num_key_value_heads": max(kv_heads) or common["num_attention_heads"],
            "layer_types": ["full_attention" if n else "linear_attention" for n in kv_heads],
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // common["hidden_size"],
            "mamba_d_state": ssm("state_size"), "mamba_d_conv": ssm("conv_kernel"),
            "mamba_n_groups": ssm("group_count"),
            "shared_intermediate_size": field("granitehybrid.expert_shared_feed_forward_length",
                                              common["intermediate_size"]),
            "position_embedding_type": "rope" if field("granitehybrid.rope.scaling.finetuned", False) else None,
            **({} if field("granitehybrid.expert_count", 0) else {"num_local_experts": 0})}  # (else `gguf_experts`)


def _gemma(arch: str, field: Field, common: dict[str, Any]) -> dict[str, Any]:
    big = common["num_hidden_layers"] == _BIG_GEMMA_LAYERS[arch]
    out: dict[str, Any] = {
        "sliding_window": field(f"{arch}.attention.sliding_window", None),
        "final_logit_softcapping": field(f"{arch}.final_logit_softcapping", None),
        "query_pre_attn_scalar": common["hidden_size"] // common["num_attention_heads"] if big else common["head_dim"],
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = field("gemma2.attn_logit_softcapping", None)
        return out
    out["rope_parameters"] = {"full_attention": common["rope_parameters"],
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": field("gemma3.rope.freq_base_swa", 10000.0)}}
    pattern = field("gemma3.attention.sliding_window_pattern", None)
    if pattern is not None:  # one flag a layer (newer converters)
        out["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    return out


def _mistral3(field: Field, common: dict[str, Any]) -> dict[str, Any]:
    rope = dict(common["rope_parameters"])
    log_mul = field("mistral3.rope.scaling.yarn_log_multiplier", None)
    if log_mul is not None:
        rope |= {"mscale": log_mul, "mscale_all_dim": log_mul}
    beta = field("mistral3.attention.temperature_scale", None)
    if beta:
        rope["llama_4_scaling_beta"] = beta
    return {"rope_parameters": rope}


def _olmo3(field: Field, common: dict[str, Any]) -> dict[str, Any]:
    """An OLMo 3 file's sliding layers (nothing for OLMo 2's, which have none)."""
    window = field("olmo2.attention.sliding_window", 0)
    if not window:
        return {}
    layers = common["num_hidden_layers"]
    pattern = field("olmo2.attention.sliding_window_pattern", None) or [(i + 1) % 4 != 0 for i in range(layers)]
    full = common["rope_parameters"]
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if swa else "full_attention" for swa in pattern],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": field("olmo2.rope.freq_base_swa", full["rope_theta"])}}}


def _phi3(field: Field, tensors: Sequence[Any], common: dict[str, Any]) -> dict[str, Any]:
    head_dim = common["hidden_size"] // common["num_attention_heads"]  # (rope.dimension_count is the rotated part)
    rotated = field("phi3.rope.dimension_count", head_dim)
    rope = dict(common["rope_parameters"], partial_rotary_factor=rotated / head_dim)
    factors = {t.name: t for t in tensors if t.name.startswith("rope_factors_")}
    if factors:
        for kind in ("long", "short"):
            tensor = factors.get(f"rope_factors_{kind}.weight")
            if tensor is None:
                raise ValueError(f"GGUF tensor 'rope_factors_{kind}.weight' is missing (LongRoPE needs both "
                                 "factor sets)")
            rope[f"{kind}_factor"] = np.asarray(tensor.data, dtype=np.float32).tolist()
        rope["rope_type"] = "longrope"
    return {"head_dim": head_dim, "rope_parameters": rope,
            "original_max_position_embeddings": field("phi3.rope.scaling.original_context_length",
                                                      common["max_position_embeddings"]),
            "sliding_window": field("phi3.attention.sliding_window", 0) or None}
