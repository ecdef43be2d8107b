"""The native decode stack: every decoder layer of a Llama-family model with tiled weights (quantized, or bf16)
in one native call, for decode batches of up to `MAX_ROWS` rows (`kernels/decode_stack_cpu.cpp`).

At a few rows a decode step is weight streaming plus per-op overhead: run op by op from Python, each layer
pays dispatch and thread fork/join for a dozen ops, which at small models costs as much as streaming the
weights. The stack keeps the threads up across all layers and meets at barriers instead. It computes what
the eager layers compute, bit for bit (the same kernels, the fused ops' per-row arithmetic, bf16 values
rounded where the eager bf16 tensors round them), reads and writes the same KV pages, so a request's tokens
do not depend on which path its steps took (batch invariance). It is used where it applies: Llama-family
layers (with or without per-head q/k norms, Granite's residual multiplier, gpt-oss's attention sinks; no
soft-capping), LFM2's short-convolution layers and Granite 4.0-H's Mamba-2 layers, each with a dense MLP or a
mixture-of-experts block (the eager layer's native `MoeBlock`, run inside the stack's call), projections in
the kernels' tiles (dense fp32 is the exact path, which stays on PyTorch's matmuls), decode-only batches.
Prefill chunks and batches of more than 64 rows stay on the eager path (the same GEMM per layer).
`CONVEYOR_DECODE_STACK=0` turns it off.

With multi-LoRA (`attach_lora`), steps whose rows have adapters stay on the stack too: it reads the
`LoRALinear`s' stacked adapter weights by address and adds each adapter's delta to its rows after every
base projection, with the per-layer kernel's code (`kernels/lora_delta.h`), so the bits are the eager
LoRA path's. Per step the host passes the `LoRABatch`'s grouped rows, nothing per layer.

Its threads meet at 8 barriers a layer (adapter rows add none, but one when a step has fewer rows
than threads; a mixture-of-experts block adds its own), so when another process takes a core a barrier
waits for a descheduled thread's next time slice: with one busy neighbour a step can take hundreds of
times longer.
`ThreadChooser` times the stack and keeps whichever thread count (torch's, or one thread, which has no
barriers) measured faster lately, trying the other now and then.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence

import torch

from ..kernels.ssm_ops import SsmOps
from ..layers.attention import AttentionMetadata
from ..layers.lora import LoRABatch, LoRALinear
from ..layers.moe import SparseMoe
from ..layers.quantization import linear as quant_linear
from ..layers.quantization.linear import tiled_segments

MAX_ROWS = 64
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the native stack's order


class ThreadChooser:
    """Picks the stack's thread count from recent timings: `choose()` before a call, `record()` after.
    Every `probe_every` calls the other choice runs once; the one with the lower median of its last
    `window` timings wins. A probe faster than the current choice's median replaces its option's
    older timings, which are stale (taken while a neighbour held a core, say): the better count comes
    back at once instead of after `window // 2 + 1` probes, and a lucky probe loses again within a
    few calls."""

    def __init__(self, threads: int, probe_every: int = 64, window: int = 5) -> None:
        self.options = [threads] if threads <= 1 else [threads, 1]
        self.times: dict[int, deque[float]] = {n: deque(maxlen=window) for n in self.options}
        self.current = self.options[0]
        self.probe_every = probe_every
        self.calls = 0
        self.pending = self.current

    def choose(self) -> int:
        self.calls += 1
        others = [n for n in self.options if n != self.current]
        probing = others and (self.calls % self.probe_every == 0 or not self.times[others[0]] and self.calls > 8)
        self.pending = others[0] if probing else self.current
        return self.pending

    def record(self, seconds: float) -> None:
        times = self.times[self.pending]
        if self.pending != self.current and seconds < self.median(self.current):
            times.clear()
        times.append(seconds)
        self.current = min(self.options, key=self.median)

    def median(self, threads: int) -> float:
        """The median of that count's last timings (infinite with none yet)."""
        t = sorted(self.times[threads])
        return t[len(t) // 2] if t else float("inf")


def stack_enabled() -> bool:
    return os.environ.get("CONVEYOR_DECODE_STACK", "1").strip().lower() not in ("0", "false", "no", "off")


def _head_norms(layer: torch.nn.Module) -> bool:
    """Whether the layer's q/k norms (if any) are the stack's: RMSNorms of one head, before RoPE, with the
    layer norms' eps (Qwen3's)."""
    norm = layer.q_norm
    return norm is None or (type(norm) is type(layer.input_layernorm) and norm.eps == layer.input_layernorm.eps
                            and norm.weight.numel() == layer.head_dim)


def _projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A layer's projections in the stack's order; a conv layer's or a Mamba layer's in_proj and out_proj in the
    places of qkv and o; no gate_up and down where the MLP is a mixture of experts."""
    mixer = getattr(layer, "conv", None) or getattr(layer, "mamba", None)
    first = [getattr(layer, p) for p in PROJECTIONS[:2]] if mixer is None else [mixer.in_proj, mixer.out_proj]
    return first + ([] if _experts(layer) else [getattr(layer, p) for p in PROJECTIONS[2:]])


def _experts(layer: torch.nn.Module) -> SparseMoe | None:
    """The layer's mixture-of-experts block, if its MLP is one."""
    mlp = getattr(layer, "mlp", None)
    return mlp if isinstance(mlp, SparseMoe) else None


class DecodeStack:
    """The native stack of one model's layers; `__call__` runs a decode batch through all of them."""

    def __init__(self, native: object, num_layers: int, moes: Sequence[SparseMoe] = ()) -> None:
        self.native = native
        self.num_layers = num_layers
        self.moes = list(moes)  # the layers' expert blocks, whose observers see the stack's steps too
        self.threads = ThreadChooser(torch.get_num_threads())
        self.lora = False  # whether steps with adapter rows run here (`attach_lora`)

    @classmethod
    def build(cls, model: torch.nn.Module, layer_classes: tuple[type, ...],
              mixer_classes: tuple[type, ...] = ()) -> DecodeStack | None:
        """The stack for `model` whose layers are all attention layers of `layer_classes` (the Llama decoder
        layer, Granite's with its residual multiplier, the mixtures of experts') or of `mixer_classes` (LFM2's
        short-convolution layers, Granite 4.0-H's Mamba-2 layers), each with a tiled dense MLP or a native
        mixture-of-experts block (`SparseMoe.block`), or None where it does not apply (see the module
        docstring)."""
        ops = quant_linear.matmul_ops()
        if ops is None or not stack_enabled() or model.dtype not in (torch.float32, torch.bfloat16):
            return None
        layers = list(model.layers)
        if any(not (type(layer) in layer_classes and layer.softcap is None and _head_norms(layer)
                    or type(layer) in mixer_classes)
               or not all(tiled_segments(lin) is not None for lin in _projections(layer))
               or _experts(layer) is not None and _experts(layer).block is None for layer in layers):
            return None
        if getattr(model, "rotary", None) is None or model.rotary.rotary_dim != layers[0].head_dim:  # partial rotary
            return None
        half = model.num_kv_heads * model.head_dim * torch.tensor([], dtype=model.dtype).element_size()
        if not all(SsmOps.rows_fit(half, layer.mamba.state) for layer in layers if hasattr(layer, "mamba")):
            return None
        first = layers[0]
        # (the dense MLP's width as built, Granite 4.0's shared MLP's; 0 where every layer has experts)
        intermediate = max((_projections(layer)[3].in_features for layer in layers if not _experts(layer)), default=0)
        native = ops.DecodeStack(model.config.hidden_size, intermediate, first.num_heads, first.num_kv_heads,
                                 first.head_dim, float(first.input_layernorm.eps), float(first.scale), MAX_ROWS)
        native.set_residual_scale(float(getattr(first, "residual_multiplier", 1.0)))
        for i, layer in enumerate(layers):
            linears = _projections(layer)
            segments = [tiled_segments(lin) for lin in linears] + [[]] * (4 - len(linears))
            biases = [None if lin.bias is None else lin.bias.detach() for lin in linears] + [None] * (4 - len(linears))
            norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            mamba, conv, moe = getattr(layer, "mamba", None), getattr(layer, "conv", None), _experts(layer)
            if mamba is not None:
                native.add_mamba_layer(*norms, segments, biases, i, mamba.native_shape, mamba.native_weights(),
                                       mamba.eps)
            else:
                taps = None if conv is None else conv.conv_weight.detach().flatten(1).t()  # [kernel, hidden]
                native.add_layer(*norms, segments, biases, i, layer.rope,
                                 None if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight), taps,
                                 None if conv is None or conv.conv_bias is None else conv.conv_bias.detach())
            if getattr(layer, "sinks", None) is not None:
                native.set_sinks(i, layer.sinks)
            if moe is not None:
                native.set_moe(i, moe.block)
        return cls(native, len(layers), [m for m in map(_experts, layers) if m is not None])

    def attach_lora(self, layers: Sequence[torch.nn.Module], dtype: torch.dtype) -> None:
        """Run steps with adapter rows here: every projection of `layers` that is a `LoRALinear` (wrapped
        after the stack was built) adds its adapters' deltas. Not where an adapter dtype differs from the
        model's `dtype` (the eager path then converts)."""
        linears = [_projections(layer) for layer in layers]
        if any(isinstance(lin, LoRALinear) and lin.lora_a.dtype != dtype for row in linears for lin in row):
            return
        # (the stack's conv and Mamba rows add no adapter deltas: those steps stay eager)
        if any(isinstance(lin, LoRALinear) for layer, row in zip(layers, linears)
               if hasattr(layer, "conv") or hasattr(layer, "mamba") for lin in row[:2]):
            return
        for i, row in enumerate(linears):
            for p, lin in enumerate(row):
                if isinstance(lin, LoRALinear):
                    self.native.set_lora(i, p, lin.lora_a, lin.lora_b, lin.slice_rows, lin.slice_block)
        self.lora = True

    def takes(self, x: torch.Tensor, kv_caches: Sequence[torch.Tensor], metas: Sequence[AttentionMetadata],
              lora: LoRABatch | None = None) -> bool:
        """A decode-only batch of at most MAX_ROWS rows over the paged cache (not, say, the roofline
        bench's contiguous K/V) in the model's dtype or int8 rows (fp8 pages are the PyTorch backend's);
        with adapter rows (`lora`) only once `attach_lora` ran."""
        rows, meta = x.shape[0], metas[0]
        return ((lora is None or self.lora) and 0 < rows <= MAX_ROWS and isinstance(meta, AttentionMetadata) and meta.num_decodes == rows
                and not meta.prefills and kv_caches[0].dtype in (x.dtype, torch.uint8))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                 metas: Sequence[AttentionMetadata], page_size: int, lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), in x's dtype; `lora`: the step's
        rows with an adapter."""
        h = x.float().contiguous()
        tables = [m.decode_block_tables for m in metas]
        lens = [m.decode_context_lens for m in metas]
        slots = [m.slot_mapping for m in metas]
        windows = [m.window or 0 for m in metas]
        threads = self.threads.choose()
        started = time.perf_counter()
        self.native.forward(h, cos.float().contiguous(), sin.float().contiguous(), list(kv_caches), tables, lens,
                            slots, windows, metas[0].decode_positions, page_size, threads, metas[0].decode_shared_rows,
                            x.dtype, None if lora is None else (lora.order, lora.group_table))
        self.threads.record(time.perf_counter() - started)
        for moe in self.moes:
            if moe.observer is not None:
                moe.observer(moe.block.counts())
        return h.to(x.dtype)
