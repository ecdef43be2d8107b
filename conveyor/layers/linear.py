"""Linear layers through oneDNN-prepacked weights on CPU (fp32), at the row counts where that is faster.

`F.linear` on CPU calls MKL sgemm (sgemv for one row) on the plain `[out, in]` weight. oneDNN's
`torch.ops.mkldnn._linear_pointwise` on a weight reordered once by `_reorder_linear_weight` into its
blocked layout is faster at decode batch sizes, and on every row count for a vocab-sized LM head,
but not for a single row nor for prefill-sized inputs. (`torch.compile` freezing does not do this
for fp32 on x86: it emits `mkl._mkl_linear`, which measured the same as `F.linear`.)

Measured on the 2-core AMD EPYC (Zen 3, AVX2), torch 2.13 CPU, SmolLM2-135M shapes, random fp32
data, plain and packed alternated, medians; GFLOP/s plain/packed. With 2 threads (torch's default
here, what the engine runs with):

    rows        1      2      4      8      16      28      64       128      512
    qkv 960    14/12  15/17  27/44  46/71  70/104  55/61  110/121  154/135  167/139
    o 576      18/13  15/13  28/36  45/71  70/96   51/54  109/120  159/153  174/171
    gate_up    20/27  15/35  31/68  44/87  72/134  48/62   86/137  142/137  156/138
    down 1536  19/22  17/23  33/62  50/73  77/105  59/67  108/113  144/131  155/125
    lm_head     6/12   6/23  11/36  21/64  42/44   47/104  79/124  110/149     -

With 1 thread the gains are smaller (qkv, gate_up, down 1.2-1.7x at 2-8 rows, about even at 32-64,
0.85-0.95x from 128 rows; the LM head 1.4-2.4x at 2-64 rows) and one row is slower (0.55-0.7x).
Hence the windows of `row_window`: 2-96 rows for the projections, 2 rows and up for an LM head;
everything else, single-row decode included, stays on `F.linear`. Built-in model, decode step at
64 rows, 2 threads: the layers' matmuls take ~24% less time and the head ~35% less.

Numerics: not bitwise equal to `F.linear` (another blocking of the reduction): ~1e-6 relative on
the model's real activations, far under the 1e-4 top-2 gap the greedy-equality tests accept as a
tie (64 of 64 chat greedy outputs unchanged). Memory: the packed copy sits beside the plain weight
(which state_dict, the embedding and out-of-window rows keep using): one more copy of every linear
weight, ~405 MiB for SmolLM2-135M's layers and 108 MiB for its tied head. The model is packed when
it is built, before the KV pool is sized from free memory. `CONVEYOR_PACKED_LINEAR=0` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Output widths from here on are vocab-sized LM heads, which won at every row count measured (2..512).
VOCAB_SIZED = 16384
# Above this many rows (prefill) the projections are as fast or faster on F.linear.
MAX_PACKED_ROWS = 96


def packing_enabled(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether prepacking applies: fp32 on CPU, oneDNN available, and not turned off by
    `CONVEYOR_PACKED_LINEAR=0`."""
    if os.environ.get("CONVEYOR_PACKED_LINEAR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def row_window(weight: torch.Tensor) -> tuple[int, int | None]:
    """Rows (inclusive; None = no upper bound) for which the packed path measured faster than
    `F.linear` for a weight of this shape; see the module docstring for the figures."""
    return (2, None) if weight.shape[0] >= VOCAB_SIZED else (2, MAX_PACKED_ROWS)


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


class PackedLinear(nn.Module):
    """Drop-in for a loaded fp32 CPU `nn.Linear`: the same `weight` and `bias` parameters (shared, so
    state_dict is unchanged) plus a packed copy used where it is faster. Replaces a module whose
    weights will not change; build a new one if they do."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel = PackedMatmul(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed rows {self.kernel.min_rows}..{self.kernel.max_rows or 'any'}")


def prepack_linears(model: nn.Module) -> int:
    """Replace, in place, every fp32 CPU `nn.Linear` of a loaded model with a `PackedLinear`; how many.
    0, and nothing changed, on CUDA, other dtypes, without oneDNN, or with `CONVEYOR_PACKED_LINEAR=0`.
    A module with `prepack = False` keeps its own linears plain: a mixture-of-experts expert, whose
    rows change every step (oneDNN builds a primitive per shape, its cache is kept small) and whose
    packed copies would double the largest part of the model."""
    replaced = 0
    for parent in list(model.modules()):
        if not getattr(parent, "prepack", True):
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_enabled(child.weight.device, child.weight.dtype):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


def packed_lm_head(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`hidden -> F.linear(hidden, weight)` for an LM head, through a packed copy of the weight where
    that is faster; for a tied head pass `embed_tokens.weight`, which the embedding keeps using as
    is. Plain `F.linear` when packing does not apply (`packing_enabled`)."""
    if not packing_enabled(weight.device, weight.dtype):
        return lambda hidden: F.linear(hidden, weight)
    return PackedMatmul(weight)
