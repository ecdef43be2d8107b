"""Async batching on CPU (the forward on a worker thread, tokens read back one step behind) gives the
synchronous engine's outputs, fp32, on mixed workloads, and returns every block."""

from __future__ import annotations

import pytest

from conveyor import SamplingParams
from conveyor.request import RequestState


def run_all(engine) -> None:
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def workload(reference_tokens: list[list[int]] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5 + (7 * i + j) % 290 for j in range(n)] for i, n in enumerate((4, 23, 41, 9, 15, 30, 6, 12))]
    params = [SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=0),  # EOS allowed
              SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=11),
              SamplingParams(max_new_tokens=14, temperature=1.2, top_k=20, seed=3, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=18, temperature=0, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=5),
              SamplingParams(max_new_tokens=25, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=22, temperature=0, ignore_eos=True)]
    if reference_tokens is not None:  # stops taken from the synchronous run's own outputs, mid-generation
        params[6] = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[reference_tokens[6][4]])
        params[7] = SamplingParams(max_new_tokens=22, temperature=0, ignore_eos=True, stop=[f"w{reference_tokens[7][6]}"])
    return prompts, params


@pytest.mark.parametrize("options", [{}, {"pad_steps": True}], ids=["eager", "padded"])
def test_async_equals_sync_on_a_mixed_workload(tiny_models, options: dict) -> None:
    model = tiny_models["llama"]
    sync = model.llm(max_batch_tokens=32, page_size=4)
    prompts, params = workload()
    first = sync.generate(prompts, params, use_tqdm=False)
    prompts, params = workload([o.token_ids for o in first])
    ref = sync.generate(prompts, params, use_tqdm=False)
    assert ref[6].finish_reason == ref[7].finish_reason == "stop"
    llm = model.llm(max_batch_tokens=32, page_size=4, use_async_batching=True, **options)
    engine = llm.engine
    assert engine.pipeline is not None and len(engine.runner.buffers) == (2 if options else 0)
    initial = engine.allocator.num_free_blocks
    outs = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outs, ref):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert [list(d) for d in outs[5].logprobs] == [list(d) for d in ref[5].logprobs]
    assert engine.allocator.num_free_blocks == initial
    assert llm.stats().generation_tokens == sum(len(o.token_ids) for o in outs)  # discarded ones not counted


def test_async_cancellation_and_failure_return_every_block(tiny_models) -> None:
    model = tiny_models["llama"]
    llm = model.llm(max_batch_tokens=32, page_size=4, use_async_batching=True)
    engine = llm.engine
    initial = engine.allocator.num_free_blocks
    prompts = [[5 + (i + j) % 290 for j in range(n)] for i, n in enumerate((120, 10, 12, 9))]
    greedy = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (5, 40, 40, 12)]
    ref = [o.token_ids for o in model.llm(max_batch_tokens=32, page_size=4).generate(prompts, greedy, use_tqdm=False)]
    requests = [engine.make_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, greedy))]
    for r in requests:
        engine.add_request(r)
    original = engine.output_processor.detokenize

    def detokenize(request, token):
        if request is requests[2] and len(request.output_token_ids) == 3:
            raise RuntimeError("injected detokenizer failure")
        return original(request, token)

    engine.output_processor.detokenize = detokenize
    for _ in range(3):
        engine.step()
    assert requests[0].state is RequestState.PREFILLING  # cancelled mid-prefill, while a step holds it
    engine.cancel_request("r0")
    for _ in range(4):
        engine.step()
    assert requests[1].state is RequestState.DECODING
    engine.cancel_request("r1")  # mid-decode, its next token already in flight
    assert -1 not in requests[1].output_token_ids
    run_all(engine)
    assert [r.finish_reason for r in requests] == ["abort", "abort", "error", "length"]
    assert requests[3].output_token_ids == ref[3]
    assert requests[1].output_token_ids == ref[1][:len(requests[1].output_token_ids)]
    assert not engine.pipeline.busy and not engine.pipeline.deferred
    assert engine.allocator.num_free_blocks == initial


@pytest.mark.parametrize("swap_space", [0.01, 0.0], ids=["swapped", "recomputed"])
def test_async_offload_of_a_request_in_flight(tiny_models, swap_space: float) -> None:
    """A pool too small for the batch: requests whose last step is still in flight are swapped out (or reset
    and recomputed); the same tokens as the synchronous engine with room, and every block comes back."""
    model = tiny_models["llama"]
    prompts, params = workload()
    ref = model.llm(max_batch_tokens=32, page_size=4).generate(prompts, params, use_tqdm=False)
    llm = model.llm(num_blocks=24, page_size=4, max_batch_tokens=32, safety_margin=0.0,
                    cpu_offload_space=swap_space, use_async_batching=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    stats = llm.engine.counters
    assert (stats.swap_outs if swap_space else stats.soft_resets) > 0
    assert not llm.engine.pipeline.busy and not llm.engine.pipeline.deferred
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_async_forward_failure_fails_its_requests_and_keeps_serving(tiny_models) -> None:
    llm = tiny_models["llama"].llm(use_async_batching=True)
    engine = llm.engine
    initial = engine.allocator.num_free_blocks
    doomed = engine.make_request("doomed", [5, 6, 7], SamplingParams(max_new_tokens=5, temperature=0))
    engine.add_request(doomed)
    launch = engine.runner.launch

    def broken(step):
        raise RuntimeError("device fell over")

    engine.runner.launch = broken
    run_all(engine)
    engine.runner.launch = launch
    assert doomed.state is RequestState.FAILED and "device fell over" in doomed.error
    assert engine.allocator.num_free_blocks == initial
    out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 4


def test_step_history_records_async_and_padded_steps(tiny_models) -> None:
    """The dashboard's ring gets every step of the async pipeline, with the padded shapes' padding rows."""
    llm = tiny_models["llama"].llm(use_async_batching=True, pad_steps=True, step_history=50)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    total, records = llm.engine.step_history.snapshot()
    assert total == len(records) >= 6
    assert sum(r.prefill_tokens for r in records) == 8
    assert sum(r.sampled_tokens for r in records) == sum(len(o.token_ids) for o in outs)
    assert all(r.padding_tokens > 0 for r in records)  # 2 rows padded to q_padding_interval_size
    assert all(r.duration > 0 for r in records)
