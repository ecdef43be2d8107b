"""Mixture-of-experts GGUF files as llama.cpp's converter writes them: `general.architecture` qwen2moe, qwen3moe,
olmoe, gpt-oss, granitemoe and granitehybrid (their stacked gate/up split in two, the latter's shared MLP
`ffn_*_shexp`), ernie4_5-moe (its shared experts' MLP
`ffn_*_shexp`, the experts' choosing bias `exp_probs_b`), lfm2moe (LFM2's layers, its first
`leading_dense_block_count` dense, `exp_probs_b` too), and Mixtral as `llama` with `llama.expert_count`; the
experts' matrices stacked in 3-D tensors (`blk.N.ffn_{gate,up,down}_exps`, experts outermost), the router
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` (one row,
often stored 1-D). gpt-oss adds biases to the router and the stacked experts, and ships the experts in MXFP4,
kept as stored (`layers.quantization.mxfp4`).

The loader asks here for the config fields the expert keys give (`config_fields`) and for the Hugging
Face names a tensor stands for (`hf_names`): one per expert for a stacked tensor, which the loader
splits into per-expert matrices (quantized blocks kept as stored where a kernel takes them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from ..layers.quantization.mxfp4 import ggml_tensor
from ..layers.quantization.tensors import KERNEL_TYPES, QuantizedTensor
from .moe import hf_expert_names

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> HF config class, for the architectures that only exist with experts.
ARCHITECTURES: dict[str, type[transformers.PretrainedConfig]] = {
    "qwen2moe": transformers.Qwen2MoeConfig,
    "qwen3moe": transformers.Qwen3MoeConfig,
    "olmoe": transformers.OlmoeConfig,
    "gpt-oss": transformers.GptOssConfig,
    "granitemoe": transformers.GraniteMoeConfig,
    "ernie4_5-moe": transformers.Ernie4_5_MoeConfig,
    "lfm2moe": transformers.Lfm2MoeConfig,
}
# Whether the k routing weights are renormalized, where the file does not say (`expert_weights_norm`):
# what llama.cpp's graph for each architecture does (Mixtral always renormalizes).
_RENORMALIZE = {"qwen2moe": False, "qwen3moe": True, "olmoe": False, "lfm2moe": True}
# Layer tensor kinds -> the HF module under the sparse block (the stacked ones: index in gate, up, down).
_BLOCK_TENSORS = {"ffn_gate_inp": "gate", "ffn_gate_shexp": "shared_expert.gate_proj",
                  "ffn_up_shexp": "shared_expert.up_proj", "ffn_down_shexp": "shared_expert.down_proj",
                  "ffn_gate_inp_shexp": "shared_expert_gate"}
_STACKED = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# ERNIE 4.5's names where they differ: its shared experts' MLP, and the bias that chooses the experts.
_ERNIE_TENSORS = {"ffn_gate_shexp": "shared_experts.gate_proj", "ffn_up_shexp": "shared_experts.up_proj",
                  "ffn_down_shexp": "shared_experts.down_proj", "exp_probs_b": "moe_statics.e_score_correction_bias"}


def config_fields(arch: str, field: Callable[..., Any], tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """The HF config fields of a file's experts (empty: a dense model). `field(key)` reads a required
    metadata key, `field(key, default)` an optional one. A `llama` file with experts is Mixtral: the
    caller builds a `MixtralConfig` when `num_local_experts` is here."""
    experts = field(f"{arch}.expert_count", 0)
    if not experts:
        return {}
    fields: dict[str, Any] = {"num_experts_per_tok": field(f"{arch}.expert_used_count")}
    if arch in ("llama", "gpt-oss", "granitemoe", "granitehybrid"):
        return fields | {"num_local_experts": experts}
    fields |= {"num_experts": experts,
               "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", _RENORMALIZE.get(arch, False)))}
    if arch in ("qwen2moe", "qwen3moe"):
        fields["moe_intermediate_size"] = field(f"{arch}.expert_feed_forward_length", None)
        # Dense layers have no router: Qwen2/3-MoE's mlp_only_layers.
        fields["mlp_only_layers"] = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = field(f"{arch}.expert_shared_feed_forward_length", 0)
    if arch == "olmoe" and (clamp := field(f"{arch}.attention.clamp_kqv", None)) is not None:
        fields["clip_qkv"] = clamp
    if arch == "ernie4_5-moe":  # (its renormalization is its own: no norm_topk_prob)
        del fields["norm_topk_prob"]
        fields |= {"moe_intermediate_size": field(f"{arch}.expert_feed_forward_length"),
                   "moe_num_shared_experts": field(f"{arch}.expert_shared_count", 0),
                   "moe_layer_start_index": field(f"{arch}.leading_dense_block_count", 0),
                   "moe_layer_interval": field(f"{arch}.interleave_moe_layer_step", 1),
                   "moe_layer_end_index": num_layers - 1}
    if arch == "lfm2moe":  # (sigmoid scores; the bias that chooses the experts where the file has it)
        fields |= {"moe_intermediate_size": field(f"{arch}.expert_feed_forward_length"),
                   "num_dense_layers": field(f"{arch}.leading_dense_block_count", 0),
                   "routed_scaling_factor": field(f"{arch}.expert_weights_scale", 1.0),
                   "use_expert_bias": any(".exp_probs_b." in name for name in tensor_names)}
    return {k: v for k, v in fields.items() if v is not None}


def hf_names(layer: int, kind: str, suffix: str, model_type: str, num_experts: int) -> list[str] | None:
    """The HF names GGUF tensor `blk.{layer}.{kind}.{suffix}` stands for: one per expert for a stacked
    tensor, else one; None for a tensor that is not the experts'."""
    block, *projections = hf_expert_names(model_type)
    prefix = f"model.layers.{layer}.{block}."
    if kind in _STACKED:
        projection = projections[_STACKED[kind]]
        return [f"{prefix}experts.{e}.{projection}.{suffix}" for e in range(num_experts)]
    if model_type == "lfm2_moe" and kind == "exp_probs_b":
        return [f"{prefix}expert_bias"]
    if model_type == "ernie4_5_moe" and kind in _ERNIE_TENSORS:
        return [f"{prefix}{_ERNIE_TENSORS[kind]}" + ("" if kind == "exp_probs_b" else f".{suffix}")]
    if kind in _BLOCK_TENSORS:
        return [f"{prefix}{_BLOCK_TENSORS[kind]}.{suffix}"]
    return None


