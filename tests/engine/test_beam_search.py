"""Beam search (vLLM's `LLM.beam_search`): the exact path's beams equal transformers' `num_beams` search;
beams ending in an EOS complete and rank with the live ones by length-normalized score; bad settings and
prompts that cannot fit are refused before any step runs."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, BeamSearchParams, InvalidRequestError
from conveyor.beam_search import BeamSearch
from conveyor.request import RequestOutput
from conveyor.sampling_params import SamplingParamsError

from tests.utils import TinyModel, idle, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> LLM:
    return tiny_llama.llm(page_size=4, num_blocks=128)


def test_beams_equal_transformers_beam_search(tiny_llama: TinyModel, llm: LLM) -> None:
    """fp32, two prompts in one search, no EOS: the 3 beams and their order as transformers' `generate(num_beams=3)`
    (which then ranks by the same log-probability, over equal lengths), each beam's cumulative log-probability
    its score times the length; every KV block back in the pool."""
    prompts, width, steps = random_prompts([7, 12], seed=5), 3, 6
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = tiny_llama.reference.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                                num_return_sequences=width, do_sample=False, max_new_tokens=steps,
                                                pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        assert [seq.tokens for seq in output.sequences] == ref.sequences.tolist()
        for seq, score in zip(output.sequences, ref.sequences_scores.tolist()):
            assert seq.cum_logprob == pytest.approx(score * steps, abs=1e-4)
            assert len(seq.logprobs) == steps and seq.finish_reason == "length"
            assert seq.text == llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=True)  # the prompt's too
            assert sum(step[t] for step, t in zip(seq.logprobs, seq.tokens[len(prompt):])) == pytest.approx(
                seq.cum_logprob)
    alone = llm.beam_search(prompts[1], BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in outputs[1].sequences]
    assert idle(llm)


def step_output(candidates: dict[int, float]) -> RequestOutput:
    """A beam's one-token step as the engine returns it: the candidates' log-probabilities."""
    top = max(candidates, key=candidates.__getitem__)
    return RequestOutput("r", None, [], "", [top], True, "length", logprobs=[candidates])


@pytest.mark.parametrize("length_penalty, best, reasons", [(1.0, [[5, 6, 8, 13], [5, 6, 2]], ["length", "stop"]),
                                                           (0.0, [[5, 6, 2], [5, 6, 8, 13]], ["stop", "length"])])
def test_eos_beams_complete_and_rank_by_normalized_score(length_penalty: float, best: list[list[int]],
                                                         reasons: list[str]) -> None:
    """Two steps of width 2 over made-up candidates (EOS = 2). A beam reaching the EOS stops growing; at the end
    it competes with the live beams: score = cumulative log-probability / length ** length_penalty, the final
    EOS not counted in the length, so the penalty decides between the short finished beam and the longer one."""
    search = BeamSearch([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty), [2])
    assert search.pending() == [(0, [5, 6])]
    search.advance([step_output({2: -0.28, 7: -0.2, 8: -0.3, 9: -2.0})])
    assert [tokens for _, tokens in search.pending()] == [[5, 6, 7], [5, 6, 8]]
    search.advance([step_output({10: -1.0, 2: -3.0, 11: -1.5, 12: -4.0}),
                    step_output({13: -0.1, 14: -2.0, 2: -0.25, 15: -5.0})])
    assert search.pending() == []
    [result] = search.results(lambda tokens: " ".join(map(str, tokens)))
    assert [seq.tokens for seq in result.sequences] == best
    assert [seq.finish_reason for seq in result.sequences] == reasons
    assert [seq.text for seq in result.sequences] == [" ".join(map(str, tokens)) for tokens in best]
    assert [len(seq.logprobs) for seq in result.sequences] == [len(t) - 2 for t in best]


def test_bad_settings_and_prompts_that_cannot_fit_are_refused(llm: LLM) -> None:
    for bad in ({"beam_width": 0}, {"max_tokens": 0}, {"temperature": -1.0}, {"length_penalty": "long"},
                {"length_penalty": 1e300}):
        with pytest.raises(SamplingParamsError, match=next(iter(bad))):
            BeamSearchParams(**({"beam_width": 2, "max_tokens": 4} | bad))
    too_long = random_prompts([llm.max_model_len - 3], seed=6)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.beam_search(too_long, BeamSearchParams(beam_width=2, max_tokens=4))
    assert idle(llm)
