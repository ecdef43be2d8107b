"""Prefix caching where chats and agents feel it: a conversation's next turn and a second user on the same
system prompt, time to the first token with the cache warm and cold; and what keeping the cache costs where
nothing is shared.

`python -m tools.peer_speed.conversation_turns turns --model F [--system 2000]`: one process; turn 1 is a
`--system`-token prompt and a 40-token question, 32 tokens generated; the next turn adds the reply and 40 new
tokens, the second user the system prompt and another question. Each is timed (`max_tokens=1`) with the cache
warm, then after `reset_prefix_cache()`.
`... turns --server URL`: the same prompts against llama.cpp's server (`/completion`, `cache_prompt` on, then
off), its own prompt timings.
`... cost --model F [--no-caching]`: a fresh 1,000-token prompt's first token, then 48 decoded tokens after
another, twice; prefix caching on (or off): run both, alternated, in separate processes.
Token ids are random (1000-30000), so any random-weight file of `tools.random_gguf` works.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections.abc import Callable

import torch

QUESTION = 40
REPLY = 32


def prompts(system_tokens: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The system prompt and three questions, the same ids in every run."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1000, 30000, (n,), generator=g).tolist() for n in (system_tokens, QUESTION, QUESTION,
                                                                            QUESTION)]
    return ids[0], ids[1], ids[2], ids[3]


def conversation(complete: Callable[[list[int], int, bool], tuple[list[int], float, int]],
                 system_tokens: int) -> None:
    """`complete(prompt, max_tokens, cached) -> (tokens, prompt seconds, prompt tokens found cached)`."""
    system, q1, q2, q3 = prompts(system_tokens)
    reply, seconds, _ = complete(system + q1, REPLY, True)
    print(f"turn 1: {len(system + q1)} prompt tokens, {seconds:.1f} s")
    for label, prompt in (("next turn", system + q1 + reply + q2), ("second user", system + q3)):
        _, warm, hit = complete(prompt, 1, True)
        _, cold, _ = complete(prompt, 1, False)
        print(f"{label}: {len(prompt)} tokens, {hit} from the cache: TTFT {warm:.2f} s warm, {cold:.2f} s cold "
              f"({cold / warm:.1f}x)")
        complete(system + q1, REPLY, True)  # the first turn again: its blocks back in the cache


def ours(model: str, max_model_len: int) -> Callable[[list[int], int, bool], tuple[list[int], float, int]]:
    from conveyor import LLM, SamplingParams
    llm = LLM(model, max_model_len=max_model_len)

    def complete(prompt: list[int], max_tokens: int, cached: bool) -> tuple[list[int], float, int]:
        if not cached:
            llm.reset_prefix_cache()
        before = llm.stats().prefix_cache_hit_tokens
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
        return out.token_ids, time.perf_counter() - start, llm.stats().prefix_cache_hit_tokens - before
    return complete


def llama_server(url: str) -> Callable[[list[int], int, bool], tuple[list[int], float, int]]:
    def complete(prompt: list[int], max_tokens: int, cached: bool) -> tuple[list[int], float, int]:
        body = {"prompt": prompt, "n_predict": max_tokens, "cache_prompt": cached, "temperature": 0,
                "return_tokens": True, "ignore_eos": True}
        request = urllib.request.Request(url.rstrip("/") + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(request, timeout=3600))
        timings = out["timings"]
        return out["tokens"], timings["prompt_ms"] / 1000, len(prompt) - timings["prompt_n"]
    return complete


def cost(model: str, caching: bool) -> None:
    from conveyor import LLM, SamplingParams
    llm = LLM(model, max_model_len=4096, enable_prefix_caching=caching)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        fresh = [torch.randint(1000, 30000, (1000,), generator=g).tolist() for _ in range(2)]
        start = time.perf_counter()
        llm.generate([fresh[0]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([fresh[1]], SamplingParams(max_tokens=49, temperature=0, ignore_eos=True), use_tqdm=False)
        total = time.perf_counter() - start
        print(f"prefix caching {'on' if caching else 'off'}: prompt {1000 / first:.1f} tok/s, decode "
              f"{48 / (total - first):.2f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["turns", "cost"])
    parser.add_argument("--model", help="a model directory or GGUF file (ours)")
    parser.add_argument("--server", help="llama.cpp's server URL instead (turns)")
    parser.add_argument("--system", type=int, default=2000, help="system prompt tokens (turns)")
    parser.add_argument("--no-caching", action="store_true", help="prefix caching off (cost)")
    args = parser.parse_args()
    if args.what == "cost":
        cost(args.model, not args.no_caching)
    else:
        conversation(llama_server(args.server) if args.server else ours(args.model, 8192), args.system)


if __name__ == "__main__":
    main()
