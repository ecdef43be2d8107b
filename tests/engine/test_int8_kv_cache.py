"""kv_cache_dtype="int8" through the engine: the choices and their errors, a pool of smaller pages (more
tokens in the same memory), outputs that do not depend on how the batch was built (decode stack or eager
layers, chunk sizes, offloading), the PyTorch backend's int8 path agreeing with the native one (sliding
windows too), prefix hits, speculation and the pool's figures over int8 pages, and the error int8 adds to the
model's log-probabilities."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.cache.kv_format import kv_format
from conveyor.errors import ConfigError

from tests.utils import (INVARIANT, NGRAM, VOCAB, TinyModel, agreement, all_free, copy_prompts, greedy, greedy_ids,
                         next_token_logprobs, random_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts([20, 15, 25, 10, 18], seed=5)


def test_choices_and_what_each_device_runs() -> None:
    cpu = torch.device("cpu")
    assert kv_format("auto", torch.bfloat16, cpu, 64).dtype == torch.bfloat16
    int8 = kv_format("int8", torch.bfloat16, cpu, 64)
    assert (int8.dtype, int8.row, int8.bytes_per_row) == (torch.uint8, 68, 68)
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'"):
        ContinuousBatchingConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8' runs on CPU; on cuda use 'fp8' or 'auto'"):
        kv_format("int8", torch.bfloat16, torch.device("cuda"), 64)
    with pytest.raises(ConfigError, match="a multiple of 4"):
        kv_format("int8", torch.bfloat16, cpu, 30)


def test_the_same_memory_holds_more_tokens(tiny_models: dict[str, TinyModel]) -> None:
    """A chunk of int8 rows takes (D + 4) / (2 D) of a bf16 chunk's bytes: 1.6x the tokens in the same memory
    at the tiny model's D = 16, 1.88x at the built-in model's 64 (test_the_built_in_model_in_int8)."""
    model = tiny_models["llama_smooth"]
    auto, int8 = model.llm(dtype="bfloat16"), model.llm(dtype="bfloat16", kv_cache_dtype="int8")
    assert int8.engine.pool.kv[0].dtype == torch.uint8 and int8.engine.pool.kv[0].shape[-1] == 16 + 4
    per_chunk = {kv: llm.engine.pool.nbytes / llm.engine.pool.num_chunks for kv, llm in (("auto", auto), ("int8", int8))}
    assert per_chunk["auto"] / per_chunk["int8"] == pytest.approx(2 * 16 / (16 + 4))
    assert kv_format("int8", torch.bfloat16, torch.device("cpu"), 64).bytes_per_row / (2 * 64) <= 1 / 1.8


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_outputs_do_not_depend_on_the_batch(tiny_models: dict[str, TinyModel], quantization: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens and log-probabilities to the bit (bf16, dense or int8 weights: the batch-invariant modes on CPU):
    decode steps through the native stack or the eager layers, prompts prefilled in chunks of 8 or 64 tokens
    (int8 rows enter prefill and decode alike)."""
    model = tiny_models["llama_smooth"]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=VOCAB)

    def run(**config: object) -> tuple[list[list[int]], list]:
        llm = model.llm(dtype="bfloat16", quantization=quantization, kv_cache_dtype="int8", page_size=4, **config,
                        **INVARIANT)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all_free(llm)
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    stacked = run(max_batch_tokens=64)
    assert stacked == run(max_batch_tokens=8)
    monkeypatch.setenv("CONVEYOR_DECODE_STACK", "0")
    assert stacked == run(max_batch_tokens=64)


