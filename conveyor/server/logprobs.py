"""Logprobs in the shapes clients read: OpenAI's completions (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and chat (`content` entries with `bytes`), and vLLM's `prompt_logprobs`. Token texts are
decoded once per token id and kept (a vocabulary's worth of short strings at most)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LogprobRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def token_str(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def namer(self, as_ids: bool) -> Callable[[int], str]:
        """How tokens are named: their text, or vLLM's `token_id:N` (`return_tokens_as_token_ids`)."""
        return (lambda t: f"token_id:{t}") if as_ids else self.token_str

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float] | None], n: int,
                   offset: int, as_ids: bool = False) -> dict[str, Any]:
        """OpenAI's completion logprobs; a None entry (an echoed prompt's first token) has null ones."""
        name = self.namer(as_ids)
        tokens = [name(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else lp.get(t) for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [None if lp is None else {name(i): v for i, v in list(lp.items())[:n]}
                                 for lp in logprobs],
                "text_offset": offsets}

    def prompt(self, entries: list[dict[int, float] | None], n: int) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}, the
        top-n first, then the prompt token if it is not among them, each with its rank in the vocabulary."""
        def entry(lp: dict[int, float]) -> dict[str, Any]:
            return {str(t): {"logprob": float(v), "rank": getattr(v, "rank", None), "decoded_token": self.token_str(t)}
                    for t, v in lp.items()}

        return [None if lp is None else entry(lp) for lp in entries]

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], n: int,
             as_ids: bool = False) -> list[dict[str, Any]]:
        name = self.namer(as_ids)

        def entry(token_id: int, value: float | None) -> dict[str, Any]:
            s = name(token_id)
            return {"token": s, "logprob": value, "bytes": list(s.encode())}

        return [entry(t, lp.get(t)) | {"top_logprobs": [entry(i, v) for i, v in list(lp.items())[:n]]}
                for t, lp in zip(token_ids, logprobs)]
