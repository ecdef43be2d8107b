"""`CausalLM`: what every model family shares: a decoder-only model over the flattened ragged batch,
its checkpoint loading (Hugging Face names, q/k/v and gate/up fused, weights quantized or kept as
stored), the LM head, and the hooks a family fills (fused native ops, the native decode stack).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH

from ..kernels import cpu_fused_ops, native_kernels_enabled
from ..kernels.fused_ops import FusedOps
from ..layers.attention import AttentionBackend, AttentionMetadata
from ..layers.linear import packed_lm_head, prepack_linears
from ..layers.lora import LoRAState
from ..layers.quantization.linear import (
    QuantEmbedding,
    QuantLinear,
    QuantMatmul,
    Weight,
    fuse_rows,
    plan_weights,
    tile_bf16_modules,
)
from ..layers.quantization.tensors import QuantizedTensor
from ..layers.rotary import RotaryEmbedding
from .decode_stack import DecodeStack


def attention_layer_types(config: PretrainedConfig) -> list[str]:
    """`full_attention` or `sliding_attention` per layer, from the model's own config: its `layer_types`,
    else every layer sliding when it sets a `sliding_window` (Mistral). A window at least as long as
    the context is full attention (same result, and full-attention blocks can be shared)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or window >= config.max_position_embeddings:
        return ["full_attention"] * n
    types = list(getattr(config, "layer_types", None) or ["sliding_attention"] * n)
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported (supported: full_attention, "
                         "sliding_attention)")
    return types


