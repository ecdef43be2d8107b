"""vLLM's engine arguments in `LLM(...)`: each one's effect on the engine (context cap, batch size, seed,
prefix caching, memory share), and a clear error where one disagrees with the config or the model."""

from __future__ import annotations

import gguf
import pytest
import torch

from conveyor import LLM, CachePool, ContinuousBatchingConfig, InvalidRequestError, SamplingParams
from conveyor.cli import main
from conveyor.config import VLLM_ENGINE_ARGS, with_vllm_engine_args
from conveyor.errors import ConfigError
from conveyor.vllm_flags import ALREADY_SO

from tests.gguf_writer import write_gguf
from tests.utils import USER_CHAT_TEMPLATE, VOCAB, TinyModel, greedy_ids, random_prompts, tiny_tokenizer


def tiny(model: TinyModel, **kwargs: object) -> LLM:
    return LLM(model.path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=128), **kwargs)


def sampled(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, **kw)


def test_each_vllm_name_sets_its_field_and_a_disagreement_is_an_error() -> None:
    given = {"max_model_len": 100, "seed": 3, "max_num_seqs": 5, "max_num_batched_tokens": 48,
             "gpu_memory_utilization": 0.25, "enable_prefix_caching": False, "block_size": 8, "swap_space": 1.5,
             "enforce_eager": True, "num_gpu_blocks_override": 40}
    assert set(given) | {"tensor_parallel_size", "kv_cache_dtype", "scheduling_policy", "async_scheduling",
                         "kv_cache_memory_bytes"} == set(VLLM_ENGINE_ARGS)
    config = with_vllm_engine_args(None, **given)
    assert (config.max_model_len, config.seed, config.max_requests_per_batch, config.max_batch_tokens,
            config.max_memory_percent, config.allow_block_sharing, config.page_size, config.cpu_offload_space,
            config.use_cuda_graph, config.num_blocks) == (100, 3, 5, 48, 0.25, False, 8, 1.5, False, 40)
    assert with_vllm_engine_args(None, tensor_parallel_size=2).tensor_parallel_size == 2
    assert with_vllm_engine_args(None, kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert with_vllm_engine_args(None, scheduling_policy="priority").scheduler_type == "priority"  # more: tests/sched
    assert with_vllm_engine_args(None, async_scheduling=True).use_async_batching is True
    assert with_vllm_engine_args(None, enforce_eager=False).use_cuda_graph is None  # vLLM's default: automatic
    same = ContinuousBatchingConfig(max_requests_per_batch=5)
    assert with_vllm_engine_args(same, max_num_seqs=5).max_requests_per_batch == 5  # agreeing twice is fine
    with pytest.raises(ConfigError, match=r"max_num_seqs \(vLLM's name for max_requests_per_batch\)=2 disagrees "
                                          r"with max_requests_per_batch=8"):
        with_vllm_engine_args(ContinuousBatchingConfig(max_requests_per_batch=8), max_num_seqs=2)
    with pytest.raises(ConfigError, match="enable_prefix_caching.*disagrees with allow_block_sharing=False"):
        with_vllm_engine_args(ContinuousBatchingConfig(allow_block_sharing=False), enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="max_memory_percent must be in"):
        with_vllm_engine_args(None, gpu_memory_utilization=1.5)


def test_max_model_len_caps_the_context(tiny_llama: TinyModel) -> None:
    llm = tiny(tiny_llama, max_model_len=64)
    assert llm.max_model_len == 64 and llm.engine.config.max_model_len == 64
    with pytest.raises(InvalidRequestError, match=r"= 70 exceeds the context length of 64 tokens \(max_model_len\)"):
        llm.generate([[5] * 60], sampled(10), use_tqdm=False)
    [out] = llm.generate([[5] * 60], sampled(4), use_tqdm=False)
    assert out.num_output_tokens == 4
    assert llm.default_max_tokens(60) == 4  # what a server request without max_tokens may generate
    with pytest.raises(ConfigError, match="max_model_len=1000 is larger than the model's context length of 512"):
        tiny(tiny_llama, max_model_len=1000)


def test_max_num_seqs_bounds_every_batch(tiny_llama: TinyModel) -> None:
    llm = tiny(tiny_llama, max_num_seqs=2)
    engine = llm.engine
    sizes: list[int] = []
    schedule = engine.schedule

    def recording():
        out = schedule()
        sizes.append(len(out.chunks))
        return out

    engine.schedule = recording
    outputs = llm.generate(random_prompts([5, 9, 3, 7, 6]), sampled(6), use_tqdm=False)
    assert [o.num_output_tokens for o in outputs] == [6] * 5
    assert max(sizes) == 2  # two at once, never more
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_seed_repeats_a_run_and_leaves_seeded_requests_alone(tiny_llama: TinyModel) -> None:
    prompts = random_prompts([4, 6, 5])

    def run(llm: LLM, **kw: object) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, sampled(8, **kw), use_tqdm=False)]

    first, again, other = run(tiny(tiny_llama, seed=7)), run(tiny(tiny_llama, seed=7)), run(tiny(tiny_llama, seed=8))
    assert first == again and first != other
    assert len({tuple(t) for t in first}) == 3  # each request draws its own numbers
    assert run(tiny(tiny_llama, seed=7), seed=3) == run(tiny(tiny_llama), seed=3)  # a request's own seed wins


