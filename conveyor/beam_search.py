"""Beam search, vLLM's (`LLM.beam_search`, the server's `use_beam_search`), built on generation as vLLM builds
it: each step runs every live beam as a one-token request that returns its 2 x beam_width most likely next
tokens' log-probabilities; each prompt's candidates (every beam times each of its tokens) are ranked by
score and the best `beam_width` go on. A candidate ending in an EOS is complete and waits for the end, where
the complete and the live beams are ranked together. The prefix cache holds the history the beams share,
so a step computes little more than each beam's last, partly filled page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .engine.engine import Engine
from .lora_llm import per_prompt
from .lora_request import LoRARequest
from .request import Prompt, RequestOutput, prompt_list
from .sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` are the prompt's and the beam's, `logprobs` one entry per generated token
    (the step's candidates: {token id: log-probability}), `text` the whole sequence's, prompt included (as
    vLLM's). finish_reason: "stop" where it ended in an EOS, else "length"."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (vLLM's): `beam_width` of them."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The search over a batch of prompts: `pending()` lists this step's requests (prompt index, token ids),
    `advance` takes their outputs in that order, `results` ranks what is there when no step is pending."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: Iterable[int]) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.beams = [[BeamSearchSequence(list(p), [])] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def score(self, seq: BeamSearchSequence) -> float:
        """vLLM's (transformers' length normalization): a final EOS does not count in the length."""
        length = len(seq.tokens) - (seq.finish_reason == "stop")
        return seq.cum_logprob / max(length, 1) ** self.params.length_penalty

    def pending(self) -> list[tuple[int, list[int]]]:
        if self.steps >= self.params.max_tokens:
            return []
        return [(p, beam.tokens) for p, beams in enumerate(self.beams) for beam in beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """The outputs of `pending()`'s requests, in its order: each beam's one token with its candidates."""
        given = iter(outputs)
        for p, beams in enumerate(self.beams):
            candidates = []
            for beam in beams:
                out = next(given)
                if not out.logprobs:  # failed (the engine's error), or cancelled
                    raise RuntimeError(f"a beam search step ended without its token: {out.error or out.finish_reason}")
                step = out.logprobs[0]
                for token, logprob in step.items():
                    seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + logprob)
                    if token in self.eos and not self.params.ignore_eos:
                        seq.finish_reason = "stop"
                        self.completed[p].append(seq)
                    else:
                        candidates.append(seq)
            self.beams[p] = sorted(candidates, key=self.score, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's best `beam_width` of its complete and live beams, best first, their text `decode`d."""
        outputs = []
        for beams, done in zip(self.beams, self.completed):
            for beam in beams:
                beam.finish_reason = "length"
            best = sorted(done + beams, key=self.score, reverse=True)[:self.params.beam_width]
            if decode is not None:
                for beam in best:
                    beam.text = decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs


class BeamSearchMethods:
    """Mixed into `LLM`: the engine, tokenizer and `generate` are `LLM`'s."""

    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    generate: Callable[..., list[RequestOutput]]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's: the `params.beam_width` best sequences of each prompt (text, token ids or a prompt dict),
        in input order. A prompt that cannot hold `params.max_tokens` more tokens within the context raises
        `InvalidRequestError` before any step runs."""
        processor = self.engine.input_processor
        ids = [processor.prompt_ids(p)[0] for p in prompt_list(prompts)]
        for token_ids in ids:
            processor.check_fits(token_ids, params.max_tokens)
        adapters = per_prompt(lora_request, len(ids))
        search, step = BeamSearch(ids, params, self.engine.eos_token_ids), params.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm) as bar:
            while batch := search.pending():
                search.advance(self.generate([tokens for _, tokens in batch], step, use_tqdm=False,
                                             lora_request=[adapters[p] for p, _ in batch]))
                bar.update(1)
        return search.results(lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True))
