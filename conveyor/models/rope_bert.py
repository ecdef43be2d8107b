"""BERT with rotary positions: NomicBERT (nomic-embed-text v1 / v1.5 / v2-moe, nomic-bert-2048) and GTE
(gte-base-en-v1.5, gte-large-en-v1.5, gte-multilingual-base and its reranker: the `new` and `gte`
checkpoints) as pooling models (`models.encoder`; docs/design/pooling.md, "Encoder models").

BERT's post-norm layers (attention, then the MLP, each added to its input and LayerNorm'd) with RoPE on the
queries and keys instead of a position table; word and token-type embeddings, LayerNorm'd; a gated MLP
(NomicBERT: SiLU without biases, GTE: GELU, its down projection with a bias) or BERT's plain one (a
NomicBERT config's `gelu`), every `moe_every_n_layers`-th from the second a mixture of experts in
nomic-embed-text-v2-moe (`NomicExperts`).

Both families are published with remote code, and transformers now runs them natively under its own
names, so two namings of each are read: the original checkpoints' (NomicBERT's `encoder.layers.N.attn.Wqkv`,
`mlp.fc11` / `fc12` / `fc2`, `norm1` / `norm2`, `emb_ln`; GTE's `new.encoder.layer.N.attention.qkv_proj`,
`mlp.up_gate_proj`, `attn_ln` / `mlp_ln`) and transformers' (`layers.N.self_attn.q_proj`, ...,
`post_attention_layernorm` / `post_mlp_layernorm`). NomicBERT's original config names its fields as GPT-2
does (`n_embd`, `n_layer`, `activation_function`, `rotary_emb_base`, ...), which transformers' NomicBertConfig
leaves aside (its defaults happen to be v1.5's shape): where they are present they are read first. GTE's
original config (`model_type` "new") is read as it stands (`RAW_CONFIG_TYPES`), since transformers knows
it only under remote code.

Context: NomicBERT's trained length (`max_trained_positions`, 2,048), or with `rotary_scaling_factor` its
`n_positions` under dynamic NTK scaling past the trained length, the frequencies of each prompt's own length
(as the original computes them for one text alone); GTE's `max_position_embeddings`. The original GTE's
`rope_scaling` of type "ntk" holds for every position (its cache is built scaled): the base times the factor,
every frequency then divided by the factor to the power `2 / head_dim` (transformers' "linear" type).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from ..errors import ConfigError
from ..kernels.fused_ops import FusedOps
from ..layers.quantization.linear import Weight, dequantized, fuse_rows
from ..layers.rotary import RotaryEmbedding, apply_rotary, with_lengths
from .encoder import CheckpointTensors, EncoderModel, bidirectional_attention, linear_from, pair_token_types

# GTE's original config: transformers reads it only through remote code, so it is read as written
RAW_CONFIG_TYPES = ("new",)
GATED = {"swiglu": "silu", "geglu": "gelu", "glu": "sigmoid"}  # NomicBERT's gated activations
# The prefixes a task model puts before the encoder's tensors
PREFIXES = ("new.", "gte.", "nomic_bert.", "model.")


@dataclass(frozen=True)
class Shape:
    """What differs between the families and their config styles, in one place."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    act: str
    gated: bool
    eps: float
    types: int
    qkv_bias: bool  # (and the output projection's)
    up_bias: bool
    down_bias: bool
    rope: PretrainedConfig  # what `RotaryEmbedding` reads: `rope_parameters` and the length it scales past
    context: int
    experts: int = 0  # NomicBERT's mixture-of-experts layers: every `moe_every`-th from the second
    top_k: int = 0
    moe_every: int = 0
    renormalize: bool = False

    def is_moe(self, layer: int) -> bool:
        return self.moe_every > 0 and layer % self.moe_every == 1


