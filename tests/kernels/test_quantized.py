"""Quantized weights: GGUF block tensors and our int8/int4 through the native kernels equal a
dequantized reference, and the quantizers' errors stay within their formats' bounds."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_flags, cpu_matmul_ops
from conveyor.layers.quantization import linear as quantized_linear
from conveyor.layers.quantization.linear import (
    BF16_KERNEL_MAX_ROWS,
    QuantEmbedding,
    QuantLinear,
    QuantMatmul,
    bf16_kernel_max_rows,
    matmul_ops,
    merge_segments,
)
from conveyor.layers.quantization.tensors import (
    BF16,
    F32,
    I8,
    FileRegion,
    GGMLType,
    QuantizedTensor,
    bf16_rows,
    cat_rows,
    f32_rows,
    quantize_int4,
    quantize_int8,
)
from tests.gguf_writer import RANDOM_BLOCK_SCALES, random_blocks

GGUF_TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K,
              GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4]


@pytest.fixture(scope="module")
def ops():
    built = cpu_matmul_ops()
    assert built is not None, "the matmul kernels should build on this machine"
    return built


def gguf_tensor(qtype: int, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """A tensor as a GGUF file holds it: gguf's own quantizer where it has one; for the others (the
    K-quants and IQ4 types, which gguf cannot quantize) random blocks with sane fp16 scales, every other
    byte random."""
    if qtype in RANDOM_BLOCK_SCALES:
        data = random_blocks(GGMLType(qtype), rows, cols, seed)
    else:
        rng = np.random.default_rng(seed)
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLType(qtype))
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(data)), int(qtype), (rows, cols))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernels' activation quantization (int8 blocks of 32, scale amax / 127, values times the
    scale's fp32 reciprocal, rounded half to even), dequantized: the same fp32 operations, so the
    same int8 values (dividing by the scale instead rounds a few values of 600 rows the other way)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def assert_close_scaled(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = ref.abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} over {rel:g} x {scale:.3g}"


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: GGMLType(t).name)
def test_dequantize_equals_gguf(ops, qtype: int) -> None:
    """The kernels' dequantization of the tiled layout is gguf's own, bit for bit (the K-quants' scales
    unpacked at repacking, their values regrouped), and so is the tensor's `dequantize` in either layout."""
    w = gguf_tensor(qtype, 37, 512)
    ref = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), GGMLType(qtype))).reshape(w.shape)
    assert torch.equal(w.dequantize(), ref)
    kernel_w = w.tiled(ops)
    assert kernel_w.layout == "tiles"
    ids = torch.tensor([0, 36, 5, 5, 17])
    out = torch.empty(len(ids), 512)
    ops.dequantize_rows(kernel_w.data, w.qtype, torch.empty(0), ids, 37, out)
    assert torch.equal(out, ref[ids])
    assert torch.equal(kernel_w.dequantize(), ref)
    whole = torch.empty(37, 512)  # the whole-matrix (vectorized) dequantization of the AMX CPUs' prefill path
    ops.dequantize_matrix(kernel_w.data, w.qtype, torch.empty(0), whole)
    assert torch.equal(whole, ref)
    halves = torch.empty(37, 512, dtype=torch.bfloat16)
    ops.dequantize_matrix(kernel_w.data, w.qtype, torch.empty(0), halves)
    assert torch.equal(halves, ref.bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        ops.dequantize_rows(kernel_w.data, w.qtype, torch.empty(0), torch.tensor([37]), 37, out[:1])


def test_mxfp4_every_exponent_fp16_holds(ops) -> None:
    """MXFP4 blocks with every e8m0 exponent whose scale 2^(e - 128) an fp16 holds (2^-24, subnormal, to 2^15)
    and random nibbles: the tiles dequantize to gguf's values bit for bit."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(40, 16, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(104, 144, size=(40, 16))
    raw[0, :, 0] = np.arange(104, 120)  # the subnormal scales and the smallest normal ones, in one row
    w = QuantizedTensor(torch.from_numpy(raw.reshape(40, -1)), int(GGMLType.MXFP4), (40, 512))
    ref = torch.from_numpy(gguf.quants.dequantize(raw.reshape(40, -1), GGMLType.MXFP4)).reshape(40, 512)
    assert torch.equal(w.tiled(ops).dequantize(), ref)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 67, 600])
@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: GGMLType(t).name)
def test_gguf_matmul_matches_dequantized_reference(ops, qtype: int, rows: int) -> None:
    """Against gguf's dequantized weights times the kernel's quantized activations: fp32 rounding
    only; against the unquantized activations: within the activation quantization's error."""
    torch.manual_seed(rows)
    cols = 512  # two K-quant super-blocks, 16 blocks of 32
    w = gguf_tensor(qtype, 45, cols, seed=rows)  # 45 output rows: not a multiple of the thread grain
    ref_w = w.dequantize()
    x = torch.randn(rows, cols)
    out = torch.empty(rows, 45)
    kw = w.tiled(ops)
    ops.quant_matmul(x, kw.data, w.qtype, torch.empty(0), None, out)
    assert_close_scaled(out, quantize_activations(x) @ ref_w.T, 2e-6)
    assert_close_scaled(out, x @ ref_w.T, 2e-2)  # int8 activations: ~1/127 of each block's largest value
    xb = x.bfloat16()  # bf16 rows are widened before they are quantized
    ops.quant_matmul(xb, kw.data, w.qtype, torch.empty(0), None, out)
    assert_close_scaled(out, quantize_activations(xb) @ ref_w.T, 2e-6)


def test_bias_bf16_and_column_slices(ops) -> None:
    """bf16 inputs and outputs, a bias, and an output that is a column slice of a wider tensor."""
    w = gguf_tensor(GGMLType.Q4_1, 40, 256)
    x = torch.randn(3, 256).bfloat16()
    bias = torch.randn(40)
    wide = torch.zeros(3, 100, dtype=torch.bfloat16)
    ops.quant_matmul(x, w.tiled(ops).data, w.qtype, torch.empty(0), bias, wide[:, 30:70])
    ref = quantize_activations(x) @ w.dequantize().T + bias
    assert_close_scaled(wide[:, 30:70], ref, 1e-2)  # bf16 output rounding
    assert wide[:, :30].abs().sum() == 0 and wide[:, 70:].abs().sum() == 0


@pytest.mark.parametrize("cols", [64, 96, 576])
def test_int8_per_channel(ops, cols: int) -> None:
    torch.manual_seed(cols)
    weight = torch.randn(33, cols) * torch.linspace(0.1, 3, 33).unsqueeze(1)  # rows of very different scales
    q = quantize_int8(weight)
    assert q.qtype == I8 and q.row_scales.shape == (33,)
    deq = q.dequantize()
    assert ((deq - weight).abs() <= q.row_scales.unsqueeze(1) / 2 + 1e-6).all()  # half a step per element
    x = torch.randn(4, cols)
    out = torch.empty(4, 33)
    kq = q.tiled(ops)
    assert kq.row_scales.shape == (48,)  # padded to whole tiles
    ops.quant_matmul(x, kq.data, q.qtype, kq.row_scales, None, out)
    torch.testing.assert_close(kq.dequantize(), deq)
    assert_close_scaled(out, quantize_activations(x) @ deq.T, 2e-6)


@pytest.mark.parametrize("cols", [32, 160, 576])
def test_int4_groups_of_32(ops, cols: int) -> None:
    torch.manual_seed(cols)
    weight = torch.randn(20, cols)
    q = quantize_int4(weight)
    assert q.qtype == GGMLType.Q4_1
    deq = q.dequantize()  # through gguf's own Q4_1 dequantization: the layout is GGUF's
    groups = weight.reshape(20, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (deq - weight).reshape(20, -1, 32).abs().amax(-1)
    assert (err <= step * 0.5 + step * 2e-3 + 1e-4).all()  # half a step, plus the fp16 rounding of scale and min
    x = torch.randn(2, cols)
    out = torch.empty(2, 20)
    ops.quant_matmul(x, q.tiled(ops).data, q.qtype, torch.empty(0), None, out)
    assert_close_scaled(out, quantize_activations(x) @ deq.T, 2e-6)
    with pytest.raises(ValueError, match="groups are 32"):
        quantize_int4(torch.randn(4, 40))


def test_quant_matmul_mixed_segments_and_dequantize_path() -> None:
    """A fused projection of several types (as K-quant files mix them): kernel rows and prefill-sized
    inputs (dequantize + F.linear) agree with the dequantized weights."""
    parts = [gguf_tensor(GGMLType.Q4_K, 24, 256, 1), gguf_tensor(GGMLType.Q4_K, 8, 256, 2),
             gguf_tensor(GGMLType.Q6_K, 8, 256, 3), gguf_tensor(GGMLType.Q5_K, 16, 256, 4)]
    assert [s.shape[0] for s in merge_segments(parts)] == [32, 8, 16]
    bias = torch.randn(56)
    matmul = QuantMatmul(parts, bias)
    # The dequantize path takes big bf16 inputs on AMX CPUs only (`bf16_kernel_max_rows`): force it here.
    assert matmul.bf16_max_rows == bf16_kernel_max_rows()
    matmul.bf16_max_rows = BF16_KERNEL_MAX_ROWS
    ref_w = torch.cat([p.dequantize() for p in parts])
    for dtype, rows in ((torch.float32, 1), (torch.float32, 90), (torch.bfloat16, 7),
                        (torch.bfloat16, BF16_KERNEL_MAX_ROWS + 5)):
        x = torch.randn(rows, 256).to(dtype)
        out = matmul(x)
        assert out.shape == (rows, 56) and out.dtype == dtype
        kernel = matmul.takes_kernel(rows, dtype)  # else no activation quantization
        assert kernel == (dtype == torch.float32 or rows <= BF16_KERNEL_MAX_ROWS)
        ref = F.linear(quantize_activations(x) if kernel else x.float(), ref_w, bias)
        assert_close_scaled(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


def test_dequantize_path_goes_in_chunks_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight bigger than `SCRATCH_BYTES` is dequantized and multiplied a chunk of rows at a time into one
    buffer: the same outputs as the whole matrix at once, a last chunk that ends inside a tile and
    our int8's per-row scales included."""
    if cpu_matmul_ops() is None:
        pytest.skip("the chunks are the native dequantization's")
    parts = [quantize_int8(torch.randn(40, 64)), gguf_tensor(GGMLType.Q4_0, 53, 64, 5)]
    bias = torch.randn(93)
    x = torch.randn(BF16_KERNEL_MAX_ROWS + 3, 64).bfloat16()
    matmuls = []
    for scratch in (1 << 30, 16 * 64 * 2):  # the whole matrix; one tile's rows a chunk
        monkeypatch.setattr(quantized_linear, "SCRATCH_BYTES", scratch)
        monkeypatch.setattr(quantized_linear, "SCRATCH", quantized_linear._Scratch())
        matmul = QuantMatmul(parts, bias)
        matmul.bf16_max_rows = BF16_KERNEL_MAX_ROWS  # the dequantize path on any CPU
        matmuls.append(matmul(x))
        assert [b.numel() for b in quantized_linear.SCRATCH.buffers.values()] == [min(53, scratch // 128) * 64]
    assert torch.equal(matmuls[0], matmuls[1])
    ref = F.linear(x.float(), torch.cat([p.dequantize() for p in parts]), bias)
    assert_close_scaled(matmuls[1], ref, 1e-2)


def test_quant_linear_computes_with_the_loaded_bias() -> None:
    """The models' loader assigns the checkpoint's tensors (load_state_dict with assign=True), which replaces
    the bias Parameter: the kernel must add the loaded bias, not the zeros it was built with."""
    weight = quantize_int8(torch.randn(16, 64))
    linear = QuantLinear([weight], bias=True, dtype=torch.float32)
    bias = torch.randn(16)
    linear.load_state_dict({"bias": bias}, assign=True)
    assert linear.bias is not None and torch.equal(linear.bias, bias)
    x = torch.randn(3, 64)
    assert_close_scaled(linear(x), F.linear(quantize_activations(x), weight.dequantize(), bias), 1e-5)


def test_bf16_kernel_rows_follow_the_cpu() -> None:
    """Big bf16 inputs leave the int8 kernel only where oneDNN's bf16 matmul has AMX tiles to run on."""
    limit = bf16_kernel_max_rows()
    assert limit == (BF16_KERNEL_MAX_ROWS if "amx_bf16" in cpu_flags() else None)
    if matmul_ops() is not None:
        matmul = QuantMatmul([quantize_int4(torch.randn(32, 64))])
        assert matmul.takes_kernel(4096, torch.float32)
        assert matmul.takes_kernel(4096, torch.bfloat16) == (limit is None)
        dense = QuantMatmul([bf16_rows(torch.randn(32, 64))])  # dense bf16 tiles: the same rule
        assert dense.takes_kernel(4096, torch.bfloat16) == (limit is None)
        # so does every GGUF type (a block row's values dequantized in vector registers), and a fused projection
        # that mixes them
        for qtype in GGUF_TYPES:
            assert QuantMatmul([gguf_tensor(qtype, 32, 256)]).takes_kernel(4096, torch.bfloat16) == (limit is None)
        fused = [gguf_tensor(GGMLType.Q8_0, 32, 256), gguf_tensor(GGMLType.Q3_K, 16, 256)]
        assert QuantMatmul(fused).takes_kernel(4096, torch.bfloat16) == (limit is None)
        # their bf16 inputs as pairs for vdpbf16ps where it runs at the FMA's rate: AMD's avx512_bf16
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
        if matmul_ops().isa() == "avx512-vnni+avx512-bf16":
            assert matmul_ops().bf16_pair_products() == amd


def test_quant_embedding_rows() -> None:
    table = gguf_tensor(GGMLType.Q8_0, 50, 64)
    ids = torch.tensor([[3, 0], [49, 3]])
    out = QuantEmbedding(table, torch.bfloat16)(ids)
    assert out.shape == (2, 2, 64) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, table.dequantize()[ids].bfloat16())


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K])
def test_quant_embedding_reads_a_files_rows(tmp_path: Path, qtype: int) -> None:
    """An untied table of a file is read from the file row by row (never mapped): the same rows as the
    dequantized table; an id outside it is an error naming the range; a file cut short, one naming that."""
    table = gguf_tensor(qtype, 40, 256)
    path = tmp_path / "table.bin"
    path.write_bytes(b"x" * 100 + table.data.numpy().tobytes())
    source = FileRegion(str(path), 100)
    embedding = QuantEmbedding(QuantizedTensor(table.data, qtype, (40, 256), source=source), torch.bfloat16,
                               tiled=False)
    ids = torch.tensor([[39, 0, 7], [7, 21, 39]])
    out = embedding(ids)
    torch.testing.assert_close(out, table.dequantize()[ids].bfloat16(), rtol=0, atol=0)
    if matmul_ops() is None:
        return
    assert embedding.file is not None and embedding.weight.layout == "rows"
    with pytest.raises(RuntimeError, match=r"row index 40 out of range \[0, 40\)"):
        embedding(torch.tensor([3, 40]))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(RuntimeError, match="the file ends first"):
        embedding(torch.tensor([39]))
    tied = QuantEmbedding(QuantizedTensor(table.data, qtype, (40, 256), source=source), torch.bfloat16)
    assert tied.file is None and tied.weight.layout == "tiles"  # a tied head's tiles, shared


def test_row_operations() -> None:
    a, b = gguf_tensor(GGMLType.Q4_0, 6, 64), gguf_tensor(GGMLType.Q4_0, 3, 64, 1)
    both = cat_rows([a, b])
    assert both.shape == (9, 64)
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    perm = torch.tensor([2, 0, 1, 5, 4, 3])
    torch.testing.assert_close(a.index_rows(perm).dequantize(), a.dequantize()[perm])
    with pytest.raises(ValueError, match="cannot concatenate"):
        cat_rows([a, gguf_tensor(GGMLType.Q8_0, 2, 64)])
    with pytest.raises(ValueError, match="multiples of 256"):
        QuantizedTensor(torch.zeros(2, 144, dtype=torch.uint8), int(GGMLType.Q4_K), (2, 128))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 code paths")
def test_avx2_path() -> None:
    """The kernels' AVX2 path (AVX2 without VNNI, as on the AVX2-only machines; this CPU may have
    more) passes the tests above, built for that target with `CONVEYOR_MARCH`. (The plain C++ path,
    `CONVEYOR_MARCH=x86-64`, passes them too; not run here, to keep the suite's build time down.)"""
    march = "haswell"
    env = dict(os.environ, CONVEYOR_MARCH=march)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", __file__], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = subprocess.run([sys.executable, "-c", "from conveyor.kernels import cpu_matmul_ops as o; print(o().isa())"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.split()[-1] == "avx2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 67, 600])
