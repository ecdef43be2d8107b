"""One stream's decode from a near-empty context: `--tokens` new tokens over (time of the whole generation
- time of a one-token generation), the median of `--repeats` runs after a warm-up; the measure llama.cpp's
`llama-bench -n 128` reports. Greedy by default; `--temperature 1` samples (what `vllm bench serve` asks
for unless told `--temperature 0`).

`python -m tools.peer_speed.decode_speed [--model M] [--temperature 0] [--tokens 128] [--repeats 5]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from conveyor import LLM, SamplingParams


def decode_rates(llm: LLM, tokens: int, repeats: int, temperature: float) -> list[float]:
    """Tokens/s of each timed run: `tokens` / (a `tokens + 1` generation's time - a one-token generation's)."""
    first = SamplingParams(max_tokens=1, temperature=temperature)
    full = SamplingParams(max_tokens=tokens + 1, temperature=temperature, ignore_eos=True)
    vocab = llm.vocab_size
    rates = []
    for i in range(repeats + 1):  # the first run warms up
        prompts = [[{"prompt_token_ids": [1] + [(b + shift + i) % vocab for b in (100, 200, 300)]}] for shift in (0, 1)]
        started = time.perf_counter()
        llm.generate(prompts[0], first, use_tqdm=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate(prompts[1], full, use_tqdm=False)
        whole = time.perf_counter() - started
        if i:
            rates.append(tokens / (whole - prefill))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.peer_speed.decode_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in model)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded after the first (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1")
    rates = decode_rates(LLM(args.model), args.tokens, args.repeats, args.temperature)
    print(f"conveyor tg{args.tokens} (temperature {args.temperature}): {statistics.median(rates):.1f} tok/s "
          f"(median of {args.repeats}; {[round(r) for r in rates]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
