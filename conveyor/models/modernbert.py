"""ModernBERT encoders (gte-modernbert, modernbert-embed, gte-reranker-modernbert and the other
`ModernBertModel` / `ModernBertForSequenceClassification` checkpoints) as pooling models (`models.encoder`).

Pre-norm layers (the first without its attention norm) with RoPE instead of position embeddings, its
base per layer type; two in three layers attend within a window (`sliding_window` tokens either way,
transformers' bidirectional window), the third over the whole prompt; a gated MLP whose fused input
projection holds the activated half first, then the gate; a final norm. A classifier pools as its config's
`classifier_pooling` says (the first token or the mean) and runs `dense -> activation -> norm -> classifier`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from ..layers.quantization.linear import Weight
from ..layers.rotary import RotaryEmbedding, apply_rotary
from .encoder import CheckpointTensors, EncoderModel, bidirectional_attention, linear_from

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.attn_norm = layer_norm(config) if index > 0 else nn.Identity()
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = layer_norm(config)
        self.up_gate_proj = nn.Linear(hidden, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.window = config.sliding_window if config.layer_types[index] == "sliding_attention" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = (apply_rotary(t.float(), cos, sin).to(x.dtype) for t in (q, k))  # (in fp32, as transformers rotates)
        x = x + self.o_proj(bidirectional_attention(q, k, v, lengths, self.window))
        up, gate = self.up_gate_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(self.act(up) * gate)


class ModernBertModel(EncoderModel):
    model_types = ("modernbert",)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        unknown = set(config.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"ModernBERT layer types {sorted(unknown)} are not supported (supported: {LAYER_TYPES})")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = layer_norm(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = layer_norm(config)
        self.rotaries = nn.ModuleDict({t: RotaryEmbedding(config, self.head_dim, t) for t in set(config.layer_types)})

    @classmethod
    def default_pooling(cls, config: PretrainedConfig) -> str:
        """A classifier's `classifier_pooling` (its head was trained on that); else the first token."""
        return "MEAN" if getattr(config, "classifier_pooling", "cls") == "mean" else "CLS"

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.embed_norm(self.embed_tokens(input_ids))
        rotary = {t: r(positions, torch.float32) for t, r in self.rotaries.items()}
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            x = layer(x, *rotary[layer_type], lengths)
        return self.final_norm(x)

    @classmethod
    def weights(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> dict[str, Weight | list[Weight]]:
        """From a checkpoint of the bare model or of a task model (`model.` before the names)."""
        tensor = CheckpointTensors(config, state_dict, ("model.",))

        def module(ours: str, theirs: str, bias: bool) -> None:
            weights[f"{ours}.weight"] = tensor(f"{theirs}.weight")
            if bias:
                weights[f"{ours}.bias"] = tensor(f"{theirs}.bias")

        weights: dict[str, Weight | list[Weight]] = {}
        module("embed_tokens", "embeddings.tok_embeddings", False)
        module("embed_norm", "embeddings.norm", config.norm_bias)
        module("final_norm", "final_norm", config.norm_bias)
        for i in range(config.num_hidden_layers):
            src, dst = f"layers.{i}.", f"layers.{i}."
            if i > 0:
                module(f"{dst}attn_norm", f"{src}attn_norm", config.norm_bias)
            module(f"{dst}qkv_proj", f"{src}attn.Wqkv", config.attention_bias)
            module(f"{dst}o_proj", f"{src}attn.Wo", config.attention_bias)
            module(f"{dst}mlp_norm", f"{src}mlp_norm", config.norm_bias)
            module(f"{dst}up_gate_proj", f"{src}mlp.Wi", config.mlp_bias)
            module(f"{dst}down_proj", f"{src}mlp.Wo", config.mlp_bias)
        return weights

    @classmethod
    def classifier(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> nn.Module | None:
        """`head.dense -> activation -> head.norm -> classifier` over the pooled state."""
        if "classifier.weight" not in state_dict:
            return None
        norm = layer_norm(config)
        with torch.no_grad():
            norm.weight.copy_(state_dict["head.norm.weight"].float())
            if config.norm_bias:
                norm.bias.copy_(state_dict["head.norm.bias"].float())
        return nn.Sequential(linear_from(state_dict, "head.dense"), ACT2FN[config.classifier_activation], norm.float(),
                             linear_from(state_dict, "classifier"))
