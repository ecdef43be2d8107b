"""Encoder-only models: BERT, RoBERTa and XLM-RoBERTa, the embedding and cross-encoder checkpoints most
retrieval deployments run (bge, e5, gte, all-MiniLM, mxbai-embed, bge-m3, bge-reranker, the ms-marco
cross-encoders), as pooling models (docs/design/pooling.md, "Encoder models").

An encoder's attention is bidirectional: every token of a prompt attends to every other, so a prompt is
computed whole in one pass (`Request.whole_prompt`: never chunked, never started from cached blocks) and
nothing outlives the pass: each layer attends over the pass's own keys and values, prompt by prompt, and
writes no KV cache. The engine still keeps a pool for the scheduler's bookkeeping, of one nominal layer
and one head: `num_layers`, `num_kv_heads` and `layer_types` below are that cache's view, not the
network's (`layers` holds the network's).

The embeddings are the checkpoint's: word, absolute position (RoBERTa's counted from `pad_token_id + 1`,
pad tokens kept at `pad_token_id`, as its embeddings count them) and token type. A prompt carries no token
types: a pair made by the tokenizer's template (`[CLS] a [SEP] b [SEP]`) is type 0 through its first
separator and type 1 after it, the types BERT's tokenizer gives a pair (RoBERTa's tokenizers give 0
everywhere, and so does its model here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from ..errors import ConfigError
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import prepack_linears
from ..layers.quantization.linear import (
    QuantLinear,
    bf16_kernel_max_rows,
    Weight,
    dequantized,
    fuse_rows,
    plan_weights,
    tile_bf16_modules,
)
from .base import no_init_weights

ROBERTA_TYPES = ("roberta", "xlm-roberta")
# The prefixes a task head's checkpoint puts before the encoder's tensors (BertForSequenceClassification's `bert.`)
ENCODER_PREFIXES = ("bert.", "roberta.")


class EncoderLayer(nn.Module):
    """BERT's post-norm layer: self-attention over the prompt, then the MLP, each added to its input and
    LayerNorm'd."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        # [1, heads, tokens, head_dim] views: torch's fused CPU attention takes 4-D inputs (3-D ones go the slow way)
        q, k, v = self.qkv_proj(x).view(1, len(x), 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = torch.empty(len(x), self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for n in lengths:  # (each prompt attends to itself alone; host work O(prompts in the pass))
            part = slice(start, start + n)
            out[part] = F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part])[0].transpose(0, 1)
            start += n
        x = self.attention_norm(x + self.o_proj(out.view(len(x), -1)))
        return self.mlp_norm(x + self.down_proj(self.act(self.up_proj(x))))


