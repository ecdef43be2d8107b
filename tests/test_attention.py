"""Attention backends agree with each other and with plain attention over a contiguous context."""

from __future__ import annotations

import pytest
import torch

from conveyor.attention import (AttentionMetadata, CpuPagedAttention, TorchPagedAttention, cache_slots,
                                make_attention_backend)
from conveyor.kernels import cpu_paged_attention

from .conftest import TinyModel, random_prompts


def random_decode_batch(page_size: int, heads: int, kv_heads: int, seed: int = 0, dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    num_chunks = 64
    kv = torch.randn(2, num_chunks * page_size, kv_heads, dim, generator=g)
    lens = torch.tensor([1, page_size, page_size + 1, 3 * page_size - 1, 5])
    width = int((lens.max() + page_size - 1) // page_size)
    tables = torch.stack([torch.randperm(num_chunks - 2, generator=g)[:width] + 2 for _ in lens])
    tables[0, 1:] = 0  # padding entries point at the reserved chunk
    q = torch.randn(len(lens), heads, dim, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), page_size=page_size,
                             num_decodes=len(lens), decode_block_tables=tables, decode_context_lens=lens)
    return q, kv, meta


def reference_decode(q, kv, meta, scale, softcap=None):
    """Each request's context gathered contiguously, plain softmax attention (scores soft-capped if asked)."""
    out = []
    group = q.shape[1] // kv.shape[2]
    for b, n in enumerate(meta.decode_context_lens.tolist()):
        slots = cache_slots(meta.decode_block_tables[b], meta.page_size)[:n]
        k = kv[0][slots].repeat_interleave(group, dim=1)  # [n, H, D]
        v = kv[1][slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out)


def test_native_cpu_kernel_builds() -> None:
    assert cpu_paged_attention() is not None, "the CPU attention kernel should build on this machine"
    assert isinstance(make_attention_backend(torch.device("cpu"), torch.float32), CpuPagedAttention)
    assert type(make_attention_backend(torch.device("cpu"), torch.bfloat16)) is TorchPagedAttention


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize(("page_size", "heads", "kv_heads", "dim"),
                         [(4, 4, 2, 32), (16, 9, 3, 64), (8, 4, 4, 80), (4, 2, 1, 12)])  # 12: the kernel's scalar path
def test_decode_backends_match_reference(page_size: int, heads: int, kv_heads: int, dim: int,
                                         softcap: float | None) -> None:
    q, kv, meta = random_decode_batch(page_size, heads, kv_heads, dim=dim)
    scale = q.shape[-1] ** -0.5
    expected = reference_decode(q, kv, meta, scale, softcap)
    if softcap is not None:  # the cap changes the result: the check below can fail
        assert not torch.allclose(expected, reference_decode(q, kv, meta, scale), atol=1e-3)
    for backend in (TorchPagedAttention(), CpuPagedAttention(cpu_paged_attention())):
        backend.prepare(meta)
        torch.testing.assert_close(backend._decode(q, kv, meta, scale, softcap), expected, atol=1e-5, rtol=1e-5)


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
