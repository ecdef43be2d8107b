"""Mixture-of-experts families over one flattened ragged batch: Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE.

Their attention is Llama's (`llama.DecoderLayer`: fused q/k/v, RoPE, paged attention; Qwen3-MoE's
per-head q/k norms; Qwen2-MoE's q/k/v biases), OLMoE's differs only in normalizing q and k over the
whole projection (and clipping q/k/v where `clip_qkv` is set). The MLP is `layers.moe.SparseMoe`:
softmax top-k routing, renormalized as each config says (Mixtral always; OLMoE, Qwen2-MoE and
Qwen3-MoE per `norm_topk_prob`), with Qwen2-MoE's sigmoid-gated shared expert; Qwen2/3-MoE layers in
`mlp_only_layers` or off the `decoder_sparse_step` keep a dense MLP, as transformers builds them.
Checkpoints are read by their Hugging Face names, one tensor per expert as `save_pretrained` and the
Hub's files have them (the GGUF loader splits llama.cpp's stacked `ffn_*_exps` into the same names).
"""

from __future__ import annotations


import torch
from torch import nn
from transformers import PretrainedConfig

from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.moe import Expert, SparseMoe
from ..layers.quantization.linear import Weight, fuse_rows
from ..layers.quantization.tensors import QuantizedTensor
from ..layers.rotary import RotaryEmbedding, apply_rotary
from .base import CausalLM, check_activation
from .decode_stack import DecodeStack
from .llama import DecoderLayer, RMSNorm

# Hugging Face names of a sparse block and its experts' gate, up and down projections, by model type.
_MIXTRAL_NAMES = ("block_sparse_moe", "w1", "w3", "w2")
_HF_EXPERTS = {"mixtral": _MIXTRAL_NAMES, "granitemoe": _MIXTRAL_NAMES,  # (Granite's: a GGUF file's, split)
               "granitemoehybrid": _MIXTRAL_NAMES,
               "lfm2_moe": ("feed_forward", "w1", "w3", "w2")}
_HF_EXPERTS_DEFAULT = ("mlp", "gate_proj", "up_proj", "down_proj")


def hf_expert_names(model_type: str) -> tuple[str, str, str, str]:
    """Hugging Face names of a model type's sparse block and its experts' gate, up and down projections."""
    return _HF_EXPERTS.get(model_type, _HF_EXPERTS_DEFAULT)


