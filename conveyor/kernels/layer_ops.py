"""Whole layers in one native call: the decode stack of a Llama-family model's decoder layers
(decode_stack_cpu.cpp) and a mixture-of-experts block (moe_cpu.cpp). Each is built once
per model (or layer) from its weights' tiles; the native object points into those tensors, so the
wrapper keeps them alive, and frees the native object with itself."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .native import DTYPES, F32, F64, I32, I64, INT8_ROWS, P, Native, bind, dtype_code, int64_vector, require

# A weight's row segment as the caller gives it: (tiles, weight type, row scales (empty: none), rows).
SegmentTuple = tuple[torch.Tensor, int, torch.Tensor, int]


class SegmentSpec(ctypes.Structure):
    """tiled_linear.h's SegmentSpec."""

    _fields_ = [("data", P), ("scales", P), ("type", I64), ("rows", I64)]


def _segments(parts: Sequence[SegmentTuple], keep: list[torch.Tensor]) -> ctypes.Array:
    """The segments as a C array; their tensors go to `keep` (the native side holds their addresses)."""
    specs = (SegmentSpec * len(parts))()
    for spec, (data, qtype, scales, rows) in zip(specs, parts):
        require(data.dtype == torch.uint8 and data.is_contiguous(), "segment tiles must be contiguous uint8")
        require(scales.numel() == 0 or (scales.dtype == torch.float32 and scales.is_contiguous()),
                "segment row scales must be contiguous fp32")
        keep += [data, scales]
        spec.data, spec.scales = data.data_ptr(), scales.data_ptr() if scales.numel() else None
        spec.type, spec.rows = int(qtype), int(rows)
    return specs


def _fp32(t: torch.Tensor | None, n: int, name: str) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().float().contiguous()
    require(t.numel() == n, f"{name} must have {n} values, got {t.numel()}")
    return t


def _pointers(tensors: Sequence[torch.Tensor], name: str) -> ctypes.Array:
    return (P * len(tensors))(*[int64_vector(t, name) for t in tensors])


