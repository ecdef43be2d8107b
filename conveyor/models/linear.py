"""The LM head through a oneDNN-prepacked weight on CPU (fp32), at the row counts where it is faster.

`F.linear` on CPU calls MKL sgemm (sgemv for one row) on the plain `[out, in]` weight. oneDNN's
`torch.ops.mkldnn._linear_pointwise` on a weight reordered once by `_reorder_linear_weight` into its
blocked layout is faster at small row counts, and on every row count for a vocab-sized LM head, but
slower for a single row (MKL's sgemv) and for larger row counts on weights that fit in cache. (This
is not what `torch.compile` freezing does for fp32 on x86: it emits `mkl._mkl_linear`, MKL's packed
sgemm, which measured the same as `F.linear`, and bitwise equal to it.)

Measured on the 2-core AMD EPYC (AVX2, no AVX-512), torch 2.13 CPU, 1 thread, SmolLM2-135M shapes,
random fp32 data, plain and packed alternated, medians of 5-7 runs; GFLOP/s plain -> packed (the
machine was shared, so absolute figures move by ~10-20% between runs; the ratios held across runs):

    rows            1           8           32          64          256         512
    qkv 576->960    20.2->14.0  45.7->47.5  63.0->65.8  67.3->65.1  69.1->67.1  85.4->74.8
    o   576->576    20.2->10.8  41.5->47.8  71.3->68.8  82.6->73.9  91.0->79.1  91.3->75.6
    gate_up ->3072  20.6->16.9  43.2->60.3  60.5->65.2  70.7->66.7  71.7->69.8  82.0->80.5
    down 1536->576  24.5->12.3  44.2->52.9  73.2->73.3  80.9->74.8  87.0->70.3  88.9->70.0
    lm_head ->49152  6.9->8.5   20.5->38.1  48.1->63.6  53.4->69.3  64.9->63.8  (1 run: 50.2->56.2)

A finer sweep (rows 1,2,4,8,16,24,32,48,64,96,128) puts the crossover for the decoder projections at
about 16 rows (packed 1.2-1.7x at 2-8 rows for qkv, gate_up and down, ~1.0x for o_proj, 0.55-0.7x
at 1 row, 0.85-0.95x from 48 rows on), and the LM head at 1.7-2.4x for 2-16 rows, 1.4-1.6x for
32-64, 1.1-1.3x for 128-512, 0.99-1.5x for 1 row. For weights that do not fit in cache (2048->8192,
8192->2048) packed wins from 2 to 64 rows (1.1-1.7x) and loses at 1 row (0.66x) and at 256 rows
(0.93-0.95x). Hence the row windows of `row_window`. One row always stays on `F.linear`: packed
loses there except on the 576-wide LM head, where the gain is small and not reliable (0.99-1.5x; a
2048-wide head loses, 0.82x), and keeping it means single-sequence decode is bit-for-bit unchanged.

On the built-in SmolLM2-135M (real activations captured from a 64-request greedy run; one layer's
four linears x 30 plus the tied head, per decode step, 1 thread): 1 row 21.1 -> 21.2 ms (all plain),
8 rows 61.4 -> 45.5 ms, 32 rows 151.5 -> 138.3 ms, 64 rows 246.2 -> 233.5 ms (head 67.0 -> 54.9 ms).

Numerics: the packed path is not bitwise equal to `F.linear` (a different blocking of the reduction).
Max abs difference is ~4e-6 relative on random data; on the model's real activations 6e-7..1.3e-6
relative (head logits up to 39: max abs diff 5e-5), with 100% argmax agreement over 1536 sampled rows
whose smallest top-2 gap was 2.8e-2; 64 of 64 greedy outputs (24 tokens each) were unchanged. Against
an fp64 reference packed is ~2x further off than `F.linear` (2e-6..1.1e-5 vs 1e-6..4e-6): rounding
noise, far under the 1e-4 top-2 gap the greedy-equality tests accept as a tie.

The packed weight is an opaque oneDNN tensor held beside the plain weight (which the embedding and
the out-of-window rows keep using): one more copy of the weight. Only the LM head is packed: it
takes most of the gain at decode batch sizes (head 67.0 -> 54.9 ms of the 12.7 ms saved at 64 rows
above) for one extra 108 MiB copy, where packing every projection as well would add ~405 MiB (75%
of the model) for a gain only between 2 and 16 rows. Packing happens when the model is built, before
the KV pool is sized from free memory.

`CONVEYOR_PACKED_LINEAR=0` turns everything here off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Weights at least this large do not fit in cache; oneDNN's blocking wins on more rows for them.
LARGE_WEIGHT_BYTES = 32 << 20
# Output widths from here on are vocab-sized LM heads, which won at every row count measured (2..512).
VOCAB_SIZED = 16384


def packing_enabled(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether prepacking applies: fp32 on CPU, oneDNN available, and not turned off by
    `CONVEYOR_PACKED_LINEAR=0`."""
    if os.environ.get("CONVEYOR_PACKED_LINEAR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops is not None and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
    except RuntimeError:  # an op namespace whose ops failed to register
        return False


def row_window(weight: torch.Tensor) -> tuple[int, int | None]:
    """Rows (inclusive; None = no upper bound) for which the packed path measured faster than
    `F.linear` for a weight of this shape; see the module docstring for the figures."""
    out_features = weight.shape[0]
    if out_features >= VOCAB_SIZED:
        return 2, None
    if weight.numel() * weight.element_size() >= LARGE_WEIGHT_BYTES:
        return 2, 64
    return 2, 16


class PackedMatmul:
    """`F.linear(x, weight, bias)`: through oneDNN's prepacked weight when x's row count is in
    `window` = (min_rows, max_rows or None; default `row_window(weight)`), else `F.linear` on the
    plain weight. A plain callable, not an `nn.Module`, so it can sit on a model without adding
    parameters or state_dict keys (a tied LM head must not register the embedding weight twice)."""

    __slots__ = ("bias", "in_features", "max_rows", "min_rows", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 window: tuple[int, int | None] | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.in_features = weight.shape[1]
        self.min_rows, self.max_rows = row_window(weight) if window is None else window
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if (rows < self.min_rows or (self.max_rows is not None and rows > self.max_rows)
                or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def packed_lm_head(weight: torch.Tensor, bias: torch.Tensor | None = None,
                   window: tuple[int, int | None] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`hidden -> F.linear(hidden, weight, bias)` for an LM head, through a packed copy of the weight
    where that is faster; for a tied head pass `embed_tokens.weight`, which the embedding keeps using
    as is. Plain `F.linear` when packing does not apply (`packing_enabled`). The callable keeps a
    reference to `weight`; make a new one if the weight is replaced or moved."""
    if not packing_enabled(weight.device, weight.dtype):
        return lambda hidden: F.linear(hidden, weight, bias)
    return PackedMatmul(weight, bias, window)