def test_no_enable_prefix_caching_turns_prefix_caching_off(tiny_llama: TinyModel) -> None:
    prompt = random_prompts([40])[0]
    for enabled in (True, False):
        llm = tiny(tiny_llama, enable_prefix_caching=enabled)
        llm.generate([prompt], sampled(2), use_tqdm=False)
        llm.generate([prompt], sampled(2), use_tqdm=False)
        assert llm.engine.block_sharing is enabled
        assert (llm.stats().prefix_cache_hit_tokens > 0) is enabled


def test_gpu_memory_utilization_is_the_pools_share_of_free_memory(tiny_llama: TinyModel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the share is of the available system memory left after one pass's working memory."""
    free = 64 * 2**20
    monkeypatch.setattr("conveyor.cache.pool.available_memory", lambda device: free)
    monkeypatch.setattr("conveyor.engine.engine.working_memory", lambda *args: 0)  # all of it left for the pool
    chunks = {}
    for share in (0.05, 0.1):
        llm = LLM(tiny_llama.path, dtype="float32", gpu_memory_utilization=share)
        assert llm.engine.config.max_memory_percent == share
        chunks[share] = llm.engine.pool.num_chunks
        per_chunk = CachePool.bytes_per_chunk(dtype=torch.float32, page_size=16, num_layers=2, num_kv_heads=2,
                                              head_dim=16)
        assert chunks[share] == int(free * share) // per_chunk
    assert chunks[0.1] in (2 * chunks[0.05], 2 * chunks[0.05] + 1)


def test_kv_cache_memory_bytes_and_vllm_cpu_kvcache_space_size_the_pool(tiny_llama: TinyModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's byte budget, and its CPU variable in GiB (the budget wins; 0 = automatic, as vLLM): the pool holds
    the chunks that fit; more than is free, or a byte budget beside num_blocks, is an error naming it."""
    monkeypatch.setattr("conveyor.cache.pool.available_memory", lambda device: 16 * 2**20)
    monkeypatch.setattr("conveyor.engine.engine.working_memory", lambda *args: 0)
    per_chunk = CachePool.bytes_per_chunk(dtype=torch.float32, page_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
    llm = LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=300 * per_chunk + 5)
    assert llm.engine.pool.num_chunks == 300 and llm.engine.config.kv_cache_memory_bytes == 300 * per_chunk + 5
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")  # GiB
    assert LLM(tiny_llama.path, dtype="float32").engine.pool.num_chunks == int(0.01 * 2**30) // per_chunk
    assert LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=100 * per_chunk).engine.pool.num_chunks == 100
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert LLM(tiny_llama.path, dtype="float32").engine.pool.num_chunks == 8 * 2**20 // per_chunk  # half the free
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'"):
        LLM(tiny_llama.path, dtype="float32")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    with pytest.raises(MemoryError, match=r"a KV cache of 33554432 bytes \(kv_cache_memory_bytes\) does not fit"):
        LLM(tiny_llama.path, dtype="float32", kv_cache_memory_bytes=32 * 2**20)
    with pytest.raises(ConfigError, match="num_blocks and kv_cache_memory_bytes both size the KV pool"):
        ContinuousBatchingConfig(num_blocks=8, kv_cache_memory_bytes=2**20)


def test_vllm_arguments_we_do_not_take_say_what_to_use(tiny_llama: TinyModel, caplog: pytest.LogCaptureFixture) -> None:
    """As on the command line: vLLM's `LLM(trust_remote_code=True)` is taken (a log line says why it has no
    effect); `enable_chunked_prefill=False` is refused with what to use, a `kv_cache_dtype` the CPU's kernels do
    not read names the one they do; a name vLLM does not have either is Python's TypeError."""
    with caplog.at_level("INFO", logger="conveyor"):
        llm = tiny(tiny_llama, trust_remote_code=True, disable_log_stats=True)
    assert f"trust_remote_code=True: no effect, {ALREADY_SO['--trust-remote-code']}" in caplog.text
    assert llm.generate([[5, 6]], sampled(2), use_tqdm=False)[0].num_output_tokens == 2
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8': the native CPU kernels read 'int8'"):
        tiny(tiny_llama, kv_cache_dtype="fp8")
    assert tiny(tiny_llama, kv_cache_dtype="int8").engine.pool.kv[0].dtype == torch.uint8
    with pytest.raises(ValueError, match="enable_chunked_prefill=False .* prefill is always chunked"):
        tiny(tiny_llama, enable_chunked_prefill=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences'"):
        tiny(tiny_llama, max_num_sequences=2)


def test_n_samples_per_prompt_as_vllm(tiny_llama: TinyModel) -> None:
    """vLLM's `SamplingParams(n=...)`: one output per prompt, its `outputs` the n samples; sample j is the
    request seeded seed + j; greedy samples agree; a request handed to the manager is one sample."""
    llm = tiny(tiny_llama)
    prompts = random_prompts([6, 9], seed=50)
    sampled = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    outs = llm.generate(prompts, sampled, use_tqdm=False)
    assert len(outs) == 2 and all([c.index for c in o.outputs] == [0, 1, 2] for o in outs)
    for out, prompt in zip(outs, prompts):
        alone = [llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=11 + j, ignore_eos=True),
                              use_tqdm=False)[0].token_ids for j in range(3)]
        assert [c.token_ids for c in out.outputs] == alone and out.token_ids == alone[0]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # three samples, not one
    greedy = llm.generate([prompts[0]], SamplingParams(n=2, max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    mixed = llm.generate(prompts, [SamplingParams(max_tokens=4), SamplingParams(n=2, max_tokens=4)], use_tqdm=False)
    assert [len(o.outputs) for o in mixed] == [1, 2]
    with pytest.raises(InvalidRequestError, match="n=2: a request is one sample"):
        llm.manager.add_request(prompts[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    assert llm.stats().free_blocks == llm.stats().total_blocks


def test_enqueue_then_wait_for_completion_as_vllm(tiny_llama: TinyModel) -> None:
    """vLLM's offline queue: two `enqueue` calls (validated first; nothing runs, a `generate` between them
    included), then one wait gives every output in queueing order, each as `generate` gives it; a second
    wait has nothing left."""
    llm = tiny(tiny_llama)
    prompts = random_prompts([6, 9, 4], seed=51)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    with pytest.raises(InvalidRequestError):  # a bad prompt queues nothing
        llm.enqueue([prompts[0], [10**9]], greedy)
    first = llm.enqueue(prompts[:2], greedy)
    expected = llm.generate(prompts[:2], greedy, use_tqdm=False)  # in between: neither runs nor cuts the queue
    second = llm.enqueue(prompts[2], sampled)
    assert len(first) == 2 and len(second) == 2 and llm.stats().prompt_tokens == 6 + 9  # generate's only
    outs = llm.wait_for_completion(use_tqdm=False)
    expected += llm.generate(prompts[2], sampled, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in expected]
    assert [o.request_id for o in outs] == [first[0], first[1], second[0]]
    assert llm.wait_for_completion(use_tqdm=False) == [] and llm.stats().free_blocks == llm.stats().total_blocks


def test_tokenizer_is_used_in_place_of_the_models_own(tiny_llama: TinyModel, tmp_path, monkeypatch) -> None:
    """vLLM's `tokenizer`: a GGUF file whose toy vocabulary transformers cannot convert runs with the original
    model's tokenizer (the file's is never converted): the same greedy tokens as the model's directory, text
    tokenized and chats rendered by that tokenizer; one with more tokens than the model has is refused."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama.reference, "llama", gguf.GGMLQuantizationType.F32)

    def never(path: object) -> None:
        raise AssertionError("the file's own tokenizer was converted")

    monkeypatch.setattr("conveyor.models.loader._gguf_tokenizer", never)
    own = tiny_tokenizer()
    own.chat_template = USER_CHAT_TEMPLATE
    own.save_pretrained(tmp_path / "tokenizer")
    llm = LLM(path, dtype="float32", tokenizer=tmp_path / "tokenizer", config=ContinuousBatchingConfig(num_blocks=64))
    prompts = random_prompts([6, 9], seed=8)
    assert greedy_ids(llm, prompts) == greedy_ids(tiny(tiny_llama), prompts)
    assert llm.generate(["w5 w6"], sampled(1), use_tqdm=False)[0].prompt_token_ids == own.encode("w5 w6")
    assert llm.render_chat_text([{"role": "user", "content": "w5"}]) == "w7 w5 w8 w9"
    assert main(["generate", str(path), "w5 w6", "--tokenizer", str(tmp_path / "tokenizer"), "--dtype", "float32",
                 "--num-blocks", "64", "--max-new-tokens", "3", "--temperature", "0"]) == 0  # through its template
    tiny_tokenizer(VOCAB + 8).save_pretrained(tmp_path / "larger")
    with pytest.raises(ConfigError, match=f"has {VOCAB + 8} tokens, more than the model's vocabulary of {VOCAB}"):
        LLM(path, dtype="float32", tokenizer=tmp_path / "larger", config=ContinuousBatchingConfig(num_blocks=64))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(path, dtype="float32", tokenizer=path)
