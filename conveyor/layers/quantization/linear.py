"""Linear layers and embeddings over quantized weights (`QuantizedTensor`), on CPU.

Inputs go through the native kernel (`kernels/quant_gemm.cpp`): the weights are
read in their quantized form, the activations quantized to int8 blocks of 32, integer dot products
(AVX512-VNNI: ~400 GFLOP/s a core from 16 rows on, 85% of the instruction's measured peak; fp32 BLAS
peaks at 160 and oneDNN's bf16 matmul on AVX512-BF16 at 80). On a CPU with AMX, oneDNN's bf16
matmul runs on the tiles and is faster for big inputs: there, in bf16, inputs of more than
`BF16_KERNEL_MAX_ROWS` rows (prefill chunks, big decode batches) go to it instead, the weight
dequantized into a scratch buffer shared by every layer (not a second copy of the model: at most
`SCRATCH_BYTES` of one matrix's rows at a time). Dense bf16 weights stay in tiles at every row count
without AMX: over bf16 inputs they multiply by vdpbf16ps where it runs at the FMA's rate (AMD's
avx512_bf16; 360-440 GFLOP/s on 2 Zen 4 cores from 8 rows on, oneDNN's bf16 matmul 160-430), by fp32
FMAs of the widened weights elsewhere. Without the native kernels, every input takes the dequantize path.

Every weight type takes that path: its whole-matrix dequantization (`kernels.dequantize_matrix`: a
quantized block row's 32 values at a time in vector registers, dense tiles copied back into rows) is
cheap next to the matmul.
Where the two cross on an AMX Xeon, and what the kernel gives without AMX: docs/benchmarks.md
(`### An AMX CPU's split`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import cpu_flags, cpu_matmul_ops, native_kernels_enabled
from .registry import quantization_method
from .tensors import TILE_ROWS, QuantizedTensor, bf16_rows, cat_rows

# On an AMX CPU, in bf16, up to this many rows the kernel beats dequantize + oneDNN's bf16 matmul on
# the AMX tiles (module docstring); without AMX the kernel wins at every row count.
BF16_KERNEL_MAX_ROWS = 128


def bf16_kernel_max_rows() -> int | None:
    """Most rows of a bf16 input the native kernel takes (None: any), on this CPU."""
    return BF16_KERNEL_MAX_ROWS if "amx_bf16" in cpu_flags() else None


def matmul_ops() -> object | None:
    """The native kernels, or None (PyTorch fallbacks) when off or not buildable."""
    return cpu_matmul_ops() if native_kernels_enabled() else None


# The most bytes of weight the oneDNN path dequantizes at a time: a bigger matrix goes in chunks of rows,
# so the scratch stays this size (at 4,096 rows of a 3B model's matrices oneDNN ran as fast as over the
# whole matrix, at 2,048 1-7% slower: docs/benchmarks.md); the 1B shape's matrices fit whole.
SCRATCH_BYTES = 64 << 20


class _Scratch:
    """One buffer per dtype of at most `SCRATCH_BYTES` (or one tile's rows), reused by every layer: a
    weight's chunks of rows are dequantized into it one after the other, as [rows, columns] views."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def chunks(self, weight: QuantizedTensor, dtype: torch.dtype,
               ops: object | None) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, its rows dequantized) for the chunks of `weight` in order, each valid until the next."""
        if ops is None:
            yield 0, weight.dequantize(dtype)
            return
        rows, cols = weight.shape
        per_chunk = max(TILE_ROWS, SCRATCH_BYTES // (cols * dtype.itemsize) // TILE_ROWS * TILE_ROWS)
        size = min(rows, per_chunk) * cols
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[dtype] = torch.empty(size, dtype=dtype)
        scales = weight.row_scales_or_empty()
        for n0 in range(0, rows, per_chunk):
            n1 = min(rows, n0 + per_chunk)
            out = buffer[:(n1 - n0) * cols].view(n1 - n0, cols)
            ops.dequantize_matrix(weight.data[n0 // TILE_ROWS:-(-n1 // TILE_ROWS)], weight.qtype,
                                  scales[n0:n1 + (-n1) % TILE_ROWS] if scales.numel() else scales, out)
            yield n0, out


SCRATCH = _Scratch()


def merge_segments(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Adjacent parts of one type concatenated: a fused q/k/v of one type is a single segment; then
    tiled for the kernels where they are available (`QuantizedTensor.tiled`)."""
    segments: list[list[QuantizedTensor]] = []
    for part in parts:
        if segments and (segments[-1][0].qtype, segments[-1][0].shape[1]) == (part.qtype, part.shape[1]):
            segments[-1].append(part)
        else:
            segments.append([part])
    merged = [group[0] if len(group) == 1 else cat_rows(group) for group in segments]
    ops = matmul_ops()
    return merged if ops is None else [m.tiled(ops) for m in merged]


