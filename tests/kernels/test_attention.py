"""Attention backends agree with each other and with plain attention over a contiguous context."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from conveyor.kernels import cpu_flags, cpu_paged_attention
from conveyor.layers.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    PrefillSpan,
    TorchPagedAttention,
    cache_slots,
    make_attention_backend,
)

from tests.attention_utils import BF16_TOL, reference_decode, reference_prefill, run_prefill
from tests.utils import TinyModel, random_prompts


def random_decode_batch(page_size: int, heads: int, kv_heads: int, seed: int = 0, dim: int = 32,
                        dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    num_chunks = 64
    kv = torch.randn(2, num_chunks * page_size, kv_heads, dim, generator=g).to(dtype)
    lens = torch.tensor([1, page_size, page_size + 1, 3 * page_size - 1, 5])
    width = int((lens.max() + page_size - 1) // page_size)
    tables = torch.stack([torch.randperm(num_chunks - 2, generator=g)[:width] + 2 for _ in lens])
    tables[0, 1:] = 0  # padding entries point at the reserved chunk
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), page_size=page_size,
                             num_decodes=len(lens), decode_block_tables=tables, decode_context_lens=lens)
    return q, kv, meta


def test_native_cpu_kernel_builds() -> None:
    assert cpu_paged_attention() is not None, "the CPU attention kernel should build on this machine"
    for dtype in (torch.float32, torch.bfloat16):
        backend = make_attention_backend(torch.device("cpu"), dtype)
        assert isinstance(backend, CpuPagedAttention)
    assert type(make_attention_backend(torch.device("cpu"), torch.float16)) is TorchPagedAttention
    if "CONVEYOR_MARCH" not in os.environ:  # built for this CPU: AVX-512 where it has it
        assert cpu_paged_attention().prefill_vector_width() == (16 if "avx512f" in cpu_flags() else 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize(("page_size", "heads", "kv_heads", "dim"),
                         [(4, 4, 2, 32), (16, 9, 3, 64), (8, 4, 4, 80), (4, 2, 1, 12)])  # 12: the kernel's scalar path
def test_decode_backends_match_reference(page_size: int, heads: int, kv_heads: int, dim: int,
                                         softcap: float | None, dtype: torch.dtype) -> None:
    q, kv, meta = random_decode_batch(page_size, heads, kv_heads, dim=dim, dtype=dtype)
    scale = q.shape[-1] ** -0.5
    expected = reference_decode(q, kv, meta, scale, softcap)
    if softcap is not None:  # the cap changes the result: the check below can fail
        assert not torch.allclose(expected, reference_decode(q, kv, meta, scale), atol=1e-3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    for backend in (TorchPagedAttention(), CpuPagedAttention(cpu_paged_attention())):
        backend.prepare(meta)
        out = backend._decode(q, kv, meta, scale, softcap)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunks", "window", "softcap", "dtype"), [
    (9, 3, 64, [(70, 200)], 0, 0.0, torch.float32),  # SmolLM2's heads, causal chunk after a context
    (4, 2, 12, [(37, 5), (3, 0), (70, 130)], 0, 0.0, torch.float32),  # several chunks, one without context
    (4, 4, 80, [(100, 17)], 8, 0.0, torch.float32),  # a window shorter than the chunk
    (6, 2, 33, [(100, 50)], 20, 3.0, torch.float32),  # odd head dim, window and soft-capping
    (2, 1, 128, [(130, 100), (5, 7)], 64, 0.5, torch.float32),
    (24, 2, 16, [(9, 300)], 0, 0.0, torch.float32),  # 12 query heads per kv head
    (9, 3, 64, [(70, 200)], 0, 0.0, torch.bfloat16),
    (6, 2, 33, [(40, 50)], 20, 3.0, torch.bfloat16),
])
def test_prefill_kernel_matches_reference(heads: int, kv_heads: int, dim: int, chunks: list[tuple[int, int]],
                                          window: int, softcap: float, dtype: torch.dtype) -> None:
    out, expected = run_prefill(heads, kv_heads, dim, chunks, window, softcap, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out, expected, **tol)


def test_prefill_kernel_takes_keys_and_values_with_different_strides() -> None:
    out, expected = run_prefill(4, 2, 32, [(20, 9)], 0, 0.0, torch.float32, contiguous_k=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def sliding_prefill_batch(dtype: torch.dtype):
    """One decode row and one prefill chunk of a sliding layer (window 8, pages of 4: a ring of two pages), laid
    out as the runner does: the chunk (positions 10-15) reads positions 3-9 from the ring, and its own tokens
    land on ring slots that hold positions 3-7, so a kernel that read the ring after the write would be wrong."""
    g = torch.Generator().manual_seed(1)
    page, window, heads, kv_heads, dim = 4, 8, 4, 2, 16
    kv = torch.randn(2, 16 * page, kv_heads, dim, generator=g).to(dtype)
    ring = torch.tensor([5, 9])
    key_pos = torch.arange(3, 16)
    slots = cache_slots(ring, page)[key_pos % window]
    q_pos = key_pos[7:].unsqueeze(1)
    span = PrefillSpan(q_start=1, q_len=6, ctx_slots=slots[:7], mask=(key_pos <= q_pos) & (key_pos > q_pos - window),
                       start=10)
    decode_table = torch.tensor([[3, 4]])
    meta = AttentionMetadata(slot_mapping=torch.cat([torch.tensor([4 * page + 2]), slots[7:]]), page_size=page,
                             num_decodes=1, decode_block_tables=decode_table, decode_context_lens=torch.tensor([7]),
                             decode_positions=torch.tensor([6]), prefills=[span], window=window)
    q = torch.randn(7, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(7, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kv, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_on_a_sliding_ring_prefill(dtype: torch.dtype) -> None:
    q, k, v, kv, meta = sliding_prefill_batch(dtype)
    span = meta.prefills[0]
    expected = reference_prefill(q, k, v, kv, [(span.q_start, span.q_len, span.ctx_slots)], meta.window, 0.25, 0.0)
    written = kv.clone()
    written[:, meta.slot_mapping] = torch.stack([k, v])
    overwritten = reference_prefill(q, k, v, written, [(span.q_start, span.q_len, span.ctx_slots)], meta.window, 0.25,
                                    0.0)
    assert not torch.allclose(expected[1:], overwritten[1:], atol=1e-2)  # reading after the write would show
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    outs = []
    kernel = cpu_paged_attention()
    for backend in (TorchPagedAttention(), CpuPagedAttention(kernel)):
        cache = kv.clone()
        backend.prepare(meta)
        out = backend.forward(q, k, v, cache, meta, 0.25)
        torch.testing.assert_close(out[1:].double(), expected[1:], check_dtype=False, **tol)
        assert torch.equal(cache, written)  # both wrote the new K/V
        outs.append(out)
    for out in outs[1:]:  # the decode row, after the write
        torch.testing.assert_close(out[:1].float(), outs[0][:1].float(), **tol)


def test_pure_pytorch_backend_end_to_end(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts([9, 30, 4], seed=30)
    from conveyor import SamplingParams

    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    native = tiny_llama.llm(page_size=4, max_batch_tokens=16)
    assert isinstance(native.engine.runner.attention, CpuPagedAttention)
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    pure = tiny_llama.llm(page_size=4, max_batch_tokens=16)
    assert type(pure.engine.runner.attention) is TorchPagedAttention
    assert [o.token_ids for o in pure.generate(prompts, params, use_tqdm=False)] == \
        [o.token_ids for o in native.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 code paths")
def test_avx2_path() -> None:
    """The kernels built for an AVX2-only CPU (`CONVEYOR_MARCH=haswell`: 8-wide vectors, 16 registers) pass the
    kernel tests above, test_cpu_attention_kernels.py's, test_int8_kv.py's and test_sampler.py's. (The plain C++ build,
    `CONVEYOR_MARCH=x86-64`, passes them too; not run here, to keep the suite's build time down.)"""
    env = dict(os.environ, CONVEYOR_MARCH="haswell")
    probe = subprocess.run([sys.executable, "-c", "from conveyor.kernels import cpu_paged_attention as k; "
                            "print(k().prefill_vector_width())"], env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.split()[-1] == "8", probe.stderr[-3000:]
    here = os.path.dirname(__file__)
    kernel_tests = [os.path.join(here, name) for name in ("test_cpu_attention_kernels.py", "test_int8_kv.py",
                                                          "test_sampler.py")]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-k", "not end_to_end", __file__,
                             *kernel_tests],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
