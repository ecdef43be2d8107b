"""A reply's place against its reasoning block: vLLM's thinking_token_budget (the count and the forced end)
and its structured outputs after the reasoning, as a state machine over made-up token ids, then on the
built-in model (fp32, async batching on, so that these requests must turn it off): the first N tokens of a
reasoning prompt are the free run's, then the end marker's tokens, then what greedy decoding gives after
them; a grammar masks only the answer; neighbours unchanged; every block back; the errors."""

from __future__ import annotations

import pytest

from conveyor import LLM, ReasoningConfig, SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.sampling_params import SamplingParamsError
from conveyor.reasoning_state import ReasoningMarkers, ReasoningState, last_index

from tests.utils import greedy, idle

START, END = (7, 8), (9,)  # "<think>" as two tokens, "</think>" as one
MARKERS = ReasoningMarkers(starts=(START,), ends=(END,), forced=(5, *END))


def run(state: ReasoningState, wanted: list[int], answer: list[int] | None = None) -> list[int]:
    """The tokens a reply gives when the model would write `wanted` (a forced token replaces its draw);
    `answer` collects those `advance` calls the answer's."""
    out = []
    for token in wanted:
        token = state.forced_token if state.forced_token is not None else token
        if state.advance(token) and answer is not None:
            answer.append(token)
        out.append(token)
    return out


def test_the_count_starts_where_a_block_opens_and_the_end_is_forced_at_the_budget() -> None:
    assert last_index([1, 7, 8, 2, 8], (START,)) == 3 and last_index([8, 7], (START,)) == -1  # where a marker ends
    assert last_index([7, 8, 1, 9, 7, 8], (START, END)) == 6 and last_index([7, 8, 1, 9, 2], (START, END)) == 4
    opened = ReasoningState(MARKERS, [1, *START, 2], 3)  # the prompt opened a block
    assert run(opened, [11, 12, 13, 14, 15, 16]) == [11, 12, 13, 5, 9, 16] and opened.used == 3
    closed = ReasoningState(MARKERS, [*START, 2, *END, 1], 3)  # ... and closed it: the reply is the answer
    assert run(closed, [11, 12, 13, 14]) == [11, 12, 13, 14] and closed.used == 0
    later = ReasoningState(MARKERS, [1, 2], 2)  # the reply opens its own block
    assert run(later, [11, *START, 12, 13, 14, 15, 16]) == [11, 7, 8, 12, 13, 5, 9, 16]
    natural = ReasoningState(MARKERS, [*START], 3)  # the model ends it first: nothing forced
    assert run(natural, [11, 9, 12, 13, 14]) == [11, 9, 12, 13, 14] and natural.used == 1
    second = ReasoningState(MARKERS, [*START], 3)  # a second block gets what the first left
    assert run(second, [11, 12, 9, 7, 8, 13, 14, 15]) == [11, 12, 9, 7, 8, 13, 5, 9]
    none = ReasoningState(MARKERS, [*START], 0)  # 0: forced at once
    assert none.forced_token == 5 and run(none, [11, 12, 13]) == [5, 9, 13]
    unmarked = ReasoningMarkers(starts=(START,), ends=(END,), forced=END, opens_unmarked=True)  # DeepSeek-R1
    assert run(ReasoningState(unmarked, [1, 2], 1), [11, 12, 13]) == [11, 9, 13]
    assert run(ReasoningState(unmarked, [1, *END], 1), [11, 12, 13]) == [11, 12, 13]


def test_a_gated_grammar_sees_the_answer_only() -> None:
    answer: list[int] = []
    opened = ReasoningState(MARKERS, [*START], 2, gated=True)  # reasoning, its end forced, then the answer
    assert not opened.grammar_applies and opened.opening_token is None
    assert run(opened, [11, 12, 13, 14, 15], answer) == [11, 12, 5, 9, 15] and answer == [15]
    assert opened.grammar_applies
    answer = []
    fresh = ReasoningState(MARKERS, [1], gated=True)  # may open at its first token: the marker's rest forced
    assert fresh.grammar_applies and fresh.opening_token == 7
    assert run(fresh, [7, 20, 11, 9, 14, 15], answer) == [7, 8, 11, 9, 14, 15] and answer == [14, 15]
    answer = []
    plain = ReasoningState(MARKERS, [1], gated=True)  # any other first token begins the answer, for good
    assert run(plain, [14, 7, 8, 11], answer) == [14, 7, 8, 11] and answer == [14, 7, 8, 11]
    assert plain.opening_token is None and plain.grammar_applies
    closed = ReasoningState(MARKERS, [*START, 2, *END], gated=True)  # the prompt closed it: no opening
    assert closed.opening_token is None and closed.grammar_applies
    zero = ReasoningState(MARKERS, [1], 0, gated=True)  # opened at the start with nothing to spend: closed at once
    assert run(zero, [7, 20, 11, 12, 13]) == [7, 8, 5, 9, 13]
    answer = []
    special = ReasoningMarkers(starts=((7,),), ends=(END,), forced=END)  # Qwen3's: one special token each
    qwen = ReasoningState(special, [1], 2, gated=True)
    assert qwen.opening_token == 7 and run(qwen, [7, 11, 12, 13, 14], answer) == [7, 11, 12, 9, 14]
    assert answer == [14]


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


