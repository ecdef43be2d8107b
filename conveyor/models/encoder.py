"""Encoder-only models as pooling models: what the encoder families (`models.bert`, `models.modernbert`,
`models.gemma_encoder`) share (docs/design/pooling.md, "Encoder models").

An encoder's attention is bidirectional: every token of a prompt attends to every other, so a prompt is
computed whole in one pass (`Request.whole_prompt`: never chunked, never started from cached blocks) and
nothing outlives the pass: each layer attends over the pass's own keys and values, prompt by prompt
(`bidirectional_attention`), and writes no KV cache. The engine still keeps a pool for the scheduler's
bookkeeping, of one nominal layer and one head: `num_layers`, `num_kv_heads` and `layer_types` below are
that cache's view, not the network's (a family's `layers` hold the network's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..kernels import cpu_fused_ops, native_kernels_enabled
from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import prepack_linears
from ..layers.quantization.linear import (
    QuantEmbedding,
    QuantLinear,
    Weight,
    bf16_kernel_max_rows,
    float_linear,
    tile_bf16_modules,
)
from ..layers.quantization.tensors import QuantizedTensor
from .base import assign_weights, no_init_weights


class EncoderModel(nn.Module):
    """An encoder over the flattened batch of whole prompts: its last hidden states, the pooler's input. The
    engine-facing attributes are `CausalLM`'s; a family fills `weights` (its checkpoint's tensors by the
    model's names), `classifier` (a sequence classifier's head) and `encode`."""

    model_types: tuple[str, ...] = ()
    encoder_only = True
    cuda_graphs = False
    rope_by_length = False
    rope_switch = None
    sliding_window = None  # (of the nominal cache: an encoder's windows are its own, `bidirectional_attention`)
    cache_windows: dict[str, int] = {}  # (the nominal cache: full attention only)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_layers, self.num_kv_heads, self.layer_types = 1, 1, ["full_attention"]  # the nominal cache
        self.dtype = torch.float32
        self.mirror = self.lora_state = self.decode_stack = None
        self.sep_token_id: int | None = None  # the tokenizer's [SEP] (`LLM` sets it): where a pair's second text starts
        self.fused_ops: FusedOps | None = None  # native elementwise ops (CPU), for the families that use them

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def prefix_key(self, rope_length: int) -> bytes:
        return b""

    @classmethod
    def weights(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> dict[str, Weight | list[Weight]]:
        """The encoder's tensors by this model's names (ValueError naming one the checkpoint lacks)."""
        raise NotImplementedError

    @classmethod
    def classifier(cls, config: PretrainedConfig, state_dict: dict[str, Weight]) -> nn.Module | None:
        """A sequence classifier's head over the pooled state, fp32; None where the checkpoint has none."""
        raise NotImplementedError

    @classmethod
    def default_pooling(cls, config: PretrainedConfig) -> str:
        """How the family pools without other word: the first token (vLLM's default for encoders)."""
        return "CLS"

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "EncoderModel":
        """The encoder with its weights loaded; linear weights quantized as `quantization` says. `lm_head` must
        be False: an encoder embeds or classifies, it never generates."""
        if lm_head:
            raise ConfigError(f"{config.model_type} is an encoder-only model: it embeds or classifies prompts "
                              "(runner='pooling', --runner pooling), it cannot generate text")
        with no_init_weights():
            model = cls(config)
        linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        assign_weights(model, cls.weights(config, state_dict), quantization, dtype, linears,
                       lambda name, parts: model.quantized_module(name, parts, dtype))
        model = model.to(device=device, dtype=dtype).eval()
        model.dtype = dtype
        prepack_linears(model)  # fp32
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and native_kernels_enabled():
            model.fused_ops = cpu_fused_ops()
        if bf16_kernel_max_rows() is None:  # bf16 without AMX: the native kernels' tiles; with AMX, an encoder's
            tile_bf16_modules(model)        # passes are oneDNN's sizes, and its matmul takes the plain weight
        return model

    def quantized_module(self, name: str, parts: list[QuantizedTensor], dtype: torch.dtype) -> nn.Module:
        """The module of weight `name` kept quantized (a GGUF file's blocks, or int8 / int4): an embedding read
        row by row, or a linear layer."""
        old = self.get_submodule(name.removesuffix(".weight"))
        if isinstance(old, nn.Embedding):
            return QuantEmbedding(parts[0], dtype, tiled=False)
        return QuantLinear(parts, bias=old.bias is not None, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metas: Sequence[AttentionMetadata], attention: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states, `[num_tokens, hidden]` (or `rows` of them); the pass's prompts are read from
        `metas[0]`, each whole from its first token. Nothing is read from or written to `kv_caches`."""
        hidden = self.encode(input_ids, positions, prompt_lengths(metas[0]))
        return hidden if rows is None else hidden.index_select(0, rows)

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last hidden states of the pass's prompts, of `lengths` tokens each, in order."""
        raise NotImplementedError


# Prompts up to this long attend in one padded call (each call costs more than a short prompt's arithmetic)
BATCHED_PROMPT_LEN = 64


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                            window: int | None = None, scale: float | None = None,
                            batched_up_to: int = BATCHED_PROMPT_LEN, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each prompt over itself, both ways: `q`, `k`, `v` `[tokens, heads, head_dim]` views (k and v
    may have fewer heads, each shared by a group of q's), the result `[tokens, heads * head_dim]`. `window`: a
    token attends to those at most that far away; `scale`: the scores' (None: `head_dim ** -0.5`); `bias`: added
    to the scores, `[heads, L, L]` by query and key position within the prompt, L at least the longest prompt
    (MPNet's relative positions). Prompts of up to `batched_up_to` tokens go in one call, padded to the longest
    of them (the padding masked out of the keys and dropped from the result); longer ones one call each."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grouped = k.shape[1] != q.shape[1]
    counts = torch.tensor(lengths, device=q.device)
    starts = counts.cumsum(0) - counts
    short = counts <= batched_up_to
    if bool(short.any()):
        n, first = counts[short], starts[short]
        offsets = torch.arange(int(n.max()), device=q.device)
        valid = offsets < n[:, None]  # [prompts, padded length]
        rows = first[:, None] + torch.minimum(offsets, n[:, None] - 1)  # (padding repeats a prompt's last row)
        mask = valid[:, None, None, :]
        if window is not None:
            mask = mask & ((offsets[:, None] - offsets[None, :]).abs() <= window)
        if bias is not None:
            mask = with_bias(mask, bias, len(offsets))
        heads = [t[rows].transpose(1, 2) for t in (q, k, v)]  # [prompts, heads, padded length, head_dim]
        o = F.scaled_dot_product_attention(*heads, attn_mask=mask, scale=scale, enable_gqa=grouped)
        out[rows[valid]] = o.transpose(1, 2)[valid]
    for start, n in zip(starts[~short].tolist(), counts[~short].tolist()):  # (host work O(long prompts))
        part = slice(start, start + n)
        mask = None
        if window is not None and n > window + 1:
            index = torch.arange(n, device=q.device)
            mask = (index[:, None] - index[None, :]).abs() <= window
        if bias is not None:
            mask = (bias[:, :n, :n] if mask is None else with_bias(mask, bias, n))[None]
        # [1, heads, tokens, head_dim]: torch's fused CPU attention takes 4-D inputs (3-D ones go the slow way)
        heads = [t[part].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out[part] = F.scaled_dot_product_attention(*heads, attn_mask=mask, scale=scale,
                                                   enable_gqa=grouped)[0].transpose(0, 1)
    return out.view(len(q), -1)


def with_bias(mask: torch.Tensor, bias: torch.Tensor, n: int) -> torch.Tensor:
    """The additive mask of `bias`'s first `n` positions where the boolean `mask` allows, -inf elsewhere."""
    return torch.where(mask, bias[:, :n, :n], torch.tensor(float("-inf"), dtype=bias.dtype))


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


def pair_token_types(input_ids: torch.Tensor, counts: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """BERT's token types of the pass's prompts (`counts` tokens each): 1 after a prompt's first separator (a
    pair's second text, `[CLS] a [SEP] b [SEP]`), else 0."""
    sep = (input_ids == sep_token_id).long()
    return (segment_cumsum(sep, counts) - sep > 0).long()


class CheckpointTensors:
    """A checkpoint's tensors by name, stored bare or under a task model's prefix (`bert.`, `model.`, ...)."""

    def __init__(self, config: PretrainedConfig, state_dict: dict[str, Weight], prefixes: Sequence[str]) -> None:
        self.model_type, self.state_dict, self.prefixes = config.model_type, state_dict, ("", *prefixes)

    def find(self, *names: str) -> Weight | None:
        """The first of `names` the checkpoint holds, bare or under a prefix; None where it holds none."""
        return next((self.state_dict[p + n] for n in names for p in self.prefixes if p + n in self.state_dict), None)

    def __call__(self, *names: str) -> Weight:
        """As `find`, with a ValueError naming the first of `names` where the checkpoint holds none."""
        found = self.find(*names)
        if found is None:
            raise ValueError(f"the {self.model_type} checkpoint has no tensor {names[0]!r}")
        return found


def linear_from(state_dict: dict[str, Weight], name: str) -> nn.Linear:
    """The fp32 `nn.Linear` of checkpoint tensors `{name}.weight` (and `{name}.bias` where there is one)."""
    return float_linear(state_dict[f"{name}.weight"], state_dict.get(f"{name}.bias"))
