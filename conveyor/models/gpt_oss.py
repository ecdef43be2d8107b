"""OpenAI's gpt-oss (transformers' `GptOssForCausalLM`, model type "gpt_oss") over one flattened ragged batch.

Attention is Llama's (`llama.DecoderLayer`: fused q/k/v, rotate-half RoPE, here YaRN through
transformers' rope functions, paged attention) with biases on q/k/v and o, and attention sinks: a
learned logit per query head that joins every softmax's denominator and has no value
(`attention_sinks`; every attention backend takes them). Sliding-window (128 tokens in the released
models) and full layers alternate as `layer_types` says, each group with its own cache
(`base.attention_layer_types`). The MLP is `layers.moe.SparseMoe` in gpt-oss's form: a router with
a bias, top-k of the logits then a softmax over those k, experts with biases and the clamped SwiGLU.

Checkpoints store each layer's experts stacked and transposed against `nn.Linear`, as `x @ W`:
`mlp.experts.gate_up_proj [E, hidden, 2 * intermediate]` with gate and up in interleaved columns
(gate 2j, up 2j + 1), `down_proj [E, intermediate, hidden]`, each with a `_bias`. `layer_weights`
cuts them into the layers' per-expert rows, gate rows first, as the other families hold them, so
every weight format (fp32, bf16, int8, int4) runs them through the same grouped experts. MXFP4
checkpoints (how gpt-oss ships: `*_blocks` and `*_scales`, rows already output features) keep their
blocks for the kernels' MXFP4 tiles (`layers.quantization.mxfp4`; "mxfp4", the default on CPU for such a
checkpoint), or are dequantized exactly for the other formats. GGUF files (`gguf_layer_weights`) hold the
experts' gate and up apart, their MXFP4 rows already in the kernels' source layout.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.moe import ClampedSwiglu, SparseMoe
from ..layers.quantization.linear import Weight, fuse_rows
from ..layers.quantization.mxfp4 import BLOCK, dequantize_mxfp4, mxfp4_tensor
from ..layers.quantization.tensors import QuantizedTensor
from ..layers.rotary import RotaryEmbedding
from .base import CausalLM
from .decode_stack import DecodeStack
from .llama import RMSNorm
from .moe import MoeDecoderLayer, routed_experts

logger = logging.getLogger(__name__)


class GptOssDecoderLayer(MoeDecoderLayer):
    """Llama's attention with q/k/v/o biases and one attention-sink logit per query head, then the sparse block."""

    def __init__(self, config: PretrainedConfig, head_dim: int, moe: SparseMoe) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, head_dim, qkv_bias=bias, o_bias=bias, qk_norm=False, moe=moe)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads), requires_grad=False)


def swiglu(config: PretrainedConfig) -> ClampedSwiglu:
    """The experts' activation from the config (transformers' defaults 1.702 and 7.0); a `hidden_act`
    other than the config's "silu", or a limit that clamps nothing sensible, is a clear error."""
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"gpt_oss: hidden_act {activation!r} is not supported (supported: silu, which gpt-oss's "
                         "experts apply as its clamped SwiGLU with swiglu_alpha and swiglu_limit)")
    alpha, limit = float(getattr(config, "swiglu_alpha", 1.702)), float(getattr(config, "swiglu_limit", 7.0))
    if not (math.isfinite(alpha) and limit > 0):  # (limit NaN fails too)
        raise ValueError(f"gpt_oss: swiglu_alpha must be finite and swiglu_limit positive, got {alpha} and {limit}")
    return ClampedSwiglu(alpha, limit)


