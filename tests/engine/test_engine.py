"""Engine behaviour: validation, no leaked blocks, failure isolation, sampling parameters, stops."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conveyor import LLM, ContinuousBatchingConfig, InvalidRequestError, RequestState, SamplingParams
from conveyor.engine.engine import Engine
from conveyor.layers.quantization import linear as quantized_linear
from conveyor.layers.quantization.linear import matmul_ops
from conveyor.llm import ONEDNN_MAX_BATCH_TOKENS
from conveyor.models import base
from conveyor.models.loader import ModelLoadError

from tests.utils import TinyModel, greedy, hf_greedy, random_prompts

AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> LLM:
    return tiny_llama.llm(page_size=4, num_blocks=128, max_batch_tokens=16)


def run_all(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be an integer >= 0"),
    ({"min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"max_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"max_tokens": 8, "max_new_tokens": 9}, "max_tokens=8 and max_new_tokens=9 disagree"),
])
def test_bad_sampling_params_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_vllm_max_tokens_is_max_new_tokens(llm: LLM) -> None:
    """vLLM's `SamplingParams(max_tokens=N)` generates N tokens, read back as vLLM reads them; `replace` still
    sees one length setting."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert params.max_new_tokens == params.max_tokens == 5
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off" is ours
    assert replace(params, max_new_tokens=3).max_tokens == 3
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 5
    assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text  # vLLM's shape
    assert out.outputs[0].finish_reason == out.finish_reason == "length"


