"""kv_cache_dtype "fp8" ("fp8_e4m3") and "fp8_e5m2": pages of one byte a value, saturated, widened by the
readers (the Triton kernel on CUDA, tested in tests/kernels/test_triton_attention.py; the PyTorch backend
here); half a bf16 cache's bytes; swapped pages move as bytes; the CPU's native kernels refuse it by name;
the error it adds, measured against the exact path."""

from __future__ import annotations

import pytest
import torch

from conveyor.cache.kv_format import decode_kv, encode_kv, kv_format, to_fp8
from conveyor.errors import ConfigError

from tests.utils import (TinyModel, agreement, all_free, greedy, greedy_ids, next_token_logprobs,
                         random_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
PROMPTS = random_prompts([20, 15, 25, 10, 18], seed=5)


def test_formats_and_what_they_store() -> None:
    """"fp8" is e4m3 (vLLM's default); a value past the format's range saturates instead of becoming NaN."""
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("fp8_e5m2", torch.float8_e5m2)):
        fmt = kv_format(name, torch.bfloat16, CPU, 64)
        assert (fmt.dtype, fmt.row, fmt.bytes_per_row) == (dtype, 64, 64)
    x = torch.tensor([[1000.0, -1000.0, 0.3, 0.0]])
    stored = encode_kv(torch.float8_e4m3fn, x)
    assert stored.dtype == torch.float8_e4m3fn and decode_kv(stored, torch.float32).tolist()[0][:2] == [448.0, -448.0]
    assert torch.equal(decode_kv(stored, torch.float32), to_fp8(x, torch.float8_e4m3fn).float())


def test_cpu_native_kernels_refuse_it_by_name(tiny_llama: TinyModel) -> None:
    with pytest.raises(ConfigError, match="the native CPU kernels read 'int8'.*attention_backend='torch'"):
        tiny_llama.llm(kv_cache_dtype="fp8")


def test_half_the_bytes_and_swapped_pages_come_back(tiny_models: dict[str, TinyModel]) -> None:
    """An fp8 pool is half a bf16 pool's bytes a chunk; a request swapped out and back gives the tokens of an
    engine whose pool holds every request; every block back (the decode stack leaves fp8 pages alone)."""
    model = tiny_models["llama_smooth"]
    auto = model.llm(dtype="bfloat16", page_size=4)
    fp8 = dict(dtype="bfloat16", kv_cache_dtype="fp8", attention_backend="torch", page_size=4)
    roomy = model.llm(**fp8)
    per_chunk = {name: llm.engine.pool.nbytes / llm.engine.pool.num_chunks for name, llm in (("auto", auto),
                                                                                           ("fp8", roomy))}
    assert per_chunk["auto"] == 2 * per_chunk["fp8"]
    params = [greedy(n) for n in (24, 28, 16, 30, 20)]
    reference = [o.token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    small = model.llm(**fp8, num_blocks=24, max_batch_tokens=32, safety_margin=0.0, cpu_offload_space=1.0)
    assert [o.token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)] == reference
    stats = small.stats()
    assert stats.swap_ins > 0 and all_free(small) and all_free(roomy)
    assert small.engine.swap.num_free == small.engine.swap.num_slots


@pytest.mark.parametrize("name, limit", [("fp8_e4m3", 0.2), ("fp8_e5m2", 0.4)])
def test_what_fp8_costs_the_model(tiny_models: dict[str, TinyModel], name: str, limit: float) -> None:
    """Against the exact path's fp32 cache: measured max log-prob errors of 0.049 (e4m3) and 0.099 (e5m2) on
    this model, greedy agreement 100% and 93%, against int8's 0.014 (test_int8_kv_cache): fp8's 3 (or 2)
    mantissa bits and no scale cost more than int8's 7 bits and a scale per row. The limits leave 4x."""
    model = tiny_models["llama_smooth"]
    prompts = random_prompts([5, 9, 14, 20, 3, 30, 11, 7, 25, 16, 8, 12], seed=41)
    exact, fp8 = model.llm(), model.llm(kv_cache_dtype=name, attention_backend="torch")
    err = (next_token_logprobs(fp8, prompts) - next_token_logprobs(exact, prompts)).abs().max().item()
    assert 0 < err < limit, err
    assert agreement(greedy_ids(fp8, prompts), greedy_ids(exact, prompts)) >= 0.75