def test_swapped_and_soft_reset_requests_keep_their_outputs(tiny_llama: TinyModel) -> None:
    """The swap pool copies int8 pages with their scales; a soft reset recomputes them: the same tokens as
    an engine whose pool holds every request."""
    small = dict(kv_cache_dtype="int8", page_size=4, num_blocks=24, max_batch_tokens=32, safety_margin=0.0)
    params = [greedy(n) for n in (24, 28, 16, 30, 20)]
    roomy = tiny_llama.llm(kv_cache_dtype="int8", page_size=4)
    reference = [o.token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    for space in (1.0, 0.0):  # GiB of swap pool: everything swaps; none, everything recomputes
        llm = tiny_llama.llm(**small, cpu_offload_space=space)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
        stats = llm.stats()
        assert stats.offloads > 0 and (stats.swap_ins > 0) == (space > 0)
        assert all_free(llm) and (llm.engine.swap is None or llm.engine.swap.num_free == llm.engine.swap.num_slots)


def assert_reads_int8_alike(model: TinyModel, prompts: list[list[int]], new_tokens: int, **kwargs) -> None:
    """attention_backend="torch" (dequantize, then SDPA) against the native kernels' int8 arithmetic: the same
    values, so the same greedy tokens, and log-probabilities apart by much less than what the int8 rows
    themselves cost. The kernels round one thing more, each key block's softmax weights to 15-bit integers
    in the value sums (attention_blocks.h; 4% and 11% of int8's cost on llama_smooth and gemma2 here); a
    page or a scale misread would cost more than the rows' whole quantization."""
    native = model.llm(kv_cache_dtype="int8", **kwargs)
    torch_backend = model.llm(kv_cache_dtype="int8", attention_backend="torch", **kwargs)
    ours = next_token_logprobs(native, prompts)
    err = (ours - next_token_logprobs(torch_backend, prompts)).abs().max().item()
    int8_cost = (ours - next_token_logprobs(model.llm(**kwargs), prompts)).abs().max().item()
    assert err < 0.25 * int8_cost, (err, int8_cost)
    assert greedy_ids(native, prompts, new_tokens) == greedy_ids(torch_backend, prompts, new_tokens)
    assert all_free(native) and all_free(torch_backend)


def test_the_pytorch_backend_reads_int8_as_the_kernels_do(tiny_models: dict[str, TinyModel]) -> None:
    assert_reads_int8_alike(tiny_models["llama_smooth"], random_prompts([5, 9, 14, 20, 3, 30, 11, 7], seed=41), 12)


def test_what_int8_costs_the_model(tiny_models: dict[str, TinyModel]) -> None:
    """Against the fp32 cache of the exact path: measured 0.005 max log-prob error and full greedy agreement
    on this model; the limits leave 4x."""
    model = tiny_models["llama_smooth"]
    prompts = random_prompts([5, 9, 14, 20, 3, 30, 11, 7, 25, 16, 8, 12], seed=41)
    exact, int8 = model.llm(), model.llm(kv_cache_dtype="int8")
    err = (next_token_logprobs(int8, prompts) - next_token_logprobs(exact, prompts)).abs().max().item()
    assert 0 < err < 0.02, err
    assert agreement(greedy_ids(int8, prompts), greedy_ids(exact, prompts)) >= 0.9


@pytest.mark.slow
def test_the_built_in_model_in_int8() -> None:
    """The built-in model (head dim 64): 1.8x+ the tokens in the same memory, prompt log-probabilities close
    to the bf16 cache's: measured a mean absolute difference of 0.036 per token (at most 0.68, on an early
    token) and a mean log-likelihood within 0.01 (perplexity within 0.3% on a longer text, docs/benchmarks.md);
    finer scales (one per 32 values) measured no better, 0.033 and 0.54."""
    text = ("The quick brown fox jumps over the lazy dog. Continuous batching rebuilds the batch at every step, "
            "so a finished sequence leaves at once and a waiting one takes its place. ") * 6
    llms = {kv: LLM(kv_cache_dtype=kv, gpu_memory_utilization=0.01) for kv in ("auto", "int8")}
    assert llms["int8"].engine.capacity_tokens >= 1.8 * llms["auto"].engine.capacity_tokens
    ids = llms["auto"].get_tokenizer().encode(text)
    scored = {}
    for kv, llm in llms.items():
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        scored[kv] = torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])
        assert all_free(llm)
    error = scored["int8"] - scored["auto"]
    assert error.abs().mean() < 0.06 and error.abs().max() < 1.0, (error.abs().mean(), error.abs().max())
    assert abs(error.mean()) < 0.02, error.mean()


def test_prefix_hits_read_the_int8_pages_their_owner_wrote(tiny_models: dict[str, TinyModel]) -> None:
    """Requests sharing a long prefix: with block sharing on they skip its prefill and read the int8 pages
    (and scales) the first one wrote; the same tokens as with sharing off, every block back."""
    model = tiny_models["llama_smooth"]
    shared = random_prompts([33], seed=8)[0]
    prompts = [shared + tail for tail in random_prompts([3, 6, 9, 4], seed=9)]
    params = greedy(12)
    outs = {}
    for sharing in (False, True):
        llm = model.llm(kv_cache_dtype="int8", page_size=4, allow_block_sharing=sharing)
        llm.generate(prompts[:1], params, use_tqdm=False)  # the prefix is cached before the rest arrive
        outs[sharing] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.stats().prefix_cache_hit_tokens >= 4 * 32) == sharing and all_free(llm)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("kind", ["mistral_sliding", "gemma2"])
def test_sliding_windows_read_int8_as_the_pytorch_backend(tiny_models: dict[str, TinyModel], kind: str) -> None:
    """Windowed layers (alone, or beside full ones in their own pool group) in int8: the native kernels and
    the PyTorch backend agree past the window."""
    assert_reads_int8_alike(tiny_models[kind], random_prompts([5, 19, 30, 12], seed=43), 16, page_size=4)


def test_speculation_over_int8_pages_equals_speculation_off(tiny_models: dict[str, TinyModel]) -> None:
    """n-gram speculation verifies drafts against int8 pages and rolls rejected rows back: the tokens of
    plain int8 decoding, every block back."""
    model = tiny_models["llama_smooth"]
    prompts = copy_prompts()
    params = [greedy(n) for n in (30, 17, 25, 9, 40, 22, 20)]
    plain = model.llm(kv_cache_dtype="int8", max_batch_tokens=32)
    spec = model.llm(kv_cache_dtype="int8", max_batch_tokens=32, speculative_config=NGRAM)
    assert ([o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)])
    assert spec.engine.speculator.stats()["num_accepted_tokens"] > 0 and all_free(spec)


def test_the_pool_figures_count_int8_bytes(tiny_models: dict[str, TinyModel]) -> None:
    """cache_usage (the dashboard's and /metrics' source) reports the int8 pool's own bytes."""
    llm = tiny_models["llama"].llm(kv_cache_dtype="int8", num_blocks=40)
    usage = llm.cache_usage()
    assert usage["bytes"] == llm.engine.pool.nbytes == sum(layer.numel() for layer in llm.engine.pool.kv)
