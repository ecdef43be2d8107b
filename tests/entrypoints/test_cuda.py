"""On a CUDA GPU (`pytest -m cuda`; skipped elsewhere, and not CPU coverage): the exact path against
transformers, bf16 generation, cache sizing from device memory, pinned swapping and block accounting,
and a sampler that never waits for the device."""

from __future__ import annotations

import pytest
import torch
import transformers

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.cache.pool import NUM_RESERVED_CHUNKS
from conveyor.layers.sampler import Sampler
from conveyor.models.loader import default_model_path, load_checkpoint
from conveyor.request import Request

from tests.utils import (LENGTHS, MAX_NEW, TinyModel, agreement, all_free, assert_greedy_match, hf_greedy,
                         random_prompts)

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_matmuls() -> None:
    """fp32 means fp32: no TF32 matmuls for transformers or us."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral_sliding", "gemma2"])
def test_fp32_greedy_matches_transformers_on_cuda(tiny_models: dict[str, TinyModel], kind: str) -> None:
    model = tiny_models[kind]
    reference = model.reference.to(CUDA)
    try:
        llm = LLM(model.path, dtype="float32", device="cuda",
                  config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64))
        params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
        prompts = random_prompts(LENGTHS)
        for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, params, use_tqdm=False))):
            ref, logits = hf_greedy(reference, prompt, MAX_NEW[i])
            assert_greedy_match(out.token_ids, ref, logits, f"{kind} on CUDA, prompt {i}")
        assert all_free(llm)
    finally:
        model.reference.to("cpu")


def builtin_or_skip() -> None:
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(f"the built-in model is not installed here: {exc}")


def test_builtin_model_fp32_matches_transformers_on_cuda() -> None:
    builtin_or_skip()
    llm = LLM(dtype="float32", device="cuda")
    checkpoint = load_checkpoint(None)
    reference = transformers.LlamaForCausalLM(checkpoint.config).eval()
    reference.load_state_dict(checkpoint.state_dict, strict=False)
    reference.tie_weights()
    reference.to(CUDA)
    questions = ["Hi.", "Write one sentence about the moon.", "Give three facts about photosynthesis.",
                 "Explain TCP handshakes to a child in a short paragraph.", "What is 2 + 2?"]
    prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in questions]
    max_new = [8, 20, 24, 16, 6]
    outputs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0) for n in max_new],
                           use_tqdm=False)
    for i, (prompt, n, out) in enumerate(zip(prompts, max_new, outputs)):
        ref, logits = hf_greedy(reference, prompt, n, eos_token_id=checkpoint.config.eos_token_id)
        assert_greedy_match(out.token_ids, ref, logits, f"SmolLM2 on CUDA, prompt {i}")
    assert all_free(llm)


def test_bf16_is_the_cuda_default_and_generates_sanely(tiny_models: dict[str, TinyModel]) -> None:
    model = tiny_models["llama_smooth"]
    llm = LLM(model.path, device="cuda", config=ContinuousBatchingConfig(num_blocks=256))
    assert llm.dtype == torch.bfloat16 and llm.engine.pool.kv[0].dtype == torch.bfloat16
    prompts = random_prompts(LENGTHS)
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == MAX_NEW and all(o.finish_reason == "length" for o in outputs)
    reference = model.reference.to(CUDA)  # transformers fp32 on the GPU (no CPU kernels to build here)
    try:
        exact = [hf_greedy(reference, p, n)[0] for p, n in zip(prompts, MAX_NEW)]
    finally:
        model.reference.to("cpu")
    assert agreement([o.token_ids for o in outputs], exact) > 0.5
    assert all_free(llm)


def test_pool_is_sized_from_device_memory_after_a_profiling_pass(tiny_llama: TinyModel) -> None:
    llm = LLM(tiny_llama.path, dtype="float32", device="cuda",
              config=ContinuousBatchingConfig(max_batch_tokens=256, max_requests_per_batch=8))
    engine = llm.engine
    # The tiny model's full-length cap (8 requests x 512 tokens / 16) binds long before 0.9 of an H200.
    assert engine.pool.num_usable == 8 * 512 // 16
    assert torch.cuda.mem_get_info()[0] > 0
    outputs = llm.generate(random_prompts([300, 40]), SamplingParams(max_new_tokens=8, temperature=0,
                                                                     ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [8, 8]
    assert all_free(llm)


def test_block_accounting_with_cancel_stop_seeds_and_pinned_swaps(tiny_llama: TinyModel) -> None:
    """A small pool forces offloads to the pinned swap pool; every block comes back, outputs unchanged."""
    prompts = random_prompts([20, 15, 25, 10, 18, 12], seed=3)
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[7]),
              SamplingParams(max_new_tokens=24, temperature=1.0, top_k=20, seed=6, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=1.2, ignore_eos=True)]
    roomy = LLM(tiny_llama.path, dtype="float32", device="cuda", config=ContinuousBatchingConfig(num_blocks=256))
    tight = LLM(tiny_llama.path, dtype="float32", device="cuda",
                config=ContinuousBatchingConfig(num_blocks=24, page_size=4, max_batch_tokens=32, safety_margin=0.0,
                                                cpu_offload_space=0.01))
    assert all(t.is_pinned() for t in tight.engine.swap.kv)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert tight.stats().swap_outs > 0 and tight.stats().swap_ins == tight.stats().swap_outs
    assert all_free(tight)
    engine = tight.engine
    request = engine.make_request("cancel-me", prompts[0], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    engine.cancel_request("cancel-me")
    for _ in range(5):  # async batching frees a cancelled request's blocks once the step holding it is read back
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests() and all_free(tight)
    assert engine.pool.num_chunks == 24 + NUM_RESERVED_CHUNKS and engine.swap.num_free == engine.swap.num_slots


def test_sampler_never_waits_for_the_device_until_its_one_read() -> None:
    """Under CUDA's sync debug mode "error" any implicit synchronization in `sample` raises."""
    requests = [Request(f"r{i}", [3, 4, 5, 6], p) for i, p in enumerate([
        SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0, repetition_penalty=1.3,
                                                                presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5, min_tokens=4)])]
    requests[2].generator = torch.Generator(device=CUDA).manual_seed(3)
    for r in requests:
        r.output_token_ids = [5, 6, 6]
        r.stop_token_ids = frozenset({2})
    logits = torch.randn(len(requests), 300, device=CUDA)
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.sample(logits, requests).start_copy()  # the copy to the host is queued, not waited for
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, logprobs = batch.to_host()
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())
    assert logprobs[4] is not None and len(logprobs[4]) == 3
