"""BERT, RoBERTa, XLM-RoBERTa, DistilBERT, MPNet and Jina v2 encoders: the embedding and cross-encoder checkpoints
most retrieval deployments run (bge, e5, gte, all-MiniLM, all-mpnet, mxbai-embed, bge-m3, bge-reranker, the
ms-marco cross-encoders, the DistilBERT classifiers, jina-embeddings-v2), as pooling models (`models.encoder`;
docs/design/pooling.md, "Encoder models").

The embeddings are the checkpoint's: word, absolute position (RoBERTa's counted from `pad_token_id + 1`,
pad tokens kept at `pad_token_id`, as its embeddings count them) and token type. A prompt carries no token
types: a pair made by the tokenizer's template (`[CLS] a [SEP] b [SEP]`) is type 0 through its first
separator and type 1 after it, the types BERT's tokenizer gives a pair (RoBERTa's tokenizers give 0
everywhere, and so does its model here; DistilBERT has none). The layers are post-norm: attention, then the
MLP, each added to its input and LayerNorm'd. DistilBERT is BERT's layer under other names and config fields.
MPNet is RoBERTa's embeddings (no token types) and BERT's layers under its own names, with one more term in
every layer's attention scores: a learned bias per head by the key's bucketed position relative to the query.
Jina's BERT (`position_embedding_type` "alibi") has no position table: its scores take ALiBi's `-slope *
distance` a head, both ways, and its MLP is gated (GeGLU or ReGLU, `feed_forward_type`) under `mlp.gated_layers`
(the gated half first), `mlp.wo` and `mlp.layernorm`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from ..errors import ConfigError
from ..layers.quantization.linear import Weight, dequantized, fuse_rows
from .encoder import (CheckpointTensors, EncoderModel, bidirectional_attention, linear_from, pair_token_types,
                      segment_cumsum)

ROBERTA_TYPES = ("roberta", "xlm-roberta")
# The prefixes a task head's checkpoint puts before the encoder's tensors (BertForSequenceClassification's `bert.`)
ENCODER_PREFIXES = ("bert.", "roberta.", "distilbert.", "mpnet.")
# Each layer's tensors by our names: BERT's names, DistilBERT's (q/k/v, then the rest)
LAYER_NAMES = {"bert": ("encoder.layer.{}.", ("attention.self.query", "attention.self.key", "attention.self.value"),
                        (("o_proj", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
                         ("up_proj", "intermediate.dense"), ("down_proj", "output.dense"),
                         ("mlp_norm", "output.LayerNorm"))),
               "distilbert": ("transformer.layer.{}.", ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
                              (("o_proj", "attention.out_lin"), ("attention_norm", "sa_layer_norm"),
                               ("up_proj", "ffn.lin1"), ("down_proj", "ffn.lin2"),
                               ("mlp_norm", "output_layer_norm"))),
               "mpnet": ("encoder.layer.{}.", ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
                         (("o_proj", "attention.attn.o"), ("attention_norm", "attention.LayerNorm"),
                          ("up_proj", "intermediate.dense"), ("down_proj", "output.dense"),
                          ("mlp_norm", "output.LayerNorm"))),
               "jina": ("encoder.layer.{}.", ("attention.self.query", "attention.self.key", "attention.self.value"),
                        (("o_proj", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
                         ("down_proj", "mlp.wo"), ("mlp_norm", "mlp.layernorm")))}  # (+ `mlp.gated_layers`)
GLU_TYPES = {"geglu": "gelu", "reglu": "relu"}  # Jina v2's gated MLPs (`feed_forward_type`) and their activations
MPNET_PADDING_IDX = 1  # (fixed in MPNet's embeddings, whatever the config says)


def shape(config: PretrainedConfig) -> tuple[int, float, str, int]:
    """(intermediate size, LayerNorm eps, activation, token types) under BERT's or DistilBERT's field names."""
    if config.model_type == "distilbert":
        return config.hidden_dim, 1e-12, config.activation, 0
    return (config.intermediate_size, config.layer_norm_eps, config.hidden_act,
            0 if config.model_type == "mpnet" else config.type_vocab_size)


def is_jina(config: PretrainedConfig) -> bool:
    """Jina's BERT (jina-embeddings-v2): `bert` with ALiBi positions and a gated MLP."""
    return getattr(config, "position_embedding_type", None) == "alibi"


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slope a head: 2^(-8i/n) for n heads a power of two; otherwise the nearest lower power's slopes, then
    every other one of twice that power's."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    base = 2 ** int(math.floor(math.log2(heads)))
    return powers(base) + powers(2 * base)[0::2][:heads - base]