def nomic_shape(config: PretrainedConfig) -> Shape:
    """NomicBERT under its original field names where the config has them, else transformers'."""
    def field(original: str, native: str, default: object = None) -> object:
        value = getattr(config, original, None)
        return value if value is not None else getattr(config, native, default)

    if getattr(config, "prenorm", False):
        raise ConfigError("NomicBERT with prenorm=True is not supported (supported: the released post-norm layers)")
    if getattr(config, "rotary_emb_interleaved", False) or getattr(config, "rotary_emb_scale_base", None) is not None:
        raise ConfigError("NomicBERT with interleaved or xPos rotary embeddings is not supported (supported: "
                          "rotary_emb_interleaved=False, rotary_emb_scale_base=None)")
    hidden, heads = int(field("n_embd", "hidden_size")), int(field("n_head", "num_attention_heads"))
    if getattr(config, "n_embd", None) is not None:  # the original config
        act = config.activation_function
        gated = act in GATED
        theta, fraction = float(config.rotary_emb_base), float(getattr(config, "rotary_emb_fraction", 1.0))
        if fraction <= 0:
            raise ConfigError("NomicBERT without rotary embeddings (rotary_emb_fraction=0) is not supported")
        trained = context = int(getattr(config, "max_trained_positions", 2048))
        rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": fraction}
        factor = getattr(config, "rotary_scaling_factor", None)
        if factor:  # dynamic NTK past the trained length
            if fraction != 1.0:
                raise ConfigError("NomicBERT with both rotary_scaling_factor and rotary_emb_fraction < 1 is not "
                                  "supported")
            rope = {"rope_type": "dynamic", "rope_theta": theta, "factor": float(factor)}
            context = int(getattr(config, "n_positions", trained))
    else:  # transformers' NomicBertConfig: a gated MLP of `hidden_act`, no biases, its own RoPE settings
        act, gated = config.hidden_act, True
        trained = context = int(config.max_position_embeddings)
        rope = {"rope_type": "default"} | dict(config.rope_parameters or {})
    moe_every = int(getattr(config, "moe_every_n_layers", 0) or 0)
    experts = int(getattr(config, "num_experts", 0) or 0) if moe_every else 0
    return Shape(hidden, int(field("n_layer", "num_hidden_layers")), heads, int(field("n_inner", "intermediate_size")),
                 GATED.get(act, act), gated, float(field("layer_norm_epsilon", "layer_norm_eps", 1e-12)),
                 int(getattr(config, "type_vocab_size", 2) or 0), bool(getattr(config, "qkv_proj_bias", False)),
                 bool(getattr(config, "mlp_fc1_bias", False)), bool(getattr(config, "mlp_fc2_bias", False)),
                 rope_config(hidden, heads, hidden // heads, trained, rope), context, experts,
                 int(getattr(config, "moe_top_k", 0) or 0), moe_every,
                 bool(getattr(config, "moe_normalize_expert_weights", False)))


def gte_shape(config: PretrainedConfig) -> Shape:
    """GTE, transformers' config (`gte`) or the original (`new`)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if getattr(config, "position_embedding_type", "rope") != "rope":
        raise ConfigError(f"GTE with position_embedding_type {config.position_embedding_type!r} is not supported "
                          "(supported: rope)")
    if getattr(config, "layer_norm_type", "layer_norm") != "layer_norm" or getattr(config, "logn_attention_scale",
                                                                                     False):
        raise ConfigError("GTE with RMSNorm or log-n attention scaling is not supported (supported: layer_norm, "
                          "logn_attention_scale=False)")
    context = int(config.max_position_embeddings)
    if config.model_type == "new":  # (transformers files `rope_theta` under `rope_parameters` when it finds a scaling)
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope = {"rope_type": "default", "rope_theta": float(params.get("rope_theta",
                                                                       getattr(config, "rope_theta", 160000.0)))}
        scaling = getattr(config, "rope_scaling", None)
        if scaling:  # the original's fixed NTK: base * f, every frequency then divided by f ** (2 / head_dim)
            if scaling.get("type") != "ntk" or scaling.get("mixed_b") is not None:
                raise ConfigError(f"GTE rope_scaling {scaling} is not supported (supported: type 'ntk' without "
                                  "mixed_b)")
            factor = float(scaling["factor"])
            rope = {"rope_type": "linear", "rope_theta": rope["rope_theta"] * factor,
                    "factor": factor ** (2 / (hidden // heads))}
    else:
        rope = {"rope_type": "default"} | dict(config.rope_parameters or {})
    return Shape(hidden, config.num_hidden_layers, heads, config.intermediate_size, config.hidden_act, True,
                 config.layer_norm_eps, int(config.type_vocab_size or 0), True, False, True,
                 rope_config(hidden, heads, hidden // heads, context, rope), context)


def model_shape(config: PretrainedConfig) -> Shape:
    return nomic_shape(config) if config.model_type == "nomic_bert" else gte_shape(config)


def rope_config(hidden: int, heads: int, head_dim: int, trained: int, params: dict) -> PretrainedConfig:
    return PretrainedConfig(hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim,
                            max_position_embeddings=trained, rope_parameters=params)


class NomicExperts(nn.Module):
    """NomicBERT's mixture-of-experts MLP (nomic-embed-text-v2-moe): the router's softmax (fp32) over the experts,
    the top k kept with their probabilities (renormalized only where the config says so), each expert
    `act(x W1^T) W2` (both `[intermediate, hidden]`), then one bias shared by all."""

    def __init__(self, shape: Shape, act: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(shape.hidden, shape.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(shape.experts, shape.intermediate, shape.hidden))
        self.w2 = nn.Parameter(torch.empty(shape.experts, shape.intermediate, shape.hidden))
        self.bias = nn.Parameter(torch.empty(shape.hidden))
        self.top_k, self.renormalize, self.act = shape.top_k, shape.renormalize, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        slots = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=len(self.w1)).tolist()  # (host work O(experts))
        tokens, weights = slots // self.top_k, weights.flatten()[slots].to(x.dtype)
        out = torch.zeros_like(x)
        for expert, (rows, w) in enumerate(zip(tokens.split(counts), weights.split(counts))):
            if len(rows):
                h = self.act(x[rows] @ self.w1[expert].t()) @ self.w2[expert]
                out.index_add_(0, rows, h * w[:, None])
        return out + self.bias


class RopeBertLayer(nn.Module):
    def __init__(self, shape: Shape, index: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = shape.heads, shape.hidden // shape.heads
        self.qkv_proj = nn.Linear(shape.hidden, 3 * shape.hidden, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.hidden, shape.hidden, bias=shape.qkv_bias)
        self.attention_norm = nn.LayerNorm(shape.hidden, eps=shape.eps)
        self.act = F.sigmoid if shape.act == "sigmoid" else ACT2FN[shape.act]
        self.experts = NomicExperts(shape, self.act) if shape.is_moe(index) else None
        if self.experts is None:
            width = 2 * shape.intermediate if shape.gated else shape.intermediate
            self.up_proj = nn.Linear(shape.hidden, width, bias=shape.up_bias)  # gated: [gate; up]
            self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=shape.down_bias)
        self.mlp_norm = nn.LayerNorm(shape.hidden, eps=shape.eps)
        self.gated, self.silu = shape.gated, shape.act == "silu"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                fused: FusedOps | None) -> torch.Tensor:
        """`fused`: native RoPE (cos and sin in x's dtype, of the whole head) and SiLU * up, else PyTorch's."""
        t, width = len(x), self.num_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if fused is not None and cos.shape[-1] == self.head_dim:  # q's heads and k's side by side: one pass
            fused.rope_(qkv[:, :2 * width].view(t, -1, self.head_dim), cos, sin)
            q, k, v = qkv.view(t, 3, self.num_heads, self.head_dim).unbind(1)
        else:
            q, k, v = qkv.view(t, 3, self.num_heads, self.head_dim).unbind(1)
            q, k = (apply_rotary(h, cos, sin) for h in (q, k))
        x = self.attention_norm(x + self.o_proj(bidirectional_attention(q, k, v, lengths)))
        if self.experts is not None:
            h = self.experts(x)
            return self.mlp_norm(x + h)
        if not self.gated:
            h = self.act(self.up_proj(x))
        elif fused is not None and self.silu:
            h = fused.silu_mul(self.up_proj(x))
        else:
            gate, up = self.up_proj(x).chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.mlp_norm(x + self.down_proj(h))


def expert_weights(shape: Shape, layer: int, tensor: CheckpointTensors) -> dict[str, Weight]:
    """A mixture layer's router, experts and bias by `NomicExperts`' names: nomic's stacked matrices
    (`[experts * intermediate, hidden]` each), or a GGUF file's experts one matrix each by `gguf_experts`' names
    (W2 as `[hidden, intermediate]`; no bias, which llama.cpp's converter drops and llama.cpp runs without)."""
    ours, nomic, block = f"layers.{layer}.experts.", f"encoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    experts = (shape.experts, shape.intermediate, shape.hidden)
    if tensor.find(f"{nomic}experts.mlp.w1") is not None:
        return {f"{ours}router.weight": tensor(f"{nomic}router.layer.weight"),
                f"{ours}w1": dequantized(tensor(f"{nomic}experts.mlp.w1")).view(experts),
                f"{ours}w2": dequantized(tensor(f"{nomic}experts.mlp.w2")).view(experts),
                f"{ours}bias": tensor(f"{nomic}experts.bias")}
    up, down = ([dequantized(tensor(f"{block}experts.{e}.{p}_proj.weight")) for e in range(shape.experts)]
                for p in ("up", "down"))
    return {f"{ours}router.weight": tensor(f"{block}gate.weight"), f"{ours}w1": torch.stack(up),
            f"{ours}w2": torch.stack([w.t() for w in down]),
            f"{ours}bias": torch.zeros(shape.hidden)}


class RopeBertModel(EncoderModel):
    """NomicBERT and GTE (the module docstring)."""

    model_types = ("nomic_bert", "gte", *RAW_CONFIG_TYPES)

    def __init__(self, config: PretrainedConfig) -> None:
        shape = model_shape(config)
        # (the shape under transformers' names, which the encoder and the engine's memory plan read)
        config.hidden_size, config.num_attention_heads = shape.hidden, shape.heads
        config.intermediate_size, config.num_hidden_layers = shape.intermediate, shape.layers
        super().__init__(config)
        self.shape = shape
        self.embed_tokens = nn.Embedding(config.vocab_size, shape.hidden)
        self.embed_types = nn.Embedding(shape.types, shape.hidden) if shape.types else None
        self.embed_norm = nn.LayerNorm(shape.hidden, eps=shape.eps)
        self.layers = nn.ModuleList(RopeBertLayer(shape, i) for i in range(shape.layers))
        self.rotary = RotaryEmbedding(shape.rope, self.head_dim, partial_rotary=True)

    @property
    def max_model_len(self) -> int:
        return self.shape.context

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        counts = torch.tensor(lengths, device=input_ids.device)
        x = self.embed_tokens(input_ids)
        if self.embed_types is not None:
            types = torch.zeros_like(input_ids)
            if self.embed_types.num_embeddings > 1 and self.sep_token_id is not None:
                types = pair_token_types(input_ids, counts, self.sep_token_id)
            x = x + self.embed_types(types)
        x = self.embed_norm(x)
        if self.rotary.by_length:  # each token rotated with its prompt's length (dynamic NTK)
            positions = with_lengths(positions, counts.repeat_interleave(counts))
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, lengths, self.fused_ops)
        return x

    @classmethod
    def weights(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> dict[str, Weight | list[Weight]]:
        """From either naming (the module docstring), of the bare model or a task model."""
        tensor, shape = CheckpointTensors(config, state_dict, PREFIXES), model_shape(config)
        weights: dict[str, Weight | list[Weight]] = {
            "embed_tokens.weight": tensor("embeddings.word_embeddings.weight"),
            "embed_norm.weight": tensor("emb_ln.weight", "embeddings.LayerNorm.weight"),
            "embed_norm.bias": tensor("emb_ln.bias", "embeddings.LayerNorm.bias")}
        if shape.types:
            weights["embed_types.weight"] = tensor("embeddings.token_type_embeddings.weight")

        def put(ours: str, bias: bool, *sources: str) -> None:
            for kind in ("weight", "bias") if bias else ("weight",):
                weights[f"{ours}.{kind}"] = tensor(*(f"{s}.{kind}" for s in sources))

        for i in range(shape.layers):
            # the original NomicBERT's names, the original GTE's, transformers' (and ours)
            nomic, gte, native = f"encoder.layers.{i}.", f"encoder.layer.{i}.", f"layers.{i}."
            for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
                fused = tensor.find(f"{nomic}attn.Wqkv.{kind}", f"{gte}attention.qkv_proj.{kind}")
                weights[f"{native}qkv_proj.{kind}"] = fused if fused is not None else fuse_rows(
                    [tensor(f"{native}self_attn.{p}_proj.{kind}") for p in "qkv"])
            put(f"{native}o_proj", shape.qkv_bias, f"{nomic}attn.out_proj", f"{gte}attention.o_proj",
                f"{native}self_attn.o_proj")
            put(f"{native}attention_norm", True, f"{nomic}norm1", f"{gte}attn_ln", f"{native}post_attention_layernorm")
            put(f"{native}mlp_norm", True, f"{nomic}norm2", f"{gte}mlp_ln", f"{native}post_mlp_layernorm")
            if shape.is_moe(i):
                weights.update(expert_weights(shape, i, tensor))
                continue
            put(f"{native}down_proj", shape.down_bias, f"{nomic}mlp.fc2", f"{gte}mlp.down_proj",
                f"{native}mlp.down_proj")
            for kind in ("weight", "bias") if shape.up_bias else ("weight",):
                if not shape.gated:
                    weights[f"{native}up_proj.{kind}"] = tensor(f"{nomic}mlp.fc1.{kind}")
                    continue
                up_gate = tensor.find(f"{gte}mlp.up_gate_proj.{kind}")  # (GTE's original: [up; gate])
                up, gate = (up_gate.chunk(2) if up_gate is not None else
                            (tensor(f"{nomic}mlp.fc11.{kind}", f"{native}mlp.up_proj.{kind}"),
                             tensor(f"{nomic}mlp.fc12.{kind}", f"{native}mlp.gate_proj.{kind}")))
                weights[f"{native}up_proj.{kind}"] = fuse_rows([gate, up])
        return weights

    @classmethod
    def classifier(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> nn.Module | None:
        """BERT's head over the first token: the pooler's `dense -> tanh`, then `classifier` (gte-multilingual's
        reranker); a token classifier's `classifier` alone over every token."""
        if "classifier.weight" not in state_dict:
            return None
        if any(a.endswith("ForTokenClassification") for a in getattr(config, "architectures", None) or []):
            return nn.Sequential(linear_from(state_dict, "classifier"))
        pooler = next((f"{p}pooler.dense" for p in ("", *PREFIXES) if f"{p}pooler.dense.weight" in state_dict), None)
        if pooler is None:
            return nn.Sequential(linear_from(state_dict, "classifier"))
        return nn.Sequential(linear_from(state_dict, pooler), nn.Tanh(), linear_from(state_dict, "classifier"))
