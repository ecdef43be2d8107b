"""vLLM's thinking_token_budget: the count of reasoning tokens and its forced end, as a state machine over
made-up token ids, then on the built-in model (fp32, async batching on, so that budgeted requests must
turn it off): the first N tokens of a reasoning prompt are the free run's, then the end marker's tokens,
then what greedy decoding gives after them; neighbours unchanged; every block back; the errors."""

from __future__ import annotations

import pytest

from conveyor import LLM, ReasoningConfig, SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.sampling_params import SamplingParamsError
from conveyor.thinking_budget import ReasoningMarkers, ThinkingBudget

from tests.utils import greedy, idle

START, END = (7, 8), (9,)  # "<think>" as two tokens, "</think>" as one
MARKERS = ReasoningMarkers(starts=(START,), ends=(END,), forced=(5, *END))


def run(budget: ThinkingBudget, wanted: list[int]) -> list[int]:
    """The tokens a reply gives when the model would write `wanted` (a forced token replaces its draw)."""
    out = []
    for token in wanted:
        token = budget.forced_token if budget.forced_token is not None else token
        budget.advance(token)
        out.append(token)
    return out


def test_the_count_starts_where_a_block_opens_and_the_end_is_forced_at_the_budget() -> None:
    opened = ThinkingBudget(MARKERS, 3, [1, *START, 2])  # the prompt opened a block
    assert run(opened, [11, 12, 13, 14, 15, 16]) == [11, 12, 13, 5, 9, 16] and opened.used == 3
    closed = ThinkingBudget(MARKERS, 3, [*START, 2, *END, 1])  # ... and closed it: the reply is the answer
    assert run(closed, [11, 12, 13, 14]) == [11, 12, 13, 14] and closed.used == 0
    later = ThinkingBudget(MARKERS, 2, [1, 2])  # the reply opens its own block
    assert run(later, [11, *START, 12, 13, 14, 15, 16]) == [11, 7, 8, 12, 13, 5, 9, 16]
    natural = ThinkingBudget(MARKERS, 3, [*START])  # the model ends it first: nothing forced
    assert run(natural, [11, 9, 12, 13, 14]) == [11, 9, 12, 13, 14] and natural.used == 1
    second = ThinkingBudget(MARKERS, 3, [*START])  # a second block gets what the first left
    assert run(second, [11, 12, 9, 7, 8, 13, 14, 15]) == [11, 12, 9, 7, 8, 13, 5, 9]
    none = ThinkingBudget(MARKERS, 0, [*START])  # 0: forced at once
    assert none.forced_token == 5 and run(none, [11, 12, 13]) == [5, 9, 13]
    unmarked = ReasoningMarkers(starts=(START,), ends=(END,), forced=END, opens_unmarked=True)  # DeepSeek-R1
    assert run(ThinkingBudget(unmarked, 1, [1, 2]), [11, 12, 13]) == [11, 9, 13]
    assert run(ThinkingBudget(unmarked, 1, [1, *END]), [11, 12, 13]) == [11, 12, 13]


def test_markers_from_a_parser_or_strings() -> None:
    class Words:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(w) for w in text.split()]

    qwen3 = ReasoningConfig.of(None, "qwen3").markers(Words())  # one "word" each: ids are lengths here
    assert qwen3 == ReasoningMarkers(starts=((7,),), ends=((8,),), forced=(8,))
    r1 = ReasoningConfig.of({"reasoning_parser": "deepseek_r1"}).markers(Words())
    assert r1.opens_unmarked
    phrase = ReasoningConfig.of({"reasoning_end_str": "so the answer </think>"}, "qwen3").markers(Words())
    assert phrase.forced == (2, 3, 6, 8) and phrase.ends == ((8,),)  # forced with the phrase, ended by the marker
    with pytest.raises(ValueError, match="reasoning_start_str"):
        ReasoningConfig.of(None, "openai_gptoss").markers(Words())
    with pytest.raises(ValueError, match="reasoning_end"):
        ReasoningConfig.of({"reasoning_end": "x"})
    assert ReasoningConfig.of(None) is None
    with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "no limit"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", async_scheduling=True,
               reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})


def test_the_first_tokens_are_free_then_the_end_then_greedy_after_it(llm: LLM) -> None:
    prompt = llm.tokenizer.encode(llm.render_chat_text([{"role": "user", "content": "What is 12 times 7?"}])
                                  + "<think>\n")
    other = llm.tokenizer.encode("The three primary colours are")
    forced = list(llm.reasoning_markers.forced)
    assert len(forced) > 1  # "</think>" is several tokens of this vocabulary: each forced in turn
    free, neighbour = (o.outputs[0] for o in llm.generate([prompt, other], greedy(12), use_tqdm=False))
    budgeted = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_token_budget=4, logprobs=0)
    out, beside = (o.outputs[0] for o in llm.generate([prompt, other], [budgeted, greedy(12)], use_tqdm=False))
    ids = list(out.token_ids)
    assert ids[:4] == list(free.token_ids[:4]) and ids[4:4 + len(forced)] == forced != list(free.token_ids[4:7])
    after = llm.generate([prompt + ids[:4 + len(forced)]], greedy(12 - 4 - len(forced)), use_tqdm=False)[0]
    assert ids[4 + len(forced):] == list(after.outputs[0].token_ids)  # the forced tokens are in the cache
    assert beside.token_ids == neighbour.token_ids  # the batch's other request is its own
    first = out.logprobs[4][forced[0]]  # the model's own logprob of the forced token, not 0
    assert first < -1 and first.rank > 1
    assert "</think>" in out.text and idle(llm)


def test_sampled_requests_and_a_budget_of_zero(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("<think>\nLet me see.")
    forced = list(llm.reasoning_markers.forced)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True, thinking_token_budget=b)
              for s, b in ((1, 0), (2, 2), (3, 5))]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert [list(o[b:b + len(forced)]) for o, b in zip(outs, (0, 2, 5))] == [forced] * 3
    answer = llm.tokenizer.encode("No block here:")  # the prompt opens no block: nothing counts
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [a, b] = llm.generate([answer] * 2, [plain, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                               thinking_token_budget=0)], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and idle(llm)


def test_a_budget_needs_markers_and_no_constraint(llm: LLM) -> None:
    from conveyor.sampling_params import StructuredOutputsParams

    with pytest.raises(InvalidRequestError, match="structured_outputs") as refused:
        llm.generate(["Hi"], SamplingParams(thinking_token_budget=3,
                                            structured_outputs=StructuredOutputsParams(choice=["a", "b"])))
    assert refused.value.param == "thinking_token_budget"
    markers = llm.reasoning_markers
    llm.engine.set_reasoning_markers(None)
    try:
        with pytest.raises(InvalidRequestError, match="reasoning_parser"):
            llm.generate(["Hi"], SamplingParams(thinking_token_budget=3))
    finally:
        llm.engine.set_reasoning_markers(markers)
    assert idle(llm)