def relative_position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int = 128) -> torch.Tensor:
    """MPNet's (T5's bidirectional) bucket of each key's position relative to the query: half the buckets a
    direction, exact up to a quarter of them, then logarithmic up to `max_distance`."""
    half = num_buckets // 2
    n = -relative
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return bucket + torch.where(n < exact, n, large.clamp(max=half - 1))


class BertLayer(nn.Module):
    """BERT's post-norm layer."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, (intermediate, eps, act, _) = config.hidden_size, shape(config)
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.glu = is_jina(config)  # (a gated MLP, its input projections without biases)
        self.up_proj = nn.Linear(hidden, intermediate, bias=not self.glu)
        # (the gated half as a matmul of its own: two outputs of `intermediate` run faster than halves of one)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False) if self.glu else None
        self.down_proj = nn.Linear(intermediate, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACT2FN[GLU_TYPES[config.feed_forward_type] if self.glu else act]

    def forward(self, x: torch.Tensor, lengths: list[int], bias: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        x = self.attention_norm(x + self.o_proj(bidirectional_attention(q, k, v, lengths, bias=bias)))
        if self.gate_proj is not None:
            return self.mlp_norm(x + self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))
        return self.mlp_norm(x + self.down_proj(self.act(self.up_proj(x))))


class BertModel(EncoderModel):
    """BERT / RoBERTa / XLM-RoBERTa / DistilBERT / MPNet."""

    model_types = ("bert", *ROBERTA_TYPES, "distilbert", "mpnet")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute", "alibi"):
            raise ConfigError(f"{config.model_type} with position_embedding_type "
                              f"{config.position_embedding_type!r} is not supported (supported: absolute, alibi)")
        if is_jina(config) and getattr(config, "feed_forward_type", None) not in GLU_TYPES:
            raise ConfigError(f"a Jina BERT with feed_forward_type {getattr(config, 'feed_forward_type', None)!r} is "
                              f"not supported (supported: {', '.join(GLU_TYPES)})")
        hidden, (_, eps, _, types) = config.hidden_size, shape(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        # ALiBi (Jina v2): no position table, a score bias of -slope * distance a head instead
        self.embed_positions = None if is_jina(config) else nn.Embedding(config.max_position_embeddings, hidden)
        self.alibi_slopes = alibi_slopes(config.num_attention_heads) if is_jina(config) else None
        self.embed_types = nn.Embedding(types, hidden) if types else None
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        roberta = config.model_type in ROBERTA_TYPES
        self.position_offset = config.pad_token_id if roberta else None  # RoBERTa: positions from pad_token_id + 1
        self.relative_bias = None  # MPNet's: a score bias per head by bucketed relative position, shared by layers
        if config.model_type == "mpnet":
            self.position_offset = MPNET_PADDING_IDX
            self.relative_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)

    @classmethod
    def default_pooling(cls, config: PretrainedConfig) -> str:
        """The first token, or the mean where the config says so (Jina v2's `emb_pooler`)."""
        return "MEAN" if getattr(config, "emb_pooler", None) == "mean" else "CLS"

    @property
    def max_model_len(self) -> int:
        """The positions the table holds (RoBERTa's first `pad_token_id + 1` are never a token's)."""
        offset = 0 if self.position_offset is None else self.position_offset + 1
        return self.config.max_position_embeddings - offset

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        counts = torch.tensor(lengths, device=input_ids.device)
        if self.position_offset is not None:
            real = (input_ids != self.position_offset).long()
            positions = segment_cumsum(real, counts) * real + self.position_offset
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_types is not None:
            types = torch.zeros_like(input_ids)
            if self.position_offset is None and self.embed_types.num_embeddings > 1 and self.sep_token_id is not None:
                types = pair_token_types(input_ids, counts, self.sep_token_id)
            x = x + self.embed_types(types)
        x = self.embed_norm(x)
        bias = None  # [heads, L, L] over the longest prompt; a shorter one takes its corner
        index = torch.arange(max(lengths), device=input_ids.device)
        if self.relative_bias is not None:
            buckets = relative_position_bucket(index[None, :] - index[:, None], self.relative_bias.num_embeddings)
            bias = self.relative_bias(buckets).permute(2, 0, 1)
        elif self.alibi_slopes is not None:  # (in fp32, rounded once)
            slopes = torch.tensor(self.alibi_slopes, device=input_ids.device)
            bias = (-slopes[:, None, None] * (index[None, :] - index[:, None]).abs()).to(x.dtype)
        for layer in self.layers:
            x = layer(x, lengths, bias)
        return x

    @classmethod
    def weights(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> dict[str, Weight | list[Weight]]:
        """From a checkpoint of the bare model or of a task model (`bert.`, `roberta.` before the names)."""
        tensors = CheckpointTensors(config, state_dict, ENCODER_PREFIXES)

        def tensor(name: str) -> Weight:  # (or as checkpoints converted from TensorFlow name LayerNorm's tensors)
            return tensors(name, name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                                              "LayerNorm.beta"))

        weights: dict[str, Weight | list[Weight]] = {
            "embed_tokens.weight": tensor("embeddings.word_embeddings.weight"),
            "embed_norm.weight": tensor("embeddings.LayerNorm.weight"),
            "embed_norm.bias": tensor("embeddings.LayerNorm.bias")}
        if not is_jina(config):
            weights["embed_positions.weight"] = tensor("embeddings.position_embeddings.weight")
        if shape(config)[3]:
            weights["embed_types.weight"] = tensor("embeddings.token_type_embeddings.weight")
        if config.model_type == "mpnet":
            weights["relative_bias.weight"] = tensor("encoder.relative_attention_bias.weight")
        layer, qkv, rest = LAYER_NAMES["jina" if is_jina(config) else config.model_type if config.model_type in
                                       LAYER_NAMES else "bert"]
        for i in range(config.num_hidden_layers):
            src, dst = layer.format(i), f"layers.{i}."
            for kind in ("weight", "bias"):
                weights[f"{dst}qkv_proj.{kind}"] = fuse_rows([tensor(f"{src}{n}.{kind}") for n in qkv])
                for ours, theirs in rest:
                    weights[f"{dst}{ours}.{kind}"] = tensor(f"{src}{theirs}.{kind}")
            if is_jina(config):  # [gated; plain] rows, no bias
                weights[f"{dst}gate_proj.weight"], weights[f"{dst}up_proj.weight"] = dequantized(
                    tensor(f"{src}mlp.gated_layers.weight")).chunk(2)
        return weights

    @classmethod
    def classifier(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> nn.Module | None:
        """`dense -> tanh -> out` over the first token: BERT's pooler and `classifier`, or RoBERTa's
        `classifier.dense` and `classifier.out_proj`; DistilBERT's `pre_classifier -> relu -> classifier`. A token
        classifier's (NER taggers: `*ForTokenClassification`) is its `classifier` alone, over every token."""
        if any(a.endswith("ForTokenClassification") for a in getattr(config, "architectures", None) or []):
            return nn.Sequential(linear_from(state_dict, "classifier")) if "classifier.weight" in state_dict else None
        if "pre_classifier.weight" in state_dict:
            return nn.Sequential(linear_from(state_dict, "pre_classifier"), nn.ReLU(),
                                 linear_from(state_dict, "classifier"))
        if "classifier.out_proj.weight" in state_dict:
            first, last = "classifier.dense", "classifier.out_proj"
            if f"{first}.weight" not in state_dict:  # a BERT cross-encoder's GGUF (its converter drops the pooler):
                return nn.Sequential(linear_from(state_dict, last))  # the classifier alone, as llama.cpp runs it
        elif "classifier.weight" in state_dict:
            first = "bert.pooler.dense" if "bert.pooler.dense.weight" in state_dict else "pooler.dense"
            last = "classifier"
        else:
            return None
        return nn.Sequential(linear_from(state_dict, first), nn.Tanh(), linear_from(state_dict, last))