class EncoderModel(nn.Module):
    """BERT / RoBERTa / XLM-RoBERTa over the flattened batch of whole prompts: hidden states of the last
    layer, the pooler's input (the engine-facing attributes are `CausalLM`'s)."""

    model_types = ("bert", *ROBERTA_TYPES)
    encoder_only = True
    cuda_graphs = False
    rope_by_length = False
    rope_switch = None
    sliding_window = None

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ConfigError(f"{config.model_type} with position_embedding_type "
                              f"{config.position_embedding_type!r} is not supported (supported: absolute)")
        self.config = config
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.num_layers, self.num_kv_heads, self.layer_types = 1, 1, ["full_attention"]  # the nominal cache
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, hidden)
        self.embed_types = nn.Embedding(config.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        roberta = config.model_type in ROBERTA_TYPES
        self.position_offset = config.pad_token_id if roberta else None  # RoBERTa: positions from pad_token_id + 1
        self.sep_token_id: int | None = None  # where a pair's second text starts: the tokenizer's [SEP] (`LLM` sets it)
        self.dtype = torch.float32
        self.mirror = self.lora_state = self.decode_stack = None

    @property
    def max_model_len(self) -> int:
        """The positions the table holds (RoBERTa's first `pad_token_id + 1` are never a token's)."""
        offset = 0 if self.position_offset is None else self.position_offset + 1
        return self.config.max_position_embeddings - offset

    def prefix_key(self, rope_length: int) -> bytes:
        return b""

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "EncoderModel":
        """The encoder with Hugging Face-named weights loaded (q/k/v fused); linear weights quantized as
        `quantization` says. `lm_head` must be False: an encoder embeds or classifies, it never generates."""
        if lm_head:
            raise ConfigError(f"{config.model_type} is an encoder-only model: it embeds or classifies prompts "
                              "(runner='pooling', --runner pooling), it cannot generate text")
        with no_init_weights():
            model = cls(config)
        weights = encoder_weights(config, state_dict)
        linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        planned = plan_weights(weights, quantization, dtype, linears)
        for name, parts in list(planned.items()):
            if isinstance(parts, list):
                old = model.get_submodule(name.removesuffix(".weight"))
                model.set_submodule(name.removesuffix(".weight"), QuantLinear(parts, bias=old.bias is not None,
                                                                              dtype=dtype))
                del planned[name]
        try:
            model.load_state_dict(planned, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"the {config.model_type} checkpoint does not fit {cls.__name__}: {exc}") from None
        model = model.to(device=device, dtype=dtype).eval()
        model.dtype = dtype
        prepack_linears(model)  # fp32
        if bf16_kernel_max_rows() is None:  # bf16 without AMX: the native kernels' tiles; with AMX, an encoder's
            tile_bf16_modules(model)        # passes are oneDNN's sizes, and its matmul takes the plain weight
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metas: Sequence[AttentionMetadata], attention: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's hidden states, `[num_tokens, hidden]` (or `rows` of them); the pass's prompts
        are read from `metas[0]`: each whole, from its first token. Nothing is read from or written to
        `kv_caches`."""
        lengths = prompt_lengths(metas[0])
        x = self.embed(input_ids, positions, lengths)
        for layer in self.layers:
            x = layer(x, lengths)
        return x if rows is None else x.index_select(0, rows)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        counts = torch.tensor(lengths, device=input_ids.device)
        if self.position_offset is not None:
            real = (input_ids != self.position_offset).long()
            positions = segment_cumsum(real, counts) * real + self.position_offset
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        types = torch.zeros_like(input_ids)
        if self.position_offset is None and self.config.type_vocab_size > 1 and self.sep_token_id is not None:
            sep = (input_ids == self.sep_token_id).long()
            types = (segment_cumsum(sep, counts) - sep > 0).long()  # after the first separator: the second text
        return self.embed_norm(x + self.embed_types(types))


def prompt_lengths(meta: AttentionMetadata) -> list[int]:
    """The lengths of the pass's prompts (a one-token prompt is a decode row), each checked to be whole."""
    partial = [p.start for p in meta.prefills if p.start != 0]
    if partial:
        raise RuntimeError(f"an encoder computes whole prompts: a chunk starting at token {partial[0]} was scheduled")
    return [1] * meta.num_decodes + [p.q_len for p in meta.prefills]


def segment_cumsum(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The running sum of `values` within each of the consecutive segments of `counts` rows."""
    total = values.cumsum(0)
    starts = counts.cumsum(0) - counts
    return total - (total[starts] - values[starts]).repeat_interleave(counts)


def encoder_weights(config: PretrainedConfig, state_dict: dict[str, Weight]) -> dict[str, Weight | list[Weight]]:
    """The encoder's tensors by `EncoderModel`'s names (q/k/v fused), from a checkpoint of the bare model
    or of a task model (`bert.`, `roberta.` before them; its head is the pooler's, `encoder_classifier`)."""
    def tensor(name: str) -> Weight:
        for stored in (name, *(p + name for p in ENCODER_PREFIXES)):
            if stored in state_dict:
                return state_dict[stored]
            old = stored.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
            if old in state_dict:  # (checkpoints converted from TensorFlow)
                return state_dict[old]
        raise ValueError(f"the {config.model_type} checkpoint has no tensor {name!r}")

    weights: dict[str, Weight | list[Weight]] = {"embed_tokens.weight": tensor("embeddings.word_embeddings.weight"),
                                  "embed_positions.weight": tensor("embeddings.position_embeddings.weight"),
                                  "embed_types.weight": tensor("embeddings.token_type_embeddings.weight"),
                                  "embed_norm.weight": tensor("embeddings.LayerNorm.weight"),
                                  "embed_norm.bias": tensor("embeddings.LayerNorm.bias")}
    for i in range(config.num_hidden_layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [tensor(f"{src}attention.self.{n}.{kind}") for n in ("query", "key", "value")]
            weights[f"{dst}qkv_proj.{kind}"] = fuse_rows(parts)
            for ours, theirs in (("o_proj", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
                                 ("up_proj", "intermediate.dense"), ("down_proj", "output.dense"),
                                 ("mlp_norm", "output.LayerNorm")):
                weights[f"{dst}{ours}.{kind}"] = tensor(f"{src}{theirs}.{kind}")
    return weights


def encoder_classifier(config: PretrainedConfig, state_dict: dict[str, Weight]) -> nn.Sequential | None:
    """A sequence classifier's head over the first token's state, fp32 (None where the checkpoint has none):
    BERT's pooler (dense, tanh) and `classifier`, or RoBERTa's `classifier.dense`, tanh, `classifier.out_proj`."""
    if "classifier.out_proj.weight" in state_dict:
        names = ("classifier.dense", "classifier.out_proj")
    elif "classifier.weight" in state_dict:
        names = ("bert.pooler.dense" if "bert.pooler.dense.weight" in state_dict else "pooler.dense", "classifier")
    else:
        return None
    layers = []
    for name in names:
        weight, bias = (dequantized(state_dict[f"{name}.{kind}"]).float() for kind in ("weight", "bias"))
        layer = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        layers.append(layer)
    return nn.Sequential(layers[0], nn.Tanh(), layers[1])
