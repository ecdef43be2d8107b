"""The engine-to-event-loop hand-off and the coalescing of a request's outputs: every output arrives, in
order, finished ones included; outputs that wait for a busy consumer merge into one; the waker thread
ends with the server; a stream's chunk events are the same JSON the plain serializer writes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from conveyor import SamplingParams
from conveyor.request import RequestOutput
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.handoff import Handoff
from conveyor.server.observers import RequestObservers
from conveyor.server.submission import Submission, coalesce
from conveyor.server.streaming import ChunkTemplate, sse

from tests.utils import TinyModel


def output(request_id: str, ids: list[int], delta: int, finished: bool = False) -> RequestOutput:
    """The snapshot after `ids`, the last `delta` of them new ("t<id>" per token)."""
    text = "".join(f"t{i}" for i in ids)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1], text=text, token_ids=list(ids),
                         finished=finished, finish_reason="length" if finished else None,
                         delta_text="".join(f"t{i}" for i in ids[len(ids) - delta:]),
                         delta_token_ids=ids[len(ids) - delta:])


def test_items_put_from_another_thread_all_run_on_the_loop_in_order() -> None:
    async def main() -> tuple[list[int], set[int], bool]:
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        seen: list[int] = []
        threads: set[int] = set()
        done = asyncio.Event()

        def take(i: int) -> None:
            seen.append(i)
            threads.add(threading.get_ident())
            if i == 1999:
                done.set()

        def engine() -> None:
            for i in range(2000):
                handoff.put(take, i)
                if i % 100 == 0:
                    time.sleep(0.001)  # let some wake-ups land between bursts

        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(done.wait(), 30)
        thread.join(5)
        handoff.close()
        return seen, threads, handoff.thread.is_alive()

    seen, threads, waker_alive = asyncio.run(main())
    assert seen == list(range(2000))
    assert threads == {threading.main_thread().ident}
    assert not waker_alive


def test_items_put_while_a_wake_up_is_pending_ride_along() -> None:
    """A burst put while the loop is busy costs one wake-up, not one per item."""
    async def main() -> tuple[int, list[int]]:
        handoff = Handoff(asyncio.get_running_loop())
        runs = 0
        original = handoff.run

        def counted() -> None:
            nonlocal runs
            runs += 1
            original()

        handoff.run = counted  # type: ignore[method-assign]
        seen: list[int] = []
        for i in range(50):  # the loop is busy here: nothing runs until this coroutine yields
            handoff.put(seen.append, i)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(seen) == 50:
                break
        handoff.close()
        return runs, seen

    runs, seen = asyncio.run(main())
    assert seen == list(range(50)) and runs == 1


def test_a_failing_consumer_does_not_strand_the_others(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[int]:
        handoff = Handoff(asyncio.get_running_loop())
        seen: list[int] = []

        def broken(_: int) -> None:
            raise ValueError("a consumer's bug")

        handoff.put(seen.append, 1)
        handoff.put(broken, 2)
        handoff.put(seen.append, 3)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(seen) == 2:
                break
        handoff.close()
        return seen

    assert asyncio.run(main()) == [1, 3]
    assert "delivering an engine output failed" in caplog.text


def test_a_put_after_the_loop_closed_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    handoff = Handoff(loop)
    loop.close()
    handoff.put(print, "never")
    handoff.thread.join(5)  # the waker finds the loop closed and ends
    assert not handoff.thread.is_alive()


def submission(n: int) -> Submission:
    """A submission of `n` requests over a stand-in for the server's bookkeeping (no engine)."""
    serving = SimpleNamespace(in_flight=n, active=set(), observers=RequestObservers([]))
    sub = Submission(serving, [SimpleNamespace(request_id=f"r{i}") for i in range(n)])  # type: ignore[arg-type]
    serving.active.add(sub)
    return sub


def test_outputs_waiting_for_the_consumer_merge_and_finished_ones_are_never_lost() -> None:
    async def main() -> tuple[list[tuple[int, RequestOutput]], Submission]:
        sub = submission(2)
        for k in range(1, 4):  # three steps of r0 and one of r1 before the consumer looks
            sub._arrive(output("r0", list(range(k)), 1))
        sub._arrive(output("r1", [7], 1))
        taken = []
        async for i, out in sub.outputs():
            taken.append((i, out))
            if len(taken) == 2:  # while the consumer sends, r0 finishes and r1 steps and finishes
                sub._arrive(output("r0", [0, 1, 2, 3], 1, finished=True))
                sub._arrive(output("r1", [7, 8], 1))
                sub._arrive(output("r1", [7, 8, 9], 1, finished=True))
        return taken, sub

    taken, sub = asyncio.run(main())
    assert [(i, o.delta_token_ids, o.delta_text, o.finished) for i, o in taken] == [
        (0, [0, 1, 2], "t0t1t2", False), (1, [7], "t7", False),
        (0, [3], "t3", True), (1, [8, 9], "t8t9", True)]
    assert taken[3][1].token_ids == [7, 8, 9] and taken[3][1].finish_reason == "length"
    assert sub.serving.in_flight == 0 and not sub.serving.active and not sub.unfinished


def test_coalesce_keeps_the_later_snapshot_and_both_deltas() -> None:
    merged = coalesce(output("r", [1, 2], 2), output("r", [1, 2, 3], 1, finished=True))
    assert (merged.token_ids, merged.delta_token_ids, merged.delta_text, merged.text, merged.finished) == (
        [1, 2, 3], [1, 2, 3], "t1t2t3", "t1t2t3", True)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chunk_template_writes_what_the_plain_serializer_writes(include_usage: bool) -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": 'm "q" é'}
    choice = {"index": 0, "delta": {"content": 'a "choices":[null] ü\n'}, "finish_reason": None}
    expected = sse(head | {"choices": [choice]} | ({"usage": None} if include_usage else {}))
    written = ChunkTemplate(head, include_usage)(choice)
    assert written == expected
    assert json.loads(written.removeprefix("data: "))["choices"] == [choice]


def test_streams_carry_every_token_and_the_waker_ends_with_the_server(tmp_path) -> None:
    """Two choices streamed at once: their deltas add up to what LLM.generate writes, token for token; the
    KV pool is whole again after; the hand-off's thread is gone once the server has stopped."""
    llm = TinyModel("llama", tmp_path).llm()
    free = llm.engine.allocator.num_free_blocks
    expected = llm.generate(["w5 w6 w7"], SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0))[0]
    body = {"prompt": "w5 w6 w7", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "n": 2, "stream": True,
            "logprobs": 0}
    with BackgroundServer(llm, ServerSettings()) as url:
        texts, tokens = ["", ""], [0, 0]
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    texts[choice["index"]] += choice["text"]
                    tokens[choice["index"]] += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
        wakers = [t for t in threading.enumerate() if t.name == "conveyor-handoff"]
        assert len(wakers) == 1
    assert texts == [expected.text] * 2 and tokens == [24, 24]
    assert llm.engine.allocator.num_free_blocks == free
    assert not wakers[0].is_alive()
