"""Deadlines (`SamplingParams.request_timeout`): a request still waiting or running past its deadline ends
with finish reason "timeout" and an error saying where it was, its blocks back in the pool (also when a
step in flight holds them, with async batching); requests without a deadline are not touched."""

from __future__ import annotations

import time

import pytest

from conveyor import RequestState, SamplingParams
from conveyor.sampling_params import SamplingParamsError

from tests.utils import TinyModel, all_free, greedy


@pytest.mark.parametrize("value", [0, -1.0, True, float("inf"), "5"])
def test_request_timeout_is_a_positive_number_of_seconds(value: object) -> None:
    with pytest.raises(SamplingParamsError, match="request_timeout must be a number of seconds > 0"):
        SamplingParams(request_timeout=value)


@pytest.mark.parametrize("use_async", [False, True])
def test_waiting_and_running_requests_past_their_deadline_end(tiny_llama: TinyModel, one_thread: None,
                                                              use_async: bool) -> None:
    llm = tiny_llama.llm(num_blocks=64, max_requests_per_batch=1, use_async_batching=use_async)
    engine = llm.engine
    running = llm.make_request("running", [5, 6, 7, 8], greedy(300, request_timeout=1.0))
    waiting = llm.make_request("waiting", [9, 10, 11], greedy(300, request_timeout=1.0))
    later = llm.make_request("later", [5, 6], greedy(3))  # no deadline
    for request in (running, waiting, later):
        engine.add_request(request)
    for _ in range(3):
        assert not [r for r in engine.step() if r.is_finished]
    assert running.output_token_ids and waiting.state is RequestState.PENDING
    assert engine.allocator.num_free_blocks < engine.allocator.num_total_blocks
    time.sleep(1.0)
    ended = [r for r in engine.step() if r.is_finished]
    assert [r.request_id for r in ended] == ["running", "waiting"]
    assert [(r.finish_reason, r.state) for r in ended] == [("timeout", RequestState.FAILED)] * 2
    assert running.error.startswith("the request did not finish within its request_timeout of 1 s (running, ")
    assert "waiting in the queue for 1." in waiting.error
    while engine.has_unfinished_requests():
        engine.step()
    assert (later.finish_reason, len(later.output_token_ids)) == ("length", 3)
    assert all_free(llm) and not engine.requests
    llm.shutdown()


def test_generate_with_a_deadline(tiny_llama: TinyModel, one_thread: None) -> None:
    """Offline too: a request that cannot finish in time comes back with its timeout, the others whole."""
    llm = tiny_llama.llm(num_blocks=64, max_requests_per_batch=1)
    slow, quick = llm.generate([[5, 6, 7], [8, 9]], [greedy(500, request_timeout=0.05), greedy(4)], use_tqdm=False)
    assert (slow.finish_reason, quick.finish_reason, quick.num_output_tokens) == ("timeout", "length", 4)
    assert slow.num_output_tokens < 500 and "request_timeout of 0.05 s" in slow.error
    assert all_free(llm)
    llm.shutdown()
