"""tools/peer_speed's offline measures on a tiny model: the prompt and decode rates llama-bench's -p and -n
report, each a list of positive timings, with the prompt runs missing the prefix cache; beam search against
transformers'."""

from __future__ import annotations

import pytest

from tools.peer_speed import beam_search, decode_speed, prompt_speed

from tests.utils import TinyModel


def test_prompt_runs_are_timed_without_prefix_hits(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(allow_block_sharing=True)
    times = prompt_speed.prompt_seconds(llm, tokens=40, repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    stats = llm.stats()
    assert stats.prefix_cache_query_tokens >= 3 * 40 and stats.prefix_cache_hit_tokens == 0


def test_decode_rates_after_a_warm_up(tiny_llama: TinyModel) -> None:
    rates = decode_speed.decode_rates(tiny_llama.llm(), tokens=64, repeats=2, temperature=1.0)
    assert len(rates) == 2 and all(r > 0 for r in rates)


@pytest.mark.parametrize("module", [prompt_speed, decode_speed])
def test_counts_must_be_positive(module, capsys) -> None:
    with pytest.raises(SystemExit):
        module.main(["--tokens", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_beam_search_runs_agree_with_transformers(tiny_models: dict[str, TinyModel]) -> None:
    """The beam search comparison on the tiny Llama in fp32: timings, and the same best beam as transformers'."""
    model = tiny_models["llama"]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]  # left padding: transformers' batch is not all one length
    ours, best = beam_search.engine_beams("ours", str(model.path), prompts, width=3, tokens=5, repeats=1,
                                          dtype="float32")
    reference, ref_best = beam_search.transformers_beams(str(model.path), prompts, width=3, tokens=5, repeats=1,
                                                         dtype="float32")
    assert len(ours) == len(reference) == 1 and ours[0] > 0 and best == ref_best and len(best) == 5