def expert_matrices(tensor: Any, names: list[str], dtype: torch.dtype, keep_quantized: bool
                    ) -> tuple[dict[str, torch.Tensor | QuantizedTensor], bool]:
    """A GGUF reader tensor as the matrices `names` (one per expert of a stacked tensor, experts outermost),
    and whether they were kept quantized (`keep_quantized` and a type a kernel takes; else dequantized)."""
    shape = list(reversed(tensor.shape.tolist()))
    stacked = len(names) > 1
    parts = list(tensor.data) if stacked else [tensor.data]
    rows = shape[1:] if stacked else shape
    if names[0].endswith(("shared_expert_gate.weight", "e_score_correction_bias")):  # one row, stored 1-D
        rows = [1, rows[-1]]
    qtype = int(tensor.tensor_type)
    if keep_quantized and qtype == gguf.GGMLQuantizationType.MXFP4 and len(rows) == 2:
        return {name: mxfp4_matrix(part, name, rows, dtype) for name, part in zip(names, parts)}, True
    if keep_quantized and qtype in KERNEL_TYPES and len(rows) == 2:
        return {name: QuantizedTensor(torch.from_numpy(np.ascontiguousarray(part, dtype=np.uint8)), qtype, tuple(rows))
                for name, part in zip(names, parts)}, True
    return {name: torch.tensor(gguf.quants.dequantize(part, tensor.tensor_type).reshape(rows), dtype=dtype)
            for name, part in zip(names, parts)}, False


def mxfp4_matrix(part: np.ndarray, name: str, rows: list[int], dtype: torch.dtype) -> QuantizedTensor | torch.Tensor:
    """A GGUF MXFP4 matrix as stored, dense where a block's scale fits no fp16."""
    try:
        return ggml_tensor(torch.from_numpy(np.ascontiguousarray(part, dtype=np.uint8)), rows[1])
    except ValueError as exc:
        logger.warning("%s: %s; this matrix is kept dense", name, exc)
        values = gguf.quants.dequantize(part, gguf.GGMLQuantizationType.MXFP4).reshape(rows)
        return torch.tensor(values, dtype=dtype)