def test_bf16_tiles_matmul(ops, dtype: torch.dtype, rows: int) -> None:
    """Dense bf16 weights in the kernels' tiles: the matmul equals F.linear in fp32 over the same bf16
    weights (bf16 x fp32 products are exact; only the summation order differs), the bias added, the
    output in the input's dtype; the tiles give the weights back exactly."""
    torch.manual_seed(rows)
    for cols in (64, 100, 576):  # 100: not a multiple of the vector width
        weight, bias = torch.randn(37, cols).bfloat16(), torch.randn(37)
        tiles = bf16_rows(weight).tiled(ops)
        assert tiles.layout == "tiles" and torch.equal(tiles.dequantize(torch.bfloat16), weight)
        x = torch.randn(rows, cols).to(dtype)
        out = QuantMatmul([bf16_rows(weight)], bias)(x)
        assert out.dtype == dtype and out.shape == (rows, 37)
        assert_close_scaled(out, F.linear(x.float(), weight.float(), bias), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("rows", [1, 12, 13, 67, 200])
def test_bf16_tiles_over_bf16_inputs_are_exact_products(ops, rows: int) -> None:
    """bf16 inputs into bf16 tiles, fp32 out, whatever the kernel's path (on AMD's avx512_bf16, vdpbf16ps
    over pairs of inputs, interleaved from two rows of a tile; elsewhere the widened weights' FMAs):
    every product is exact, so only the summation order separates it from F.linear in fp64, for even
    and odd input widths (an odd one takes the FMAs) and every group of rows, the last one partial."""
    torch.manual_seed(rows)
    for cols in (64, 100, 99, 2048):
        weight, x = torch.randn(45, cols).bfloat16(), torch.randn(rows, cols).bfloat16()
        tiles = bf16_rows(weight).tiled(ops)
        out = torch.empty(rows, 45)
        ops.quant_matmul(x, tiles.data, BF16, torch.empty(0), None, out)
        expected = F.linear(x.double(), weight.double())
        scale = F.linear(x.double().abs(), weight.double().abs())  # the sum of |products| bounds the rounding
        assert ((out.double() - expected).abs() <= 2 * cols * 2.0 ** -24 * scale + 1e-30).all(), cols


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 67])
def test_f32_tiles_matmul(ops, rows: int) -> None:
    """Dense fp32 weights in the kernels' tiles (a mixture-of-experts model's fp32 experts): F.linear's
    values up to the summation order; the tiles give the weights back exactly, row by row and whole."""
    torch.manual_seed(rows)
    for cols in (64, 100, 576):
        weight = torch.randn(37, cols)
        tiles = f32_rows(weight).tiled(ops)
        assert tiles.layout == "tiles" and tiles.qtype == F32 and torch.equal(tiles.dequantize(), weight)
        whole = torch.empty(37, cols)
        ops.dequantize_matrix(tiles.data, F32, tiles.row_scales_or_empty(), whole)
        assert torch.equal(whole, weight)
        x = torch.randn(rows, cols)
        assert_close_scaled(QuantMatmul([f32_rows(weight)])(x), F.linear(x, weight), 1e-5)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, I8, BF16])