def expert_count(config: PretrainedConfig) -> int:
    """Routed experts per sparse layer (0: a dense model)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def routed_experts(config: PretrainedConfig) -> tuple[int, int]:
    """The config's experts per sparse layer and experts per token; ValueError where they do not make a
    mixture (no experts, or k outside 1..experts)."""
    experts, top_k = expert_count(config), config.num_experts_per_tok
    if experts < 1:
        raise ValueError(f"{config.model_type}: num_experts must be at least 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"{config.model_type}: num_experts_per_tok={top_k} must be between 1 and the number "
                         f"of experts ({experts})")
    return experts, top_k


def sparse_layers(config: PretrainedConfig) -> list[bool]:
    """Whether each layer's MLP is the sparse block (Qwen2/3-MoE: not in `mlp_only_layers`, and on every
    `decoder_sparse_step`-th layer; ERNIE 4.5: on every `moe_layer_interval`-th layer from
    `moe_layer_start_index` to `moe_layer_end_index`; the other families: every layer)."""
    if getattr(config, "moe_layer_start_index", None) is not None:
        start, end = config.moe_layer_start_index, config.moe_layer_end_index
        end = config.num_hidden_layers - 1 if end is None or end < 0 else end
        return [(i + 1) % config.moe_layer_interval == 0 and start <= i <= end for i in range(config.num_hidden_layers)]
    skip = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i not in skip and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


class MoeDecoderLayer(DecoderLayer):
    """Llama's attention, then the sparse block (`mlp`) or, on a dense layer, Llama's MLP."""

    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 moe: SparseMoe | None) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias=o_bias, mlp_bias=False, qk_norm=qk_norm,
                         mlp=moe is None)
        self.mlp = moe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        if self.mlp is None:
            return super().forward(x, cos, sin, kv_cache, meta, attention)
        x = x + self.attention(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class OlmoeDecoderLayer(MoeDecoderLayer):
    """OLMoE: q and k normalized over the whole projection, before RoPE; q/k/v clipped by `clip_qkv`."""

    def __init__(self, config: PretrainedConfig, head_dim: int, qkv_bias: bool, o_bias: bool, moe: SparseMoe) -> None:
        super().__init__(config, head_dim, qkv_bias, o_bias, qk_norm=False, moe=moe)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip = getattr(config, "clip_qkv", None)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(min=-self.clip, max=self.clip) for y in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.fused is not None:
            self.fused.rope_(q, cos, sin)
            self.fused.rope_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attention.forward(q, k, v, kv_cache, meta, self.scale, self.softcap)
        return self.o_proj(o.reshape(t, self.q_size))


class MoeForCausalLM(CausalLM):
    """Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE; variants (attention biases, q/k norms) come from the weights."""

    model_types = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
    cuda_graphs = False  # each expert's rows are counted on the host
    hf_shared_expert = "shared_expert"  # the checkpoint's name of the shared expert under the sparse block
    topk_softmax = False  # routing weights: softmax over all experts, then the top-k (`layers.moe`)

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False) -> None:
        super().__init__(config)
        routed_experts(config)  # (checked before anything is built)
        check_activation(config, "silu")
        self.hf_block, *self.hf_experts = hf_expert_names(config.model_type)
        self.layers = nn.ModuleList(self.make_layer(config, qkv_bias, o_bias, qk_norm,
                                                    self.make_moe(config) if sparse else None)
                                    for sparse in sparse_layers(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim)

    def make_moe(self, config: PretrainedConfig) -> SparseMoe:
        """A sparse layer's block: its routed experts, and the shared one where the config has it."""
        experts, top_k = routed_experts(config)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral has no such setting: always
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return SparseMoe(config.hidden_size, inter, experts, top_k, renormalize, shared, topk_softmax=self.topk_softmax)

    def make_layer(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                   moe: SparseMoe | None) -> MoeDecoderLayer:
        """A decoder layer around `moe` (None: a dense layer)."""
        if config.model_type == "olmoe":
            return OlmoeDecoderLayer(config, self.head_dim, qkv_bias, o_bias, moe)
        return MoeDecoderLayer(config, self.head_dim, qkv_bias, o_bias, qk_norm, moe)

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "MoeForCausalLM":
        p = "model.layers.0."
        return cls(config, qkv_bias=f"{p}self_attn.q_proj.bias" in state_dict,
                   o_bias=f"{p}self_attn.o_proj.bias" in state_dict, qk_norm=config.model_type == "qwen3_moe")

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Norms, RoPE and SiLU * up through the native fused ops (None: PyTorch); experts with tiled
        weights (quantized, bf16) grouped in one native call per layer (`SparseMoe.group_experts`)."""
        for module in self.modules():
            if type(module) in (RMSNorm, MoeDecoderLayer, OlmoeDecoderLayer, Expert):
                module.fused = ops
            if isinstance(module, SparseMoe):
                module.group_experts()

    def build_decode_stack(self) -> DecodeStack | None:
        """The native stack (`decode_stack.py`) over these layers, their sparse blocks run natively; not OLMoE's."""
        return DecodeStack.build(self, (MoeDecoderLayer,))

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """The router, each expert's fused gate/up and its down, and the shared expert with its gate."""
        moe = self.layers[layer].mlp
        if moe is None:
            return {}
        return sparse_block_weights(state_dict, layer, moe, self.hf_block, self.hf_experts, self.hf_shared_expert)


def sparse_block_weights(state_dict: dict[str, Weight], layer: int, moe: SparseMoe, hf_block: str,
                         hf_experts: list[str], hf_shared_expert: str = "shared_expert"
                         ) -> dict[str, Weight | list[Weight]]:
    """Layer `layer`'s sparse block by the model's names (`layers.{layer}.mlp.`): the router, each expert's
    fused gate/up and its down (the checkpoint's `hf_experts` names under `hf_block`), and the shared expert
    with its gate; ValueError naming a missing tensor."""
    src, dst = f"model.layers.{layer}.{hf_block}.", f"layers.{layer}.mlp."

    def tensor(name: str, what: str) -> Weight:
        if name not in state_dict:
            raise ValueError(f"the checkpoint has no tensor {name} ({what} of layer {layer}, a mixture-of-"
                             f"experts layer of {moe.num_experts} experts)")
        return state_dict[name]

    gate, up, down = hf_experts
    weights: dict[str, Weight | list[Weight]] = {
        f"{dst}router.weight": _dense(tensor(f"{src}gate.weight", "the router"))}
    for e in range(moe.num_experts):
        what = f"expert {e}"
        weights[f"{dst}experts.{e}.gate_up_proj.weight"] = fuse_rows(
            [tensor(f"{src}experts.{e}.{gate}.weight", what), tensor(f"{src}experts.{e}.{up}.weight", what)])
        weights[f"{dst}experts.{e}.down_proj.weight"] = tensor(f"{src}experts.{e}.{down}.weight", what)
    if moe.shared_expert is not None:
        what, shared = "the shared expert", f"{src}{hf_shared_expert}."
        weights[f"{dst}shared_expert.gate_up_proj.weight"] = fuse_rows(
            [tensor(f"{shared}gate_proj.weight", what), tensor(f"{shared}up_proj.weight", what)])
        weights[f"{dst}shared_expert.down_proj.weight"] = tensor(f"{shared}down_proj.weight", what)
    if moe.shared_expert_gate is not None:
        weights[f"{dst}shared_expert_gate.weight"] = _dense(tensor(f"{src}shared_expert_gate.weight",
                                                                   "the shared expert's gate"))
    return weights


def _dense(weight: Weight) -> torch.Tensor:
    """A router stays dense: a GGUF file's quantized one is dequantized (llama.cpp keeps them F32)."""
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
