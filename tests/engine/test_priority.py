"""Priority scheduling end to end (vLLM's `scheduling_policy="priority"`): with two slots (max_num_seqs 2), six
long requests of priority 10 and then a short one of priority 0: the short one preempts a long one, gets its
first token in the step after it arrives and finishes before most of them (first come, first served: after
all six); the preempted ones' greedy outputs are unchanged (soft reset or swap), and every block comes back."""

from __future__ import annotations

import pytest

from conveyor import LLM, InvalidRequestError

from tests.utils import TinyModel, all_free, greedy, random_prompts

LONG, SHORT = 40, 5
PROMPTS = random_prompts([12, 9, 15, 11, 8, 14, 6], seed=1)  # six long requests, then the short one


def timeline(llm: LLM, long_priority: int, short_priority: int) -> tuple[list[str], int, int, dict[str, list[int]]]:
    """Step the engine: the long requests first, the short one after 3 steps. (finish order, the step the
    short one arrived before, the step of its first token, every request's tokens)."""
    engine = llm.engine
    requests = [llm.make_request(f"long{i}", p, greedy(LONG, priority=long_priority)) for i, p in enumerate(PROMPTS[:6])]
    short = llm.make_request("short", PROMPTS[6], greedy(SHORT, priority=short_priority))
    for request in requests:
        engine.add_request(request)
    order, step, arrived, first_token = [], 0, 0, 0
    while engine.has_unfinished_requests():
        if step == 3:
            engine.add_request(short)
            arrived = step
        updated = engine.step()
        step += 1
        if short in updated and not first_token:
            first_token = step
        order += [r.request_id for r in updated if r.is_finished]
    return order, arrived, first_token, {r.request_id: r.output_token_ids for r in requests + [short]}


@pytest.mark.parametrize("swap_space", [0.0, 0.01])
def test_a_short_urgent_request_overtakes_six_long_ones(tiny_llama: TinyModel, one_thread: None,
                                                       swap_space: float) -> None:
    llm = tiny_llama.llm(num_blocks=64, max_requests_per_batch=2, scheduler_type="priority",
                         cpu_offload_space=swap_space)
    reference = [o.token_ids for o in llm.generate(PROMPTS, [greedy(LONG)] * 6 + [greedy(SHORT)], use_tqdm=False)]
    order, arrived, first_token, tokens = timeline(llm, long_priority=10, short_priority=0)
    assert order.index("short") <= 1, order  # before at least five of the six
    assert first_token - arrived <= 2  # admitted at once: it preempted a long one
    stats = llm.stats()
    assert stats.offloads >= 1 and (stats.swap_outs >= 1 if swap_space else stats.soft_resets >= 1)
    assert [tokens[f"long{i}"] for i in range(6)] + [tokens["short"]] == reference  # preempted: outputs unchanged
    assert all_free(llm) and not llm.engine.requests
    llm.shutdown()


def test_first_come_first_served_for_contrast(tiny_llama: TinyModel, one_thread: None) -> None:
    llm = tiny_llama.llm(num_blocks=64, max_requests_per_batch=2)
    order, _, _, _ = timeline(llm, long_priority=0, short_priority=0)
    assert order[-1] == "short" and llm.stats().offloads == 0
    with pytest.raises(InvalidRequestError, match="priority 3 needs priority scheduling"):
        llm.generate([PROMPTS[0]], greedy(2), priority=3)
    assert all_free(llm)
    llm.shutdown()


def test_generate_takes_vllms_priority(tiny_llama: TinyModel, one_thread: None) -> None:
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, max_num_seqs=1,
              scheduling_policy="priority")  # vLLM's names
    outputs = llm.generate(PROMPTS[:3], greedy(3), priority=[5, 0, 5], use_tqdm=False)
    assert [o.num_output_tokens for o in outputs] == [3, 3, 3]
    ends = [o.metrics.finished_time for o in outputs]
    assert ends[1] < ends[0] < ends[2]  # priority 0 first, then the two 5s by arrival
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(PROMPTS[:3], greedy(3), priority=[1, 2])
    assert all_free(llm)
    llm.shutdown()