class QuantMatmul:
    """`x -> x @ W.T (+ bias)` for a quantized `W` made of row segments (their types may differ:
    K-quant GGUF files mix types inside one fused projection). A plain callable, so a tied LM head
    can share the embedding's weight without registering it twice. `out_dtype` None = x's dtype."""

    __slots__ = ("bf16_max_rows", "bias", "in_features", "ops", "out_dtype", "out_features", "segments")

    def __init__(self, parts: list[QuantizedTensor], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        self.segments = merge_segments(parts)
        if len({s.shape[1] for s in self.segments}) != 1:
            raise ValueError("every part of a quantized linear needs the same number of input features")
        self.in_features = self.segments[0].shape[1]
        self.out_features = sum(s.shape[0] for s in self.segments)
        self.bias = bias
        self.out_dtype = out_dtype
        self.ops = matmul_ops()
        self.bf16_max_rows = bf16_kernel_max_rows()

    def takes_kernel(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether an input of `rows` rows in `dtype` runs on the native kernel (else: dequantize + matmul)."""
        limit = self.bf16_max_rows
        return self.ops is not None and (dtype != torch.bfloat16 or limit is None or rows <= limit)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a contiguous `[rows, out_features]` buffer of the output dtype to write into (an LM head's
        logits buffer that the caller reuses step after step; see `engine.step_buffers.LogitsBuffer`)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        dtype = self.out_dtype or x.dtype
        ops = self.ops
        bias = None if self.bias is None else self.bias.detach()
        if out is not None and (out.shape != (x2.shape[0], self.out_features) or out.dtype != dtype
                                or not out.is_contiguous()):
            raise ValueError(f"quantized linear: out must be a contiguous {dtype} [{x2.shape[0]}, "
                             f"{self.out_features}] tensor, got {out.dtype} {list(out.shape)}")
        if self.takes_kernel(x2.shape[0], x.dtype):
            out = torch.empty(x2.shape[0], self.out_features, dtype=dtype) if out is None else out
            start = 0
            for seg in self.segments:
                end = start + seg.shape[0]
                ops.quant_matmul(x2, seg.data, seg.qtype, seg.row_scales_or_empty(),
                                 None if bias is None else bias[start:end], out[:, start:end])
                start = end
        else:
            outs, start = [], 0
            for seg in self.segments:
                for n0, w in SCRATCH.chunks(seg, x.dtype, ops):
                    n0 += start
                    outs.append(F.linear(x2, w, None if bias is None else bias[n0:n0 + w.shape[0]].to(x.dtype)))
                start += seg.shape[0]
            result = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).to(dtype)
            out = result if out is None else out.copy_(result)
        return out.view(*lead, self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """argmax over the output features of `x @ W.T` per row, without writing the outputs (an LM head
        fused with greedy sampling, `kernels.quant_argmax`); None where that does not apply (several
        segments, a bias, no native kernels, a bf16 input for the dequantize path)."""
        if (self.ops is None or self.bias is not None or len(self.segments) != 1
                or not self.takes_kernel(x.shape[0], x.dtype)):
            return None
        seg = self.segments[0]
        x2 = x.reshape(-1, self.in_features)
        return self.ops.quant_argmax(x2 if x2.stride(-1) == 1 else x2.contiguous(), seg.data, seg.qtype,
                                     seg.row_scales_or_empty(), self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


class QuantLinear(nn.Module):
    """Drop-in for `nn.Linear` with quantized weights: `bias` stays a parameter (loaded from the
    state dict as before), the weight segments are plain attributes outside the state dict."""

    def __init__(self, parts: list[QuantizedTensor], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        out_features = sum(p.shape[0] for p in parts)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kernel = QuantMatmul(parts, self.bias)  # the same Parameter
        self.in_features, self.out_features = self.kernel.in_features, out_features
        # A load with assign=True (the models' loader) replaces the Parameter: the kernel takes the new one.
        self.register_load_state_dict_post_hook(QuantLinear.share_bias)

    @staticmethod
    def share_bias(module: QuantLinear, incompatible_keys: object) -> None:
        """The kernel's bias is the module's (a load-state-dict post hook)."""
        module.kernel.bias = module.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def extra_repr(self) -> str:
        types = "+".join(s.type_name for s in self.kernel.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={types}"


def tiled_segments(linear: nn.Module) -> list[tuple] | None:
    """A linear as the native layer code takes it (its segments in the kernels' tiles: (tiles, weight type, row
    scales or empty, rows)), or None where it cannot: not a `QuantLinear` (dense fp32 is the exact path, on
    PyTorch's matmuls), or built without the kernels."""
    if not isinstance(linear, QuantLinear) or any(s.layout != "tiles" for s in linear.kernel.segments):
        return None
    return [(s.data, int(s.qtype), s.row_scales_or_empty(), s.shape[0]) for s in linear.kernel.segments]


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a quantized table: the looked-up rows are dequantized to `dtype`. The table is
    tiled for the kernels, the layout a tied LM head shares, except where `tiled` is False and it is a
    file's (`QuantizedTensor.source`, an untied table): then each lookup reads its rows from the file, so
    the table is never resident in the process. A mapping of the file's pages would not do: a touched row
    maps the whole large folio the page cache holds it in, and the table soon becomes resident."""

    def __init__(self, weight: QuantizedTensor, dtype: torch.dtype, tiled: bool = True) -> None:
        super().__init__()
        ops = matmul_ops()
        from_file = ops is not None and not tiled and weight.source is not None
        self.weight = weight if ops is None or from_file else weight.tiled(ops)  # a tied head shares the tiles
        self.file = open(weight.source.path, "rb", buffering=0) if from_file else None  # noqa: SIM115 (the model's)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ops = matmul_ops()
        flat = ids.reshape(-1)
        if ops is None:
            return self.weight.index_rows(flat).dequantize(self.dtype).view(*ids.shape, self.embedding_dim)
        table, index, num_rows = self.weight, flat, self.num_embeddings
        if self.file is not None:  # the looked-up rows from the file, tiled
            rows = torch.empty(flat.numel(), table.data.shape[1], dtype=torch.uint8)
            ops.read_rows(self.file.fileno(), table.source.offset, flat, num_rows, rows)
            table = QuantizedTensor(rows, table.qtype, (flat.numel(), self.embedding_dim)).tiled(ops)
            index, num_rows = torch.arange(flat.numel()), flat.numel()
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=self.dtype)
        ops.dequantize_rows(table.data, table.qtype, table.row_scales_or_empty(), index, num_rows, out)
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight={self.weight.type_name}"


Weight = torch.Tensor | QuantizedTensor


def tile_bf16_modules(model: nn.Module) -> int:
    """Replace, in place, every bf16 CPU `nn.Linear` and `nn.Embedding` of a loaded model with the same
    weights in the kernels' tiles (`QuantLinear` / `QuantEmbedding` over `bf16_rows`; a tied LM head
    then shares the embedding's tiles): one copy of the weights, multiplied by the native GEMM (bf16
    pairs by vdpbf16ps where it runs at the FMA's rate, else the weights widened to fp32 for FMAs; both
    outran oneDNN's bf16 matmul without AMX), on AMX above `bf16_kernel_max_rows()` rows by oneDNN's.
    How many were replaced; none without the native kernels."""
    if matmul_ops() is None:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if (type(child) not in (nn.Linear, nn.Embedding) or weight.dtype != torch.bfloat16
                    or weight.device.type != "cpu"):
                continue
            if type(child) is nn.Embedding:
                tiled: nn.Module = QuantEmbedding(bf16_rows(weight), torch.bfloat16)
            else:
                tiled = QuantLinear([bf16_rows(weight)], bias=child.bias is not None, dtype=torch.bfloat16)
                if child.bias is not None:
                    tiled.bias.data.copy_(child.bias.data)
            setattr(parent, name, tiled)
            replaced += 1
    return replaced


def dequantized(weight: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight as a dense tensor: a quantized one widened to `dtype`, a dense one as it is."""
    return weight.dequantize(dtype) if isinstance(weight, QuantizedTensor) else weight


def float_linear(weight: Weight, bias: Weight | None = None) -> nn.Linear:
    """An fp32 `nn.Linear` of these tensors (quantized ones widened): a small head kept in full precision."""
    weight = dequantized(weight).float()
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(dequantized(bias).float())
    return layer


def fuse_rows(parts: list[Weight]) -> torch.Tensor | list[Weight]:
    """Fused q/k/v or gate/up: one dense tensor, or the parts as they are when some are quantized."""
    return torch.cat(parts) if all(isinstance(p, torch.Tensor) for p in parts) else list(parts)


def plan_weights(weights: dict[str, Weight | list[Weight]], quantization: str, dtype: torch.dtype,
                 quantizable: set[str]) -> dict[str, torch.Tensor | list[QuantizedTensor]]:
    """Each weight as the model will hold it: a dense tensor, or quantized segments.

    "none": everything dense (quantized GGUF tensors dequantized; the exact path). "gguf": the
    file's quantized tensors stay as they are, dense ones stay dense. "int8"/"int4": every weight in
    `quantizable` (linear and embedding weights) is quantized from its float values, a GGUF tensor
    dequantized first; a matrix whose rows do not split into groups of 32 stays dense.
    """
    method = quantization_method(quantization)
    planned: dict[str, torch.Tensor | list[QuantizedTensor]] = {}
    for name, value in weights.items():
        parts = value if isinstance(value, list) else [value]
        quantized = any(isinstance(p, QuantizedTensor) for p in parts)
        if method.keeps_stored and quantized and all(isinstance(p, QuantizedTensor) for p in parts):
            planned[name] = parts  # type: ignore[assignment]
            continue
        tensors = [p.dequantize(dtype) if isinstance(p, QuantizedTensor) else p for p in parts]
        dense = tensors[0].contiguous() if len(tensors) == 1 else torch.cat(tensors)  # one part: not copied
        if method.quantize is not None and name in quantizable and dense.dim() == 2 and dense.shape[1] % 32 == 0:
            planned[name] = [method.quantize(dense)]
        else:
            planned[name] = dense
    return planned


def prompts_take_onednn(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether most of `model`'s linear weights (by bytes) send `dtype` inputs of more than
    `BF16_KERNEL_MAX_ROWS` rows to oneDNN's matmul (bf16 on AMX CPUs; batch invariance, which keeps them
    on the kernel, is set later by the engine): each such call dequantizes its weight, which larger steps
    amortize."""
    if dtype != torch.bfloat16:
        return False
    kernels = [m.kernel for m in model.modules() if isinstance(m, QuantLinear)]
    split = sum(k.nbytes for k in kernels if k.bf16_max_rows is not None)
    return 2 * split > sum(k.nbytes for k in kernels)


def describe_weights(model: nn.Module, quantization: str) -> str:
    """For the start-up log: the weight format and the resident bytes of the model's weights (packed
    oneDNN copies included)."""
    from ..linear import PackedMatmul

    counts: dict[str, int] = {}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), PackedMatmul)]
    head = getattr(model, "lm_head_fn", None)
    packed += [head] if isinstance(head, PackedMatmul) else []
    nbytes += sum(k.packed.numel() * k.packed.element_size() for k in packed)  # oneDNN's second copy (fp32)
    for module in model.modules():
        tensors = (module.kernel.segments if isinstance(module, QuantLinear)
                   else [module.weight] if isinstance(module, QuantEmbedding) else [])
        for t in tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
            nbytes += 0 if getattr(module, "file", None) is not None else t.nbytes  # a table read from its file
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    return f"{quantization}{f' ({kinds} matrices)' if kinds else ''}, {nbytes / 2**20:.0f} MiB"
