"""Prompt processing of one request, prefill only: tokens/s, the median of `--repeats` runs, the measure
llama.cpp's `llama-bench -p 512` reports. Each run's prompt is shifted so no prefix-cache block is reused.

`python -m tools.peer_speed.prompt_speed [--model M] [--tokens 512] [--repeats 5]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from conveyor import LLM, SamplingParams

LOWEST_ID = 100  # random ids from here up: clear of the special tokens at the start of the vocabulary
HIGHEST_ID = 40000


def prompt_seconds(llm: LLM, tokens: int, repeats: int, seed: int = 0) -> list[float]:
    """Seconds of each of `repeats` one-token generations on a `tokens`-long random prompt, after a warm-up."""
    high = min(HIGHEST_ID, llm.vocab_size)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(LOWEST_ID, high, (tokens,), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    times = []
    for i in range(repeats):
        shifted = [LOWEST_ID + (x - LOWEST_ID + i + 1) % (high - LOWEST_ID) for x in prompt]  # no prefix-cache hits
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": shifted}], params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.peer_speed.prompt_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in model)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1")
    times = prompt_seconds(LLM(args.model), args.tokens, args.repeats)
    print(f"conveyor pp{args.tokens}: {args.tokens / statistics.median(times):.1f} tok/s (median of {args.repeats}; "
          f"{[round(args.tokens / t) for t in times]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