def test_vllm_prompt_dicts(llm: LLM) -> None:
    """vLLM's `{"prompt_token_ids": ids}` and `{"prompt": text}` give what the ids and the text give; other keys
    are refused by name."""
    params = greedy(3)
    ids, text = [5, 6, 7, 8], "hello there"
    plain = [o.token_ids for o in llm.generate([ids, text], params, use_tqdm=False)]
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], params, use_tqdm=False)
    assert [o.token_ids for o in dicts] == plain and dicts[1].prompt == text
    assert llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids == plain[0]
    with pytest.raises(InvalidRequestError, match=r"not supported: \['multi_modal_data'\]"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, params, use_tqdm=False)
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_bad_prompts_raise_before_anything_is_queued(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[1, 2, 3], ""], greedy(2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], greedy(2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"\(500 tokens\) \+ max_new_tokens \(100\) = 600 exceeds the "
                                                  r"context length of 512 tokens \(max_model_len\)"):
        llm.generate([[5] * 500], greedy(100), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 300\)"):
        llm.generate([[5, 300]], greedy(2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids token ids must be in \[0, 300\), got \[300\]"):
        llm.generate([[5, 6]], SamplingParams(max_new_tokens=2, min_tokens=1, stop_token_ids=[3, 300]), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids must be integers >= 0"):
        SamplingParams(stop_token_ids=[-39225])
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks
    assert llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].num_output_tokens == 3


def test_prompt_larger_than_the_cache_is_refused(tiny_llama: TinyModel) -> None:
    small = tiny_llama.llm(page_size=4, num_blocks=8)
    with pytest.raises(InvalidRequestError, match="exceeds the KV cache capacity of 32 tokens"):
        small.generate([[5] * 40], greedy(1), use_tqdm=False)


def test_bad_model_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="Not a valid GGUF file"):
        LLM(bad)


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive integer"):
        ContinuousBatchingConfig(max_batch_tokens=0)


def test_prompts_on_onednn_take_larger_steps(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a config, a bf16 model whose linears send big inputs to oneDNN's AMX matmul (over weights
    dequantized at each call) takes `ONEDNN_MAX_BATCH_TOKENS` a step; elsewhere, in fp32, or told, not."""
    if matmul_ops() is None:
        pytest.skip("needs the native kernels (the bf16 linears' tiles)")
    default = ContinuousBatchingConfig().max_batch_tokens
    for flags, dtype, kwargs, budget in ((AMX, "bfloat16", {}, ONEDNN_MAX_BATCH_TOKENS),
                                         (AVX512, "bfloat16", {}, default),
                                         (AMX, "float32", {}, default),
                                         (AMX, "bfloat16", {"max_num_batched_tokens": 64}, 64),
                                         (AMX, "bfloat16", {"config": ContinuousBatchingConfig(num_blocks=64)},
                                          default),
                                         (AMX, "bfloat16", {"batch_invariant": True}, default)):
        monkeypatch.setattr(quantized_linear, "cpu_flags", lambda flags=flags: flags)
        llm = LLM(tiny_llama.path, dtype=dtype, **kwargs)
        try:
            assert llm.engine.config.max_batch_tokens == budget, (flags, dtype, kwargs)
        finally:
            llm.shutdown()
    assert ONEDNN_MAX_BATCH_TOKENS > default


# -- blocks come back -----------------------------------------------------------------------
def test_no_leaks_after_finish_cancel_and_failure(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    initial = engine.allocator.num_free_blocks
    prompts = random_prompts([60, 10, 12, 9], seed=1)
    mid_prefill = engine.make_request("mid-prefill", prompts[0], greedy(5))
    mid_decode = engine.make_request("mid-decode", prompts[1], greedy(50))
    failing = engine.make_request("failing", prompts[2], greedy(50))
    healthy = engine.make_request("healthy", prompts[3], greedy(20))
    for r in (mid_decode, failing, healthy, mid_prefill):
        engine.add_request(r)
    original = engine.output_processor.detokenize

    def detokenize(request, token):
        if request is failing and len(request.output_token_ids) == 3:
            raise RuntimeError("injected detokenizer failure")
        return original(request, token)

    monkeypatch.setattr(engine.output_processor, "detokenize", detokenize)
    for _ in range(4):
        engine.step()
    assert mid_prefill.state is RequestState.PREFILLING and 0 < mid_prefill.num_computed_tokens < 60
    assert mid_decode.state is RequestState.DECODING
    engine.cancel_request("mid-prefill")
    engine.cancel_request("mid-decode")
    assert mid_prefill.finish_reason == mid_decode.finish_reason == "abort"
    run_all(engine)
    assert failing.state is RequestState.FAILED and failing.finish_reason == "error"
    assert "injected detokenizer failure" in failing.error
    assert healthy.state is RequestState.FINISHED and len(healthy.output_token_ids) == 20
    assert engine.allocator.num_free_blocks == initial


def test_failed_forward_pass_fails_its_batch_and_engine_keeps_serving(llm: LLM,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    initial = engine.allocator.num_free_blocks
    doomed = engine.make_request("doomed", [5, 6, 7], greedy(5))
    engine.add_request(doomed)

    def broken(chunks):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.step()
    monkeypatch.undo()
    assert doomed.state is RequestState.FAILED and "device fell over" in doomed.error
    assert engine.allocator.num_free_blocks == initial
    out = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 4


def test_request_that_outgrows_the_whole_pool_fails_alone(tiny_llama: TinyModel) -> None:
    small = tiny_llama.llm(page_size=4, num_blocks=10, safety_margin=0.0)
    big, ok = small.generate([[5] * 30, [6] * 3], [greedy(60), greedy(3)], use_tqdm=False)
    assert big.finish_reason == "error" and "40 tokens" in big.error
    assert ok.finish_reason == "length" and ok.num_output_tokens == 3
    assert small.engine.allocator.num_free_blocks == small.engine.allocator.num_total_blocks


# -- sampling -------------------------------------------------------------------------------
def test_seeded_sampling_is_independent_of_batch_composition(llm: LLM) -> None:
    prompt = random_prompts([20], seed=9)[0]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    others = random_prompts([5, 40, 13], seed=10)
    crowd = [SamplingParams(max_new_tokens=30, temperature=0.8, ignore_eos=True), greedy(10),
             SamplingParams(max_new_tokens=16, temperature=1.2, seed=7, ignore_eos=True)]
    batched = llm.generate(others[:2] + [prompt] + others[2:], crowd[:2] + [params] + crowd[2:], use_tqdm=False)
    assert batched[2].token_ids == alone
    different_seed = llm.generate([prompt], SamplingParams(max_new_tokens=24, temperature=1.0, top_k=50,
                                                           top_p=0.95, seed=4321, ignore_eos=True),
                                  use_tqdm=False)[0].token_ids
    assert different_seed != alone


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_leave_one_token_equal_greedy(llm: LLM, filters: dict) -> None:
    prompt = random_prompts([15], seed=11)[0]
    expected = llm.generate([prompt], greedy(12), use_tqdm=False)[0].token_ids
    sampled = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.5, ignore_eos=True, **filters),
                           use_tqdm=False)[0].token_ids
    assert sampled == expected


def test_repetition_penalty_matches_transformers(tiny_llama: TinyModel, llm: LLM) -> None:
    prompt = random_prompts([12], seed=12)[0]
    ours = llm.generate([prompt], greedy(16, repetition_penalty=1.5), use_tqdm=False)[0].token_ids
    ref, _ = hf_greedy(tiny_llama.reference, prompt, 16, repetition_penalty=1.5)
    assert ours == ref
    assert ours != llm.generate([prompt], greedy(16), use_tqdm=False)[0].token_ids


def test_logprobs_are_the_reference_log_softmax(tiny_llama: TinyModel, llm: LLM) -> None:
    prompt = random_prompts([10], seed=13)[0]
    out = llm.generate([prompt], greedy(6, logprobs=3), use_tqdm=False)[0]
    ref, logits = hf_greedy(tiny_llama.reference, prompt, 6)
    assert len(out.logprobs) == 6
    for token, entry, row in zip(out.token_ids, out.logprobs, torch.log_softmax(logits, -1)):
        top = row.topk(3)
        assert set(entry) == set(top.indices.tolist())
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token] == max(entry.values())


# -- stopping -------------------------------------------------------------------------------
def test_stop_token_ids_and_eos(llm: LLM) -> None:
    prompt = random_prompts([8], seed=14)[0]
    free_run = llm.generate([prompt], greedy(20), use_tqdm=False)[0].token_ids
    stop_at = next(i for i, t in enumerate(free_run) if i >= 2 and t not in free_run[:i])
    out = llm.generate([prompt], greedy(20, stop_token_ids=[free_run[stop_at]]), use_tqdm=False)[0]
    assert out.token_ids == free_run[:stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason == free_run[stop_at] == out.outputs[0].stop_reason  # vLLM's: the stop token id
    eos = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[]),
                       use_tqdm=False)[0]
    assert eos.finish_reason in ("stop", "length")
    if eos.finish_reason == "stop":
        assert eos.token_ids[-1] == 2
    assert eos.stop_reason is None  # an EOS is no stop token of the request


def test_stop_string_across_a_token_boundary(llm: LLM) -> None:
    prompt = random_prompts([8], seed=15)[0]
    free = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    words = free.text.split()  # one word per token with this tokenizer
    stop = words[3][-1] + " " + words[4][:2]  # spans the boundary between tokens 4 and 5
    cut = free.text.index(stop)
    out = llm.generate([prompt], greedy(12, stop=["never there", stop, stop[1:]]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # the earliest match in the text
    assert out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[:5]


@torch.inference_mode()
def test_presence_and_frequency_penalties_match_a_reference_loop(tiny_llama: TinyModel, llm: LLM) -> None:
    prompt = random_prompts([6], seed=16)[0]
    presence, frequency = 0.7, 1.3
    ids = list(prompt)
    for _ in range(14):
        logits = tiny_llama.reference(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.shape[0]).float()
        ids.append(int((logits - frequency * counts - presence * (counts > 0).float()).argmax()))
    ours = llm.generate([prompt], greedy(14, presence_penalty=presence, frequency_penalty=frequency),
                        use_tqdm=False)[0].token_ids
    assert ours == ids[len(prompt):]


def test_min_tokens_holds_back_stops(llm: LLM) -> None:
    prompt = random_prompts([8], seed=17)[0]
    free_run = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    first = free_run.token_ids[0]
    stopped = llm.generate([prompt], greedy(12, stop_token_ids=[first]), use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([prompt], greedy(12, stop_token_ids=[first], min_tokens=4), use_tqdm=False)[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:4]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=3, min_tokens=4)


def test_stats_count_tokens_and_show_the_cache(tiny_llama: TinyModel) -> None:
    fresh = tiny_llama.llm(page_size=4, num_blocks=64)
    prompts = random_prompts([7, 12], seed=18)
    outputs = fresh.generate(prompts, greedy(5), use_tqdm=False)
    stats = fresh.stats()
    assert stats.prompt_tokens == stats.prefill_tokens == 19
    assert stats.generation_tokens == sum(o.num_output_tokens for o in outputs) == 10
    assert stats.finished_requests == 2 and stats.soft_resets == 0
    assert stats.free_blocks == stats.total_blocks == 64 and stats.kv_cache_usage == 0.0
    assert stats.running_requests == stats.waiting_requests == 0


def test_the_last_layer_computes_only_the_rows_a_step_reads(tiny_llama: TinyModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill reads one row of a chunk (its sample): the last layer's MLP sees those rows alone, every
    row with prompt logprobs, and the tokens and logprobs are those of the full pass's rows."""
    llm = tiny_llama.llm(page_size=4, max_batch_tokens=64)
    last = llm.engine.model.layers[-1].gate_up_proj
    seen: list[int] = []
    handle = last.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    prompts = random_prompts([30, 12, 7], seed=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    try:
        narrowed = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert seen[0] == 3 and set(seen) == {3}  # one prefill of 49 tokens, then three decode rows a step
        seen.clear()
        with_prompt = llm.generate([{"prompt_token_ids": prompts[0]}], scored, use_tqdm=False)[0]
        assert seen[0] == 30
        monkeypatch.setattr(base, "selects_rows", lambda layer_type: False)
        full = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": prompts[0]}], scored, use_tqdm=False)[0]
    finally:
        handle.remove()
        llm.shutdown()
    for a, b in zip(narrowed, full):  # (an fp32 GEMM over 3 rows or 49 may round apart: 1e-5)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(x[t] == pytest.approx(y[t], abs=1e-5) for t in x)
    assert with_prompt.prompt_logprobs == again.prompt_logprobs