def test_a_budget_needs_markers(llm: LLM) -> None:
    markers = llm.reasoning_markers
    llm.engine.set_reasoning_markers(None)
    try:
        with pytest.raises(InvalidRequestError, match="reasoning_parser") as refused:
            llm.generate(["Hi"], SamplingParams(thinking_token_budget=3))
        assert refused.value.param == "thinking_token_budget"
    finally:
        llm.engine.set_reasoning_markers(markers)
    from conveyor.sampling_params import StructuredOutputsParams

    llm.engine.constrain_reasoning(True)  # vLLM's enable_in_reasoning: a grammar masks the reasoning too
    try:
        with pytest.raises(InvalidRequestError, match="enable_in_reasoning"):
            llm.generate(["Hi"], SamplingParams(thinking_token_budget=3,
                                                structured_outputs=StructuredOutputsParams(choice=["a"])))
        [plain] = llm.generate([llm.tokenizer.encode("<think>\nHi")], SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["crimson", "teal"])), use_tqdm=False)
        assert plain.outputs[0].text in ("crimson", "teal")  # from its first token, inside the open block
    finally:
        llm.engine.constrain_reasoning(False)
    assert idle(llm)


def test_a_grammar_applies_after_the_reasoning(llm: LLM) -> None:
    from conveyor.sampling_params import StructuredOutputsParams

    choices = StructuredOutputsParams(choice=["Paris", "London"])
    prompt = llm.tokenizer.encode(llm.render_chat_text([{"role": "user", "content": "Capital of France?"}])
                                  + "<think>\n")
    forced = list(llm.reasoning_markers.forced)
    [free] = llm.generate([prompt], greedy(5), use_tqdm=False)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, structured_outputs=choices,
                                                  thinking_token_budget=5), use_tqdm=False)
    ids, text = list(out.outputs[0].token_ids), out.outputs[0].text
    assert ids[:5] == list(free.outputs[0].token_ids) and ids[5:5 + len(forced)] == forced  # reasoning unmasked
    assert text.split("</think>")[1] in ("Paris", "London") and out.outputs[0].finish_reason == "stop"
    # A reply that may open its block at its first token: "<" pushed up takes it past the grammar, the rest
    # of "<think>" is forced, the block's 3 tokens, then the answer masked as ever (the bias cannot lift it).
    start = list(llm.reasoning_markers.starts[0])
    plain = llm.tokenizer.encode("Capital of France?")
    pushed = {start[0]: 100.0}
    [opened] = llm.generate([plain], SamplingParams(max_tokens=24, temperature=0, structured_outputs=choices,
                                                    thinking_token_budget=3, logit_bias=pushed), use_tqdm=False)
    ids = list(opened.outputs[0].token_ids)
    assert ids[:len(start)] == start and ids[len(start) + 3:len(start) + 3 + len(forced)] == forced
    assert opened.outputs[0].text.split("</think>")[1] in ("Paris", "London")
    llm.engine.set_reasoning_markers(None)  # without markers the grammar masks the first token: no "<"
    try:
        [first] = llm.generate([plain], SamplingParams(max_tokens=24, temperature=0, structured_outputs=choices,
                                                       logit_bias=pushed), use_tqdm=False)
    finally:
        llm.engine.set_reasoning_markers(ReasoningConfig.of({"reasoning_start_str": "<think>",
                                                             "reasoning_end_str": "</think>"}).markers(llm.tokenizer))
    assert first.outputs[0].text in ("Paris", "London") and idle(llm)
