"""The background manager: streaming as tokens arrive, prompt cancellation, results, CLI."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conveyor import LLM, ContinuousBatchingManager, SamplingParams
from conveyor.cli import main as cli_main

from tests.utils import TinyModel, greedy, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> LLM:
    return tiny_llama.llm(page_size=4, num_blocks=256, max_batch_tokens=32)


def test_streams_tokens_as_they_arrive(llm: LLM) -> None:
    prompts = random_prompts([12, 30, 5], seed=20)
    expected = llm.generate(prompts, greedy(15), use_tqdm=False)
    with ContinuousBatchingManager(llm.engine) as manager:
        ids = [manager.add_request(p, greedy(15), streaming=True) for p in prompts]
        for rid, ref in zip(ids, expected):
            chunks = list(manager.request_id_iter(rid))
            assert len(chunks) > 1 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
            assert [t for c in chunks for t in c.delta_token_ids] == ref.token_ids
            assert "".join(c.delta_text for c in chunks) == ref.text == chunks[-1].text
            times = chunks[-1].metrics.token_times
            assert len(times) == 15 and times == sorted(times)
            assert chunks[-1].metrics.queue_time >= 0 and chunks[-1].metrics.time_to_first_token > 0
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_cancel_request_ends_it_promptly(llm: LLM) -> None:
    with ContinuousBatchingManager(llm.engine) as manager:
        long_id = manager.add_request(random_prompts([20], seed=21)[0], greedy(480), streaming=True)
        other_id = manager.add_request(random_prompts([8], seed=22)[0], greedy(10))
        stream = manager.request_id_iter(long_id)
        first = next(stream)
        assert not first.finished
        cancelled_at = time.monotonic()
        manager.cancel_request(long_id)
        last = list(stream)[-1]
        assert time.monotonic() - cancelled_at < 2.0
        assert last.finished and last.finish_reason == "abort" and last.num_output_tokens < 480
        other = manager.get_result(other_id, timeout=30)
        assert other is not None and other.finish_reason == "length" and other.num_output_tokens == 10
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_get_result_any_order_and_timeout(llm: LLM) -> None:
    with ContinuousBatchingManager(llm.engine) as manager:
        ids = {manager.add_request(p, greedy(n)) for p, n in zip(random_prompts([4, 9], seed=23), (3, 6))}
        got = {manager.get_result(timeout=30).request_id for _ in ids}
        assert got == ids
        assert manager.get_result(timeout=0.05) is None
        with pytest.raises(ValueError, match="temperature"):
            manager.add_request([5, 6], SamplingParams(temperature=-1))
        with pytest.raises(KeyError, match="not a streaming request"):
            next(manager.request_id_iter("req-unknown"))


def test_stop_aborts_requests_in_flight(llm: LLM) -> None:
    manager = ContinuousBatchingManager(llm.engine).start()
    rid = manager.add_request(random_prompts([10], seed=24)[0], greedy(480), streaming=True)
    stream = manager.request_id_iter(rid)
    assert not next(stream).finished
    manager.stop()
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort" and last.num_output_tokens < 480
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_cli_generate(tiny_llama: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["generate", "w5 w6 w7", "--raw", "--model", str(tiny_llama.path), "--max-new-tokens", "4",
                     "--num-blocks", "64", "--ignore-eos"])
    out = capsys.readouterr().out
    assert code == 0
    assert "### w5 w6 w7" in out and "[4 tokens, finish_reason=length]" in out


def test_cli_reports_bad_input(tiny_llama: TinyModel) -> None:
    result = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "hi", "--model",
                             str(tiny_llama.path / "missing")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "does not exist" in result.stderr