@pytest.mark.parametrize("rows,out_rows", [(1, 45), (13, 1040), (64, 2063), (256, 1040)])
def test_fused_argmax_equals_argmax_of_the_matmul(ops, qtype: int, rows: int, out_rows: int) -> None:
    """The LM head fused with greedy sampling (`quant_argmax`) picks the same index as torch.argmax of
    the same kernel's outputs, ties to the first, whatever the thread split (2063 rows: 129 tiles, more
    than one 64-tile chunk, a partial last tile; 256 rows: chunks of 16 tiles)."""
    torch.manual_seed(rows)
    if qtype == I8:
        w = quantize_int8(torch.randn(out_rows, 96))
    elif qtype == BF16:
        w = bf16_rows(torch.randn(out_rows, 96))
    else:
        w = gguf_tensor(qtype, out_rows, 96, seed=rows)
    matmul = QuantMatmul([w], out_dtype=torch.float32)
    x = torch.randn(rows, 96)
    x[0] = 0  # every output 0 in row 0: a tie across the whole vocabulary -> index 0
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(matmul.argmax(x), matmul(x).argmax(dim=-1)), n
    finally:
        torch.set_num_threads(threads)
    fused = matmul.argmax(x.bfloat16())  # fused where the kernel takes this many bf16 rows (`bf16_kernel_max_rows`)
    assert (fused.shape == (rows,)) if matmul.takes_kernel(rows, torch.bfloat16) else (fused is None)
    with_bias = QuantMatmul([w], bias=torch.zeros(out_rows))
    assert with_bias.argmax(x) is None  # not fused: the kernel takes no bias


def test_wide_output_streams_the_same_values(ops) -> None:
    """An fp32 output of 8 MiB or more (the LM head's logits at many rows) is written with non-temporal
    stores where its tiles are whole and aligned: the same values as an output that is not streamed (rows
    not 16 floats apart), the partial last tile included."""
    w = gguf_tensor(GGMLType.Q8_0, 33_000, 64, seed=3)  # 2,063 tiles, the last one half full
    kw = w.tiled(ops)
    x = torch.randn(64, 64)
    out = torch.empty(64, 33_008)[:, :33_000]  # rows 16-float aligned: 8.4 MB streamed
    assert out.data_ptr() % 64 == 0 and out.numel() * 4 >= 8 << 20
    plain = torch.empty(64, 33_001)[:, :33_000]
    for dst in (out, plain):
        ops.quant_matmul(x, kw.data, w.qtype, torch.empty(0), None, dst)
    assert torch.equal(out, plain)
    assert_close_scaled(out[:, -100:], quantize_activations(x) @ w.dequantize()[-100:].T, 2e-6)