class GptOssForCausalLM(CausalLM):
    """gpt-oss: attention with sinks on alternating sliding and full layers, gpt-oss's sparse block on every layer."""

    model_types = ("gpt_oss",)
    cuda_graphs = False  # each expert's rows are counted on the host

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        experts, top_k = routed_experts(config)
        activation = swiglu(config)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, self.head_dim, SparseMoe(config.hidden_size, config.intermediate_size, experts,
                                                                top_k, renormalize=False, activation=activation))
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "GptOssForCausalLM":
        return cls(config)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Norms and RoPE through the native fused ops (None: PyTorch); the sparse block in one native call
        per layer where its weights are tiled (`SparseMoe.group_experts`)."""
        for module in self.modules():
            if type(module) in (RMSNorm, GptOssDecoderLayer):
                module.fused = ops
            if isinstance(module, SparseMoe):
                module.group_experts()

    def build_decode_stack(self) -> DecodeStack | None:
        """The native stack (`decode_stack.py`): the sinks in its attention, the sparse blocks inside it."""
        return DecodeStack.build(self, (GptOssDecoderLayer,))

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """The attention sinks, the router, and each expert's gate/up (de-interleaved, gate rows first) and
        down, with their biases, as `nn.Linear` rows."""
        src, dst = f"model.layers.{layer}.", f"layers.{layer}."
        heads, experts = self.config.num_attention_heads, self.layers[layer].mlp.num_experts
        hidden, inter = self.config.hidden_size, self.config.intermediate_size

        def tensor(name: str, what: str, shape: tuple[int, ...]) -> Weight:
            if src + name not in state_dict:
                raise ValueError(f"the checkpoint has no tensor {src + name} ({what} of layer {layer})")
            value = state_dict[src + name]
            if tuple(value.shape) != shape:
                raise ValueError(f"{src + name} ({what} of layer {layer}) has shape {tuple(value.shape)}, the config "
                                 f"needs {shape}")
            return value

        def expert_rows(name: str, what: str, rows: int, cols: int) -> list[Weight]:
            """Each expert's `[rows, cols]` matrix (`nn.Linear`'s layout): MXFP4 blocks as they are, whose rows
            are already output features (dense where a block's scale fits no fp16), or the dense stack's
            `[cols, rows]` transposed."""
            if src + name + "_blocks" not in state_dict:
                stacked = _dense(tensor(name, what, (experts, cols, rows)))
                return [stacked[e].T for e in range(experts)]
            groups = cols // BLOCK
            blocks = tensor(name + "_blocks", what, (experts, rows, groups, BLOCK // 2))
            scales = tensor(name + "_scales", what, (experts, rows, groups))
            out: list[Weight] = []
            for e in range(experts):
                try:
                    out.append(mxfp4_tensor(blocks[e], scales[e]))
                except ValueError as exc:
                    logger.warning("%s%s, expert %d: %s; this matrix is kept dense", src, name, e, exc)
                    out.append(dequantize_mxfp4(blocks[e], scales[e]))
            return out

        if f"{src}mlp.experts.0.gate_proj.weight" in state_dict:
            return self.gguf_layer_weights(state_dict, layer)
        gate_up_bias = _dense(tensor("mlp.experts.gate_up_proj_bias", "the experts' gate/up biases",
                                     (experts, 2 * inter)))
        down_bias = _dense(tensor("mlp.experts.down_proj_bias", "the experts' down biases", (experts, hidden)))
        gate_up = expert_rows("mlp.experts.gate_up_proj", "the experts' stacked gate/up", 2 * inter, hidden)
        down = expert_rows("mlp.experts.down_proj", "the experts' stacked down", hidden, inter)
        weights: dict[str, Weight | list[Weight]] = {
            f"{dst}sinks": tensor("self_attn.sinks", f"the attention sinks, one logit per query head ({heads})",
                                  (heads,)),
            f"{dst}mlp.router.weight": _dense(tensor("mlp.router.weight", "the router", (experts, hidden))),
            f"{dst}mlp.router.bias": _dense(tensor("mlp.router.bias", "the router's bias", (experts,)))}
        gates_first = torch.cat((torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)))  # from interleaved
        for e in range(experts):
            w = gate_up[e]
            weights[f"{dst}mlp.experts.{e}.gate_up_proj.weight"] = (
                w.index_rows(gates_first) if isinstance(w, QuantizedTensor) else w[gates_first])
            weights[f"{dst}mlp.experts.{e}.gate_up_proj.bias"] = gate_up_bias[e, gates_first]
            weights[f"{dst}mlp.experts.{e}.down_proj.weight"] = (
                down[e] if isinstance(down[e], QuantizedTensor) else down[e].contiguous())
            weights[f"{dst}mlp.experts.{e}.down_proj.bias"] = down_bias[e]
        return weights


    def gguf_layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """A GGUF file's layer (`gguf_experts`): each expert's gate and up apart, rows as `nn.Linear`'s, biases
        beside them, the router as `mlp.gate`, the sinks as `self_attn.sinks.weight`."""
        src, dst = f"model.layers.{layer}.", f"layers.{layer}."

        def tensor(name: str) -> Weight:
            if src + name not in state_dict:
                raise ValueError(f"the checkpoint has no tensor {src + name} (layer {layer} of a gpt-oss GGUF file)")
            return state_dict[src + name]

        weights: dict[str, Weight | list[Weight]] = {
            f"{dst}sinks": _dense(tensor("self_attn.sinks.weight")),
            f"{dst}mlp.router.weight": _dense(tensor("mlp.gate.weight")),
            f"{dst}mlp.router.bias": _dense(tensor("mlp.gate.bias"))}
        for e in range(self.layers[layer].mlp.num_experts):
            expert = f"mlp.experts.{e}."
            weights[f"{dst}{expert}gate_up_proj.weight"] = fuse_rows(
                [tensor(f"{expert}gate_proj.weight"), tensor(f"{expert}up_proj.weight")])
            weights[f"{dst}{expert}gate_up_proj.bias"] = torch.cat(
                (_dense(tensor(f"{expert}gate_proj.bias")), _dense(tensor(f"{expert}up_proj.bias"))))
            weights[f"{dst}{expert}down_proj.weight"] = tensor(f"{expert}down_proj.weight")
            weights[f"{dst}{expert}down_proj.bias"] = _dense(tensor(f"{expert}down_proj.bias"))
        return weights


def _dense(weight: Weight) -> torch.Tensor:
    """A tensor gpt-oss's layout needs dense here (a quantized one is dequantized)."""
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
