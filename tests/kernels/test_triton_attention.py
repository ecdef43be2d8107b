"""The Triton paged-attention kernel and `attention_backend`: random ragged batches against
`TorchPagedAttention`, greedy ids against the PyTorch backend and transformers, the config errors.

Without CUDA the kernel runs on CPU tensors under Triton's interpreter, which has to be switched on
before the kernel module is imported (its `@triton.jit` decides then); with CUDA the compiled kernel
runs, in the `cuda`-marked tests, and the interpreter tests are skipped.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.cache.kv_format import as_bytes, to_fp8
from conveyor.config import ConfigError
from conveyor.kernels import triton_attention
from conveyor.layers import attention
from conveyor.layers.attention import (
    CpuPagedAttention,
    TorchPagedAttention,
    TritonPagedAttention,
    make_attention_backend,
)

from tests.attention_utils import BF16_TOL, interpreter_only, ragged_metadata  # noqa: E402
from tests.utils import (TinyModel, all_free, assert_greedy_match, greedy_ids, hf_greedy,  # noqa: E402
                         next_token_logprobs, random_prompts)

INTERPRETED = triton_attention.INTERPRETED
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (compiled Triton)")
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def run_backends(specs: list[tuple[int, int]], page_size: int, heads: int, kv_heads: int, dim: int,
                 window: int | None, softcap: float | None, dtype: torch.dtype, device: torch.device = CPU,
                 seed: int = 0, cache_dtype: torch.dtype | None = None) -> None:
    """Triton and PyTorch on one random batch: same outputs, same cache afterwards. `cache_dtype`: an fp8
    cache (its pages and the batch's new K/V as it stores them, widened by both)."""
    num_chunks = 96
    g = torch.Generator().manual_seed(seed)
    total = sum(n for n, _ in specs)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(device)
    q, k, v = (x.view(total, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    cache = torch.randn(2, num_chunks * page_size, kv_heads, dim, generator=g).to(dtype).to(device)
    if cache_dtype is not None:
        cache = to_fp8(cache, cache_dtype)
    outputs, caches = [], []
    for backend in (TorchPagedAttention(), TritonPagedAttention()):
        meta = ragged_metadata(specs, page_size, window, num_chunks, seed, device)
        backend.prepare(meta)
        kv = cache.clone()
        outputs.append(backend.forward(q, k, v, kv, meta, dim ** -0.5, softcap))
        caches.append(kv)
    ref, out = outputs
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # The reserved first chunk is excluded: a prefill longer than its window sends the keys that fall out of
    # the ring to slot 0, several writes to one slot, whose winner CUDA does not fix.
    assert torch.equal(as_bytes(caches[0][:, page_size:]), as_bytes(caches[1][:, page_size:]))


# (q_len, pos) per sequence, decodes first: page boundaries, contexts past one key block (64), chunks
# longer than the window, chunks without context.
MIXED = [(1, 0), (1, 3), (1, 4), (1, 70), (5, 0), (9, 7), (20, 64)]
SLIDING = [(1, 2), (1, 7), (1, 8), (1, 30), (6, 0), (3, 5), (12, 20), (17, 80)]
CASES = {
    "full": (MIXED, 4, 4, 2, 32, None, None),
    "window": (SLIDING, 4, 4, 2, 32, 8, None),
    "window-not-page-multiple-softcap-gqa3": (SLIDING, 4, 6, 2, 24, 6, 2.0),
    "smollm2-heads-decodes": ([(1, 0), (1, 15), (1, 16), (1, 100)], 16, 9, 3, 64, None, None),
    "mha-prefills": ([(40, 0), (7, 33)], 8, 2, 2, 16, None, 0.5),
    "one-kv-head-big-page": ([(1, 5), (30, 31)], 256, 8, 1, 16, 20, None),
}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_backend(case: str, dtype: torch.dtype) -> None:
    run_backends(*CASES[case], dtype=dtype)


@interpreter_only
def test_kernel_fp16_and_small_key_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 inputs; 16-key blocks so every sequence's loops take several steps."""
    monkeypatch.setattr(triton_attention, "BLOCK_N", 16)
    specs, page, heads, kv_heads, dim, window, softcap = CASES["window-not-page-multiple-softcap-gqa3"]
    run_backends(specs, page, heads, kv_heads, dim, window, softcap, torch.float16)
    run_backends(*CASES["full"], dtype=torch.float32)
    run_backends(*CASES["mha-prefills"], dtype=torch.bfloat16)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@interpreter_only
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["full", "window-not-page-multiple-softcap-gqa3"])
def test_kernel_reads_fp8_pages(case: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """kv_cache_dtype fp8: the kernel widens the pages as it loads them and writes the batch's K/V as fp8,
    as the PyTorch backend does."""
    run_backends(*CASES[case], dtype=dtype, cache_dtype=cache_dtype)


def test_ragged_batch_tiles() -> None:
    """Decode rows one tile each; a prefill chunk one tile per 16 queries; tables padded with chunk 0."""
    batch = triton_attention.ragged_batch(torch.tensor([4, 9]), torch.tensor([[3, 5], [7, 8]]),
                                          [(2, 40, 0, torch.tensor([1, 2, 6]))], 16, None, CPU)
    assert batch.queries_per_tile == 16
    assert batch.seqs.tolist() == [[0, 1, 2], [1, 1, 40], [4, 9, 0]]
    assert batch.tiles.tolist() == [[0, 1, 2, 2, 2], [0, 0, 0, 16, 32]]
    assert batch.block_tables.tolist() == [[3, 5, 0], [7, 8, 0], [1, 2, 6]]
    decode_only = triton_attention.ragged_batch(torch.tensor([4]), torch.tensor([[3]]), [], 16, 8, CPU)
    assert decode_only.queries_per_tile == 1 and decode_only.window == 8


# -- whole models -------------------------------------------------------------------------------

GREEDY_KINDS = ["llama", "qwen3", "mistral_sliding", "gemma2", pytest.param("gemma3", marks=pytest.mark.slow)]
PROMPTS = random_prompts([3, 9, 20, 31], seed=5)  # the longest ~4 windows of 8
MAX_NEW = 8


def checked_greedy_ids(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy ids; every block back after."""
    ids = greedy_ids(llm, prompts, max_new)
    assert all_free(llm)
    return ids


@interpreter_only
@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_greedy_matches_torch_backend_and_transformers(tiny_models: dict[str, TinyModel], kind: str) -> None:
    """fp32, chunked prefill (16-token passes mix decodes and chunks), 4-token pages, windows of 8."""
    model = tiny_models[kind]
    config = dict(max_batch_tokens=16, page_size=4)
    llm = model.llm(attention_backend="triton", **config)
    assert isinstance(llm.engine.runner.attention, TritonPagedAttention)
    ours = checked_greedy_ids(llm, PROMPTS, MAX_NEW)
    assert ours == checked_greedy_ids(model.llm(attention_backend="torch", **config), PROMPTS, MAX_NEW)
    for i, (prompt, ids) in enumerate(zip(PROMPTS, ours)):
        ref, logits = hf_greedy(model.reference, prompt, MAX_NEW)
        assert_greedy_match(ids, ref, logits, f"{kind} prompt {i}")


@interpreter_only
def test_fp8_cache_greedy_matches_torch_backend(tiny_models: dict[str, TinyModel]) -> None:
    """A model over fp8 pages: the Triton kernel's tokens and log-probabilities are the PyTorch backend's
    (both widen the same bytes), at half the bytes of a bf16 cache; every block back."""
    model = tiny_models["llama_smooth"]
    config = dict(max_batch_tokens=16, page_size=4, kv_cache_dtype="fp8")
    llm = model.llm(attention_backend="triton", **config)
    assert llm.engine.pool.kv[0].dtype == torch.float8_e4m3fn
    reference = model.llm(attention_backend="torch", **config)
    assert checked_greedy_ids(llm, PROMPTS, MAX_NEW) == checked_greedy_ids(reference, PROMPTS, MAX_NEW)
    err = (next_token_logprobs(llm, PROMPTS) - next_token_logprobs(reference, PROMPTS)).abs().max().item()
    assert err < 1e-4, err


@interpreter_only
@pytest.mark.slow
def test_builtin_model_greedy_matches_torch_backend() -> None:
    """The built-in model (fp32, the exact path) on two chat prompts, chunked prefill included."""
    prompts = ["Hi.", "Write one sentence about the moon."]
    ids = []
    for backend in ("triton", "torch"):
        llm = LLM(dtype="float32", config=ContinuousBatchingConfig(attention_backend=backend, max_batch_tokens=24,
                                                                   num_blocks=64))
        rendered = [llm.render_chat([{"role": "user", "content": p}]) for p in prompts]
        ids.append(checked_greedy_ids(llm, rendered, 3))
    assert ids[0] == ids[1]


# -- choosing the backend -------------------------------------------------------------------------

def test_config_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'cpu', 'triton'\)"):
        ContinuousBatchingConfig(attention_backend="flash")


def test_backend_choice_on_cpu(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice logic, with the native kernel's build stubbed (test_attention builds it for real)."""
    kernel = SimpleNamespace()
    monkeypatch.setattr(attention, "cpu_paged_attention", lambda: kernel)
    assert type(make_attention_backend(CPU, torch.float32, "torch")) is TorchPagedAttention
    assert type(make_attention_backend(CPU, torch.float16, "auto")) is TorchPagedAttention
    for dtype in (torch.float32, torch.bfloat16):
        for choice in ("auto", "cpu"):
            backend = make_attention_backend(CPU, dtype, choice)
            assert isinstance(backend, CpuPagedAttention) and backend.kernel is kernel
    with pytest.raises(ConfigError, match="attention_backend='cpu' runs on CPU with float32 or bfloat16"):
        make_attention_backend(CPU, torch.float16, "cpu")
    with pytest.raises(ConfigError, match="attention_backend='cpu' runs on CPU"):
        make_attention_backend(torch.device("cuda"), torch.float32, "cpu")
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert type(make_attention_backend(CPU, torch.float32, "auto")) is TorchPagedAttention
    with pytest.raises(ConfigError, match="CONVEYOR_NATIVE_KERNELS=0"):
        make_attention_backend(CPU, torch.float32, "cpu")
    monkeypatch.delenv("CONVEYOR_NATIVE_KERNELS")
    monkeypatch.setattr(attention, "cpu_paged_attention", lambda: None)  # the build failed
    assert type(make_attention_backend(CPU, torch.float32, "auto")) is TorchPagedAttention
    with pytest.raises(ConfigError, match="did not build"):
        make_attention_backend(CPU, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="takes float32, bfloat16 or float16"):
        make_attention_backend(CPU, torch.float64, "triton")
    if INTERPRETED:
        assert isinstance(make_attention_backend(CPU, torch.bfloat16, "triton"), TritonPagedAttention)
        monkeypatch.setattr(triton_attention, "INTERPRETED", False)
        with pytest.raises(ConfigError, match="was not set when the kernel was first imported"):
            make_attention_backend(CPU, torch.float32, "triton")
    with pytest.raises(ConfigError, match="the native CPU kernels read 'int8'"):
        make_attention_backend(CPU, torch.bfloat16, "auto", kv_cache_dtype="fp8")
    assert type(make_attention_backend(CPU, torch.bfloat16, "torch", kv_cache_dtype="fp8_e5m2")) is TorchPagedAttention
    with pytest.raises(ConfigError, match="does not read a kv_cache_dtype='int8' cache"):
        make_attention_backend(CPU, torch.bfloat16, "triton", kv_cache_dtype="int8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="set TRITON_INTERPRET=1 in the environment"):
        make_attention_backend(CPU, torch.float32, "triton")
    with pytest.raises(ConfigError, match="set TRITON_INTERPRET=1"):
        LLM(tiny_llama.path, config=ContinuousBatchingConfig(attention_backend="triton", num_blocks=16))


# -- CUDA (compiled Triton) -------------------------------------------------------------------------

@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_kernel_matches_torch_backend(case: str, dtype: torch.dtype) -> None:
    run_backends(*CASES[case], dtype=dtype, device=torch.device("cuda"))


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_cuda_kernel_reads_fp8_pages(cache_dtype: torch.dtype) -> None:
    run_backends(*CASES["window-not-page-multiple-softcap-gqa3"], dtype=torch.bfloat16,
                 device=torch.device("cuda"), cache_dtype=cache_dtype)


@pytest.mark.cuda
@cuda_only
def test_cuda_auto_backend_is_triton() -> None:
    assert isinstance(make_attention_backend(torch.device("cuda"), torch.bfloat16, "auto"), TritonPagedAttention)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_cuda_greedy_matches_transformers(tiny_models: dict[str, TinyModel], kind: str) -> None:
    model = tiny_models[kind]
    llm = LLM(model.path, device="cuda", dtype="float32",
              config=ContinuousBatchingConfig(attention_backend="triton", max_batch_tokens=16, page_size=4,
                                              num_blocks=256))
    for i, (prompt, ids) in enumerate(zip(PROMPTS, checked_greedy_ids(llm, PROMPTS, MAX_NEW))):
        ref, logits = hf_greedy(model.reference, prompt, MAX_NEW)
        assert_greedy_match(ids, ref, logits, f"{kind} prompt {i}")
