"""int8 KV rows (kv_cache_dtype "int8", cache/kv_format.py) in the native kernels: the quantizer writes the
reference's bytes, decode and prefill read them in place and agree bit for bit with each other in any
chunking (the query quantized and the scales applied one way in both: attention_blocks.h), both are exact
attention of the quantized query over the dequantized rows (to fp32's error), and within int8's error of
attention over the rows before quantization."""

from __future__ import annotations

import pytest
import torch

from conveyor.cache.kv_format import dequantize_kv, quantize_kv
from conveyor.kernels import cpu_paged_attention

from tests.attention_utils import (BF16_TOL, decode_every_position, int8_key_queries, int8_value_bound,
                                   prefill_in_chunks, reference_probs, run_reference, sequence_case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 48, 20])
def test_native_quantizer_writes_the_reference_bytes(dtype: torch.dtype, dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(37, 3, dim, generator=g) * torch.logspace(-3, 3, 37)[:, None, None]).to(dtype)
    x[5, 1] = 0  # an all-zero row: scale 0, values 0
    x[6, 0, :4] = torch.tensor([1.5, -2.5, 0.5, 127.0])  # ties round to even
    native = cpu_paged_attention().quantize_kv(x)
    assert native.dtype == torch.uint8 and native.shape == (37, 3, dim + 4)
    assert torch.equal(native, quantize_kv(x))
    values = dequantize_kv(native, torch.float32)
    scales = native[..., dim:].contiguous().view(torch.float32)
    assert (values - x.float()).abs().le(scales * 0.5001).all()  # half a step (and fp32's roundings of x / s)
    assert torch.equal(values[5, 1], torch.zeros(dim))


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap", "dtype", "page"), [
    (9, 3, 64, 0, 0.0, torch.bfloat16, 16),    # the built-in model's heads
    (9, 3, 64, 0, 0.0, torch.float32, 16),
    (8, 1, 128, 0, 0.0, torch.bfloat16, 16),   # 8 query heads on one kv head
    (4, 4, 80, 0, 30.0, torch.float32, 8),     # soft-capped, a head dim that is not a whole number of vectors
    (12, 2, 16, 100, 5.0, torch.bfloat16, 16),  # a window across key blocks, capped
    (12, 2, 16, 100, 5.0, torch.float32, 16),
    (8, 1, 256, 0, 0.0, torch.float32, 16),    # Gemma's head dim: four groups of value pairs, two passes of heads
    (6, 3, 48, 0, 0.0, torch.float32, 8),      # a head dim with a partial group
])
def test_int8_rows_same_bits_in_any_chunk_and_in_decode(heads: int, kv_heads: int, dim: int, window: int,
                                                        softcap: float, dtype: torch.dtype, page: int) -> None:
    length = 300
    q, k, v, _, table, slots = sequence_case(length, heads, kv_heads, dim, dtype, page, seed=3 + dim + window)
    kq, vq = quantize_kv(k), quantize_kv(v)
    kv = torch.zeros(2, (int(table.max()) + 3) * page, kv_heads, dim + 4, dtype=torch.uint8)
    kv[0, slots], kv[1, slots] = kq, vq
    scale = dim ** -0.5
    decoded = decode_every_position(q, kq, vq, table, page, window, scale, softcap)
    whole = prefill_in_chunks(q, kq, vq, kv, slots, [length], window, scale, softcap, together=False)
    assert decoded.dtype == dtype
    queries, keys = int8_key_queries(q, scale), dequantize_kv(kq, torch.float64)
    exact = run_reference(queries, keys, dequantize_kv(vq, torch.float64), window, 1.0, softcap)
    bound = int8_value_bound(reference_probs(queries, keys, window, 1.0, softcap), vq)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else BF16_TOL
    error = (whole.double() - exact).abs()
    assert (error <= bound + tol["atol"] + tol["rtol"] * exact.abs()).all(), (error - bound).max()
    assert bound.max() < 1e-3  # the weights' rounding costs little next to the values' own
    assert torch.equal(decoded, whole)
    for chunk_lens, together in (([64] * 4 + [44], False), ([7, 100, 1, 128, 64], True), ([1] * 5 + [295], False)):
        assert torch.equal(prefill_in_chunks(q, kq, vq, kv, slots, chunk_lens, window, scale, softcap, together),
                           whole)


def test_int8_rows_are_close_to_the_full_precision_cache() -> None:
    """What int8 costs: attention over the int8 cache against attention over the bf16 rows it quantized."""
    q, k, v, kv, table, slots = sequence_case(500, 9, 3, 64, torch.bfloat16, 16, seed=11)
    kq, vq = quantize_kv(k), quantize_kv(v)
    scale = 64 ** -0.5
    full = decode_every_position(q, k, v, table, 16, 0, scale, 0.0).double()
    int8 = decode_every_position(q, kq, vq, table, 16, 0, scale, 0.0).double()
    error = (int8 - full).abs()
    assert error.max() < 0.05 and error.mean() < 0.005, (error.max(), error.mean())


def test_int8_cache_checks_its_rows() -> None:
    q = torch.randn(1, 4, 64)
    kv = torch.zeros(2, 32, 2, 64, dtype=torch.uint8)  # no room for the scales
    with pytest.raises(RuntimeError, match="int8 rows of 64 values and a 4-byte scale"):
        cpu_paged_attention().paged_decode_attention(q, kv, torch.zeros(1, 2, dtype=torch.long),
                                                     torch.tensor([3]), None, 0, 16, 0.125, 0.0)