class DecodeStack(Native):
    """A decode batch (1 to `max_rows` rows) through every decoder layer in one call and one OpenMP
    region, computing bit for bit what the eager layers compute."""

    def __init__(self, lib: ctypes.CDLL, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, scale: float, max_rows: int) -> None:
        super().__init__(lib)
        new = bind(lib, "conveyor_decode_stack_new", P, I64, I64, I64, I64, I64, F64, F64, I64)
        self._free = bind(lib, "conveyor_decode_stack_free", None, P)
        self._add = bind(lib, "conveyor_decode_stack_add_layer", I32, P, P, P, P, P, P, I64, I32, P, P, P, I64, P)
        self._forward = bind(lib, "conveyor_decode_stack_forward", I32, P, P, I64, P, P, I32, I32, P, P, I64, P, P, P,
                             P, P, I64, P, I64, I32, I32, P, P, I64)
        self._set_lora = bind(lib, "conveyor_decode_stack_set_lora", I32, P, I64, I64, I32, P, P, P, P, I64, I64, I64)
        self._add_mamba = bind(lib, "conveyor_decode_stack_add_mamba_layer", I32, P, P, P, P, P, P, I64, I64, I64, I64,
                               I64, I64, I64, P, P, P, P, P, P, F32)
        self._residual_scale = bind(lib, "conveyor_decode_stack_set_residual_scale", I32, P, F32)
        self._set_moe = bind(lib, "conveyor_decode_stack_set_moe", I32, P, I64, P)
        self._set_sinks = bind(lib, "conveyor_decode_stack_set_sinks", I32, P, I64, P)
        self._blocks: list[MoeBlock] = []
        self.hidden = hidden
        self.num_layers = 0
        self._keep: list[torch.Tensor] = []
        self._kv: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None
        self._handle = new(hidden, intermediate, heads, kv_heads, head_dim, eps, scale, max_rows)
        if not self._handle:
            self.check(-1)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._free(self._handle)
            self._handle = None

    def add_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor, linears: Sequence[Sequence[SegmentTuple]],
                  biases: Sequence[torch.Tensor | None], group: int, rope: bool = True,
                  qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None, taps: torch.Tensor | None = None,
                  conv_bias: torch.Tensor | None = None) -> None:
        """The next layer: its two norms' weights, the row segments of qkv, o, gate_up and down (in that
        order) and their biases (None: none), the layer group whose attention metadata it reads, whether
        it rotates q and k (False: a NoPE layer), and its per-head q/k norm weights (None: none). A
        short-convolution layer: `taps` `[kernel, hidden]` and `conv_bias` (or None), its in_proj and
        out_proj in the places of qkv and o."""
        require(len(linears) == 4 and len(biases) == 4, "qkv, o, gate_up and down expected")
        norms = [_fp32(w, self.hidden, "a norm's weight") for w in (input_norm, post_norm)]
        arrays = [_segments(parts, self._keep) for parts in linears]
        rows = [sum(int(part[3]) for part in parts) for parts in linears]
        fp32_biases = [_fp32(b, n, "a bias") for b, n in zip(biases, rows)]
        head = [_fp32(w, w.numel(), "a q/k norm's weight") for w in qk_norms] if qk_norms else [None, None]
        kernel = 0 if taps is None else taps.shape[0]
        conv = [None if t is None else _fp32(t, n, "a conv layer's taps or bias")
                for t, n in ((taps, kernel * self.hidden), (conv_bias, self.hidden))]
        self.check(self._add(self._handle, norms[0].data_ptr(), norms[1].data_ptr(),
                             (P * 4)(*[ctypes.addressof(a) for a in arrays]), (I64 * 4)(*[len(a) for a in arrays]),
                             (P * 4)(*[None if b is None else b.data_ptr() for b in fp32_biases]), group, int(rope),
                             *[None if t is None else t.data_ptr() for t in head], None if conv[0] is None else
                             conv[0].data_ptr(), kernel, None if conv[1] is None else conv[1].data_ptr()))
        self.num_layers += 1

    def add_mamba_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor,
                        linears: Sequence[Sequence[SegmentTuple]], biases: Sequence[torch.Tensor | None], group: int,
                        shape: tuple[int, int, int, int, int], weights: Sequence[torch.Tensor], eps: float) -> None:
        """The next layer, a Mamba-2 layer: its norms, the row segments of the mixer's in_proj and out_proj,
        gate_up and down, and their biases, as `add_layer` takes them; the mixer's (heads, P, N, groups,
        kernel) and its weights as `layers.mamba2.Mamba2Mixer._native_weights` gives them (copied)."""
        require(len(linears) == 4 and len(biases) == 4, "in_proj, out_proj, gate_up and down expected")
        norms = [_fp32(w, self.hidden, "a norm's weight") for w in (input_norm, post_norm)]
        arrays = [_segments(parts, self._keep) for parts in linears]
        rows = [sum(int(part[3]) for part in parts) for parts in linears]
        fp32_biases = [_fp32(b, n, "a bias") for b, n in zip(biases, rows)]
        taps, conv_bias, *rest = [w.detach().float().contiguous() for w in weights]
        heads, p, n, groups, kernel = shape
        segments = (P * 4)(*[ctypes.addressof(a) for a in arrays])
        counts = (I64 * 4)(*[len(a) for a in arrays])
        bias_pointers = (P * 4)(*[None if b is None else b.data_ptr() for b in fp32_biases])
        self.check(self._add_mamba(self._handle, norms[0].data_ptr(), norms[1].data_ptr(), segments, counts,
                                   bias_pointers, group, heads, p, n, groups, kernel, taps.shape[1], taps.data_ptr(),
                                   conv_bias.data_ptr() if conv_bias.numel() else None, *[w.data_ptr() for w in rest],
                                   eps))
        self.num_layers += 1

    def set_sinks(self, layer: int, sinks: torch.Tensor) -> None:
        """Layer `layer`'s attention sinks: one logit per query head (copied as fp32, the eager kernel's)."""
        values = sinks.detach().float().contiguous()
        self.check(self._set_sinks(self._handle, layer, values.data_ptr()))

    def set_moe(self, layer: int, block: MoeBlock) -> None:
        """Layer `layer`'s MLP is this mixture-of-experts block (added without gate_up and down): the stack runs
        the object itself, which is kept alive here."""
        self._blocks.append(block)
        self.check(self._set_moe(self._handle, layer, block.handle))

    def set_residual_scale(self, scale: float) -> None:
        """Each layer's output times `scale` before its residual add (Granite's residual multiplier)."""
        self.check(self._residual_scale(self._handle, scale))

    def set_lora(self, layer: int, projection: int, a: torch.Tensor, b: torch.Tensor, slice_rows: torch.Tensor,
                 slice_block: torch.Tensor) -> None:
        """Layer `layer`'s projection `projection` (0..3: qkv, o, gate_up, down) adds the adapter deltas of
        these stacked weights (a `LoRALinear`'s: A `[slots, in, blocks * rank]`, B `[slots, rank, out]`,
        `slice_rows` [slices + 1], `slice_block` [slots, slices]). The stack reads them by address at each
        step, so slots loaded later are seen; the tensors are kept alive here."""
        code = dtype_code(a, "a")
        require(b.dtype == a.dtype and a.is_contiguous() and b.is_contiguous() and a.device.type == "cpu",
                "a and b must be contiguous CPU tensors of one dtype")
        slots, _, width = a.shape
        rank = b.shape[1]
        require(b.shape[0] == slots and width % rank == 0, f"a {list(a.shape)} and b {list(b.shape)} do not fit")
        for t, name in ((slice_rows, "slice_rows"), (slice_block, "slice_block")):
            require(t.dtype == torch.long and t.is_contiguous(), f"{name} must be contiguous int64")
        require(slice_block.shape[0] == slots and slice_rows.numel() == slice_block.shape[1] + 1,
                "slice_block must be [slots, slices] and slice_rows [slices + 1]")
        self._keep += [a, b, slice_rows, slice_block]
        self.check(self._set_lora(self._handle, layer, projection, code, a.data_ptr(), b.data_ptr(),
                                  slice_rows.data_ptr(), slice_block.data_ptr(), slice_block.shape[1], rank,
                                  width // rank))

    def _kv_arrays(self, kv: Sequence[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        """Each layer's cache address and slot count as C arrays, rebuilt only when the caches change."""
        key = tuple(t.data_ptr() for t in kv)
        if self._kv is None or self._kv[0] != key:
            self._kv = key, (P * len(kv))(*key), (I64 * len(kv))(*[t.shape[1] for t in kv])
        return self._kv[1], self._kv[2]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Sequence[torch.Tensor],
                tables: Sequence[torch.Tensor], lens: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
                windows: Sequence[int], positions: torch.Tensor, page_size: int, threads: int,
                shared_rows: bool, model_dtype: torch.dtype,
                lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, hidden] fp32, updated in place and returned; cos/sin [B, D] fp32; per layer its KV cache
        [2, slots, Hkv, D] (`model_dtype`, whose roundings the stack keeps, or int8 rows); per layer group
        its decode block tables [B, width], context lengths [B], the slots [B] the new K/V go to and its
        sliding window (0: none); the rows' positions [B]. `shared_rows`: some request has several rows
        (speculative proposals). `lora`: the rows with an adapter grouped by slot, `order` and the
        (slot, start, end) `groups` `[n, 3]` of `layers.lora.LoRABatch` (None: none)."""
        require(x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == self.hidden,
                "x must be fp32 [B, hidden]")
        require(len(windows) == len(tables) == len(lens) == len(slots) and positions.numel() == x.shape[0],
                "one window per layer group and int64 positions [B] expected")
        require(cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32,
                "fp32 cos/sin")
        dtype = kv[0].dtype
        require(model_dtype in DTYPES, "the model's dtype must be fp32 or bf16")
        require(dtype in (model_dtype, torch.uint8) and all(t.is_contiguous() and t.dtype == dtype for t in kv),
                "contiguous KV caches of one dtype: the model's, or int8 rows (uint8)")
        kv_code = INT8_ROWS if dtype == torch.uint8 else DTYPES[dtype]
        kv_ptrs, kv_slots = self._kv_arrays(kv)
        groups = len(tables)
        lora_args = (None, None, 0) if lora is None else (
            int64_vector(lora[0], "order"), int64_vector(lora[1], "lora groups"), lora[1].shape[0])
        self.check(self._forward(
            self._handle, x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), DTYPES[model_dtype], kv_code,
            kv_ptrs, kv_slots,
            len(kv), _pointers(tables, "block tables"), (I64 * groups)(*[t.shape[1] for t in tables]),
            _pointers(lens, "context lengths"), _pointers(slots, "slots"), (I64 * groups)(*windows), groups,
            int64_vector(positions, "positions"), page_size, threads, shared_rows, *lora_args))
        return x


class MoeBlock(Native):
    """A mixture-of-experts block (moe_block.h) in one call: router, routing, experts grouped by expert, the
    shared expert, the weighted sum; the decode stack runs the same object inside its own call."""

    ROUTES = {"softmax": 0, "topk_softmax": 1, "biased": 2, "sigmoid": 3}

    def __init__(self, lib: ctypes.CDLL, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__(lib)
        new = bind(lib, "conveyor_moe_block_new", P, I64, I64, F64, F64)
        self._free = bind(lib, "conveyor_moe_block_free", None, P)
        self._add = bind(lib, "conveyor_moe_block_add_expert", I32, P, P, I64, P, I64, P, P)
        self._router = bind(lib, "conveyor_moe_block_set_router", I32, P, P, I64, P, I32, I64, I32, F32, F32, P, I32)
        self._shared = bind(lib, "conveyor_moe_block_set_shared", I32, P, P, I64, P, I64, I64)
        self._forward = bind(lib, "conveyor_moe_block_forward", I32, P, I32, P, I64, P, I32, P, P)
        self._counts = bind(lib, "conveyor_moe_block_counts", I32, P, P)
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts = 0
        self._keep: list[torch.Tensor] = []
        self._handle = new(hidden, intermediate, alpha, limit)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._free(self._handle)
            self._handle = None

    @property
    def handle(self) -> int:
        """The native object's address (the decode stack runs it)."""
        return self._handle

    def add_expert(self, gate_up: Sequence[SegmentTuple], down: Sequence[SegmentTuple],
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        """One expert's gate/up (gate rows first) and down row segments, and their fp32 biases (None: none)."""
        biases = []
        for bias, n in ((gate_up_bias, 2 * self.intermediate), (down_bias, self.hidden)):
            require(bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n),
                    f"expert {self.num_experts}: a bias must be contiguous fp32 [{n}]")
            biases.append(None if bias is None else bias.data_ptr())
        up, dn = _segments(gate_up, self._keep), _segments(down, self._keep)
        self.check(self._add(self._handle, up, len(up), dn, len(dn), *biases))
        self.num_experts += 1

    def set_router(self, segments: Sequence[SegmentTuple], bias: torch.Tensor | None, route: str, top_k: int,
                   renormalize: bool = False, norm_min: float = 0.0, scale: float = 1.0,
                   selection_bias: torch.Tensor | None = None, shared_gate: bool = False) -> None:
        """The router in F32 tiles (a row per expert, then the shared expert's gate row where `shared_gate`), its
        bias, and the routing rule (`ROUTES`, layers/moe.py's functions of those names); after the experts."""
        require(route in self.ROUTES, f"unknown routing {route!r}")
        keep = [_fp32(bias, self.num_experts + shared_gate, "the router's bias"),  # (copied by the call)
                _fp32(selection_bias, self.num_experts, "the selection bias")]
        parts = _segments(segments, self._keep)
        self.check(self._router(self._handle, parts, len(parts), None if keep[0] is None else keep[0].data_ptr(),
                                self.ROUTES[route], top_k, renormalize, norm_min, scale,
                                None if keep[1] is None else keep[1].data_ptr(), shared_gate))

    def set_shared(self, gate_up: Sequence[SegmentTuple], down: Sequence[SegmentTuple], intermediate: int) -> None:
        """The shared expert (every row through it), `intermediate` wide."""
        up, dn = _segments(gate_up, self._keep), _segments(down, self._keep)
        self.check(self._shared(self._handle, up, len(up), dn, len(dn), intermediate))

    def forward(self, x: torch.Tensor, out: torch.Tensor, threads: int,
                routes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """out [T, hidden] fp32 = the block over x (fp32 or bf16 [T, hidden]), rounded to x's dtype; `routes`:
        (weights fp32, ids int64) `[T, top_k]` given instead of the router's, and out the experts' fp32 sum
        alone (no shared expert, not rounded)."""
        require(x.dim() == 2 and x.shape[1] == self.hidden and x.is_contiguous(),
                "x must be contiguous fp32 or bf16 [tokens, hidden]")
        code = dtype_code(x, "x")
        require(out.dtype == torch.float32 and out.is_contiguous() and tuple(out.shape) == tuple(x.shape),
                "out must be contiguous fp32 [tokens, hidden]")
        weights = ids = None
        if routes is not None:
            w, i = routes
            require(w.dtype == torch.float32 and w.is_contiguous() and w.shape == i.shape and w.shape[0] == x.shape[0],
                    "routes: contiguous fp32 weights and int64 ids [tokens, top_k]")
            weights, ids = w.data_ptr(), int64_vector(i, "ids")
        self.check(self._forward(self._handle, code, x.data_ptr(), x.shape[0], out.data_ptr(), threads, weights, ids))
        return out

    def counts(self) -> list[int]:
        """Rows per expert of the last call (the stack's too)."""
        counts = torch.empty(self.num_experts, dtype=torch.int64)
        self.check(self._counts(self._handle, counts.data_ptr()))
        return counts.tolist()