# Hugging Face names of per-layer tensors copied as they are (those a checkpoint has). Phi-3 stores q/k/v
# and gate/up fused, as the layers hold them.
_LAYER_TENSORS = (("qkv_proj", "self_attn.qkv_proj"), ("gate_up_proj", "mlp.gate_up_proj"),
                  ("o_proj", "self_attn.o_proj"), ("down_proj", "mlp.down_proj"),
                  ("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"),
                  ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
                  ("post_feedforward_layernorm", "post_feedforward_layernorm"),
                  ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm"))


def check_activation(config: PretrainedConfig, supported: str) -> None:
    """The config's `hidden_act` is the one activation the family's layers compute (`supported`, also when the
    config sets none); ValueError naming both otherwise."""
    activation = getattr(config, "hidden_act", supported)
    if activation != supported:
        raise ValueError(f"hidden_act {activation!r} is not supported for {config.model_type} (supported: {supported})")


def _tensor(state_dict: dict[str, Weight], name: str) -> Weight:
    if name not in state_dict:
        raise ValueError(f"the checkpoint has no tensor {name!r}")
    return state_dict[name]


class Mirror(Protocol):
    """The other ranks of a tensor-parallel model (rank 0's `distributed.driver.RankDriver`): told of
    every forward and LM-head call before rank 0 makes it, so that they make it too; the context
    lasts the call (its collectives included)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metas: Sequence[AttentionMetadata]) -> AbstractContextManager[None]: ...

    def logits(self, hidden: torch.Tensor) -> AbstractContextManager[None]: ...


def assign_weights(model: nn.Module, weights: dict[str, Weight | list[Weight]], quantization: str, dtype: torch.dtype,
                   quantizable: set[str], quantized_module: Callable[[str, list[QuantizedTensor]], nn.Module]) -> None:
    """`weights` (by the model's names) become `model`'s parameters, quantized or kept quantized as `quantization`
    says (`plan_weights`: `quantizable` names the matrices it may quantize), each quantized one in the module
    `quantized_module(name, parts)` makes for it; ValueError naming the tensors that do not fit."""
    planned = plan_weights(weights, quantization, dtype, quantizable)
    for name, parts in list(planned.items()):
        if isinstance(parts, list):
            model.set_submodule(name.removesuffix(".weight"), quantized_module(name, parts))
            del planned[name]
    try:  # the loaded tensors become the parameters (no copy: a bf16 checkpoint was copied into fp32 ones)
        model.load_state_dict(planned, strict=True, assign=True)
    except RuntimeError as exc:  # names the missing or unexpected tensors (by the model's names)
        raise ValueError(f"the {model.config.model_type} checkpoint does not fit {type(model).__name__}: "
                         f"{exc}") from None


@cache
def selects_rows(layer_type: type[nn.Module]) -> bool:
    """Whether a decoder layer's forward takes `rows`: then the last layer computes its attention's output
    projection and its MLP for those rows only (every row's K/V is still written), not for every prompt
    token of the step: a prefill reads one row of a chunk (its sample, or a pooled last token). A subclass
    whose own `attention` does not take `rows` does not either."""
    methods = [layer_type.forward] + ([layer_type.attention] if hasattr(layer_type, "attention") else [])
    return all("rows" in inspect.signature(method).parameters for method in methods)


@contextmanager
def no_init_weights() -> Iterator[None]:
    """torch's init functions made no-ops while a model is built (every parameter is loaded after): the
    torch half of transformers' `no_init_weights`, over its own tables. Its other half patches
    `PreTrainedModel`, a class our models never use, whose import (torch._dynamo, triton) added to every
    load's time and to every process' resident memory (docs/benchmarks.md, "Memory, the 8B")."""
    saved = [(module, name, getattr(module, name)) for module in map(sys.modules.get, TORCH_MODULES_TO_PATCH)
             if module is not None for name in TORCH_INIT_FUNCTIONS if hasattr(module, name)]
    try:
        for module, name, _ in saved:
            setattr(module, name, lambda *args, **kwargs: None)
        yield
    finally:
        for module, name, function in saved:
            setattr(module, name, function)


class CausalLM(nn.Module):
    """A decoder-only model over the flattened ragged batch; subclasses build the layers.

    `layer_types` (full or sliding attention per layer) decides the cache layout; nothing in the
    model itself depends on it: the attention metadata of each layer carries its window."""

    model_types: tuple[str, ...] = ()
    final_softcap: float | None = None
    logits_divisor: float | None = None  # Granite's `logits_scaling`: the logits divided by it
    cuda_graphs = True  # a forward pass can be captured in a CUDA graph (no host reads of device values)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.layer_types = attention_layer_types(config)
        self.sliding_window = config.sliding_window if "sliding_attention" in self.layer_types else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.dtype = torch.float32  # the compute dtype, set when the weights are loaded
        self.decode_stack: DecodeStack | None = None  # the native layer stack for small decode batches
        self.mirror: Mirror | None = None  # tensor parallel, rank 0: the ranks that make every call too
        self.lora_state: LoRAState | None = None  # multi-LoRA: the step's adapter rows (`models.lora`)

    @property
    def cache_windows(self) -> dict[str, int]:
        """The ring (in pool slots) a request holds per layer for each layer type but full attention: the
        sliding window; a family's own state layers add theirs (LFM2's conv layers)."""
        return {} if self.sliding_window is None else {"sliding_attention": self.sliding_window}

    @property
    def max_model_len(self) -> int:
        """`max_position_embeddings`, times the factor of a dynamic NTK RoPE, which exists to run past it
        (vLLM's rule)."""
        factors = [m.factor for m in self.modules() if isinstance(m, RotaryEmbedding) and m.rope_type == "dynamic"]
        return int(self.config.max_position_embeddings * max(factors, default=1.0))

    @classmethod
    def build(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> "CausalLM":
        """The model for this checkpoint's variant (biases, q/k norms), weights not loaded yet."""
        raise NotImplementedError

    @classmethod
    def from_state_dict(cls, config: PretrainedConfig, state_dict: dict[str, Weight], dtype: torch.dtype,
                        device: torch.device, quantization: str = "none", lm_head: bool = True) -> "CausalLM":
        """Build the model and load Hugging Face-named weights, fusing q/k/v and gate/up; linear and
        embedding weights quantized or kept quantized as `quantization` says (`quant_linear.plan_weights`).
        `lm_head=False`: a pooling model, which never computes logits: no head is prepared."""
        if config.model_type not in cls.model_types:
            raise ValueError(f"model type {config.model_type!r} is not supported by {cls.__name__} "
                             f"(supported: {', '.join(cls.model_types)})")
        with no_init_weights():  # every parameter is loaded below: random init was 1.6 s of a 5 s load
            model = cls.build(config, state_dict)
        if "lm_head.weight" not in state_dict:
            model.tied, model.lm_head = True, None
        fused: dict[str, Weight | list[Weight]] = {
            "embed_tokens.weight": _tensor(state_dict, "model.embed_tokens.weight"),
            "norm.weight": _tensor(state_dict, "model.norm.weight")}
        if model.lm_head is not None:
            fused["lm_head.weight"] = state_dict["lm_head.weight"]
        if "model.norm.bias" in state_dict:  # (a final LayerNorm's: StarCoder2)
            fused["norm.bias"] = state_dict["model.norm.bias"]
        for i in range(config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                if f"{src}self_attn.q_proj.{kind}" in state_dict:
                    fused[f"{dst}qkv_proj.{kind}"] = fuse_rows(
                        [_tensor(state_dict, f"{src}self_attn.{n}_proj.{kind}") for n in "qkv"])
                if f"{src}mlp.gate_proj.{kind}" in state_dict:
                    fused[f"{dst}gate_up_proj.{kind}"] = fuse_rows(
                        [_tensor(state_dict, f"{src}mlp.{n}_proj.{kind}") for n in ("gate", "up")])
                for name, hf in _LAYER_TENSORS:
                    if f"{src}{hf}.{kind}" in state_dict:
                        fused[f"{dst}{name}.{kind}"] = state_dict[f"{src}{hf}.{kind}"]
            fused.update(model.layer_weights(state_dict, i))
        matrices = {f"{name}.weight" for name, module in model.named_modules()
                    if isinstance(module, (nn.Linear, nn.Embedding))}
        assign_weights(model, fused, quantization, dtype, matrices,
                       lambda name, parts: model.quantized_module(name, parts, dtype))
        del fused  # the fused copies then live only as long as the parameters made of them
        model = model.to(device=device, dtype=dtype).eval()
        model.dtype = dtype
        model.load_fp32_parameters(state_dict)
        prepack_linears(model)  # fp32 on CPU: faster matmuls at decode batch sizes (see linear.py)
        tile_bf16_modules(model)  # bf16 on CPU: the native GEMM's tiles (see quantization/linear.py)
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and native_kernels_enabled():
            model.use_fused_ops(cpu_fused_ops())
        model.lm_head_fn = model.head_fn() if lm_head else None
        model.decode_stack = model.build_decode_stack() if device.type == "cpu" else None
        return model

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        """Layer `layer`'s tensors beyond the shared ones (attention, dense MLP, norms), by this model's
        names: a family's own (experts, routers). ValueError naming a missing one."""
        return {}

    def load_fp32_parameters(self, state_dict: dict[str, Weight]) -> None:
        """A family's tensors kept in fp32 whatever the model's dtype (Mamba-2's A, D and dt_bias), set after
        the conversion to it and before anything (the decode stack) copies them."""

    def quantized_module(self, name: str, parts: list[QuantizedTensor], dtype: torch.dtype) -> nn.Module:
        """The quantized stand-in for the embedding or linear layer that holds weight `name`."""
        old = self.get_submodule(name.removesuffix(".weight"))
        if isinstance(old, nn.Embedding):
            if len(parts) != 1:
                raise ValueError(f"{name}: an embedding table must be one quantized tensor")
            return QuantEmbedding(parts[0], dtype, tiled=self.tied)  # tiles only where the head reads them
        return QuantLinear(parts, bias=old.bias is not None, dtype=dtype)

    def head_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden -> logits: the LM head (the embedding's weight when tied), quantized, packed or plain."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, QuantEmbedding):
            return QuantMatmul([head.weight], out_dtype=torch.float32)
        if isinstance(head, QuantLinear):
            return QuantMatmul(head.kernel.segments, out_dtype=torch.float32)
        return self.lm_head if self.lm_head is not None else packed_lm_head(self.embed_tokens.weight)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run norms, RoPE and activations through native fused ops where the family has them (None: PyTorch)."""

    def build_decode_stack(self) -> DecodeStack | None:
        """The native stack of all layers for small decode batches, where the family has one."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope_per_layer_type(self, config: PretrainedConfig, partial_rotary: bool = False) -> None:
        """RoPE settings per layer type (Gemma 3, OLMo 3: sliding layers with their own base or no scaling),
        where the config's `rope_parameters` has one set per type; else one `rotary` for every layer. (By the
        config's `layer_types`: they may call a window longer than the context full attention.)"""
        per_type = "full_attention" in (getattr(config, "rope_parameters", None) or {})
        self.rope_layer_types = list(config.layer_types) if per_type else []
        self.rotaries = nn.ModuleDict({t: RotaryEmbedding(config, self.head_dim, t)
                                       for t in set(self.rope_layer_types)})
        self.rotary = None if per_type else RotaryEmbedding(config, self.head_dim, partial_rotary=partial_rotary)

    def rotary_for_layer(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin `[num_tokens, head_dim]` for every layer: shared by all, or by layer type
        (`rope_per_layer_type`)."""
        if getattr(self, "rotary", None) is None and getattr(self, "rotaries", None):
            by_type = {t: rotary(positions, dtype) for t, rotary in self.rotaries.items()}
            return [by_type[t] for t in self.rope_layer_types]
        return [self.rotary(positions, dtype)] * self.num_layers

    @property
    def rope_by_length(self) -> bool:
        """Whether some layer's RoPE depends on the sequence length (LongRoPE, dynamic NTK): then each
        token's position carries its request's length (`layers.rotary.with_lengths`)."""
        return any(m.by_length for m in self.modules() if isinstance(m, RotaryEmbedding))

    def prefix_key(self, rope_length: int) -> bytes:
        """What besides its tokens decides a prompt's K/V (b"" where nothing does), by the request's
        `rope_length`: prefix caching shares blocks only between requests with equal keys
        (`layers.rotary.RotaryEmbedding.prefix_key`)."""
        keys = [m.prefix_key(rope_length) for m in self.modules() if isinstance(m, RotaryEmbedding)]
        return ",".join(map(str, keys)).encode() if any(keys) else b""

    @property
    def rope_switch(self) -> int | None:
        """The length past which a request's K/V are all recomputed with other RoPE frequencies (None:
        never; Phi-3's LongRoPE, see `models.phi3`)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metas: Sequence[AttentionMetadata], attention: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, `[num_tokens, hidden]`, or only those of `rows` (long indices,
        in their order: the rows the step reads, `selects_rows`); `kv_caches` and `metas` per layer."""
        if self.mirror is not None:  # (every rank computes every row: the layers' collectives see one shape)
            with self.mirror.forward(input_ids, positions, kv_caches, metas):
                hidden = self.run_layers(input_ids, positions, kv_caches, metas, attention)
            return hidden if rows is None else hidden.index_select(0, rows)
        return self.run_layers(input_ids, positions, kv_caches, metas, attention, rows)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                   metas: Sequence[AttentionMetadata], attention: AttentionBackend,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        lora = self.lora_state.batch if self.lora_state is not None else None
        if self.decode_stack is not None and self.decode_stack.takes(x, kv_caches, metas, lora):
            cos, sin = self.rotary(positions, x.dtype)  # as the eager layers take them (bf16: rounded)
            x = self.decode_stack(x, cos, sin, kv_caches, metas, metas[0].page_size, lora)
            return self.norm(x if rows is None else x.index_select(0, rows))
        last = len(self.layers) - 1
        rotary = self.rotary_for_layer(positions, x.dtype)
        for i, (layer, (cos, sin), kv_cache, meta) in enumerate(zip(self.layers, rotary, kv_caches, metas)):
            if i == last and rows is not None and lora is None and selects_rows(type(layer)):
                x, rows = layer(x, cos, sin, kv_cache, meta, attention, rows=rows), None
            else:
                x = layer(x, cos, sin, kv_cache, meta, attention)
        return self.norm(x if rows is None else x.index_select(0, rows))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row's logits without materializing them, where the LM head can fuse it
        (quantized tiled heads: `QuantMatmul.argmax`); None elsewhere. Soft-capping is monotonic, so
        it does not change the argmax."""
        argmax = getattr(self.lm_head_fn, "argmax", None)
        return argmax(hidden) if argmax is not None else None

    @property
    def logits_out_width(self) -> int | None:
        """The width of the `out` buffer `compute_logits` writes into (a quantized head's output
        features); None where the head allocates its own logits and ignores `out`."""
        head = self.lm_head_fn
        return head.out_features if isinstance(head, QuantMatmul) else None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits for the rows that sample (only those, not every prompt token); through the packed
        head (`linear.packed_lm_head`) once the weights are loaded. A quantized head writes them into
        `out` when given (the caller's reused `[rows, logits_out_width]` buffer); others ignore it."""
        head = self.lm_head_fn
        with self.mirror.logits(hidden) if self.mirror is not None else nullcontext():
            if out is not None and isinstance(head, QuantMatmul):
                logits = head(hidden, out=out)
            else:
                logits = head(hidden) if head is not None else F.linear(hidden, self.lm_head_weight)
        if self.final_softcap is not None:  # in place: the logits are the head's own (or `out`)
            logits = logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        logits = logits.float()
        return logits if self.logits_divisor is None else logits.div_(self.logits_divisor)
