"""Beam search side by side: Conveyor's `LLM.beam_search`, vLLM's (run this file with vLLM's interpreter) and
transformers' `generate(num_beams=...)` (batched, left-padded), on the same weights and chat prompts: seconds
per run after a warm-up, and the first prompt's best beam (the three should agree).

`python tools/peer_speed/beam_search.py {ours,vllm,hf} --model HF_DIR [--prompts 8] [--width 4] [--tokens 32]`
(EOS ignored, so every run generates the same number of tokens; bf16, the torch threads as set.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

TOPICS = ["the history of the bicycle", "how tides work", "why the sky is blue", "the rules of chess",
          "how bread rises", "the water cycle", "how vaccines work", "the first moon landing"]


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` one-question chats through the model's template, as token ids."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Write a short paragraph about "
                                             f"{TOPICS[i % len(TOPICS)]}."}], add_generation_prompt=True,
                                           tokenize=False) for i in range(count)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def engine_beams(engine: str, model: str, prompts: list[list[int]], width: int, tokens: int, repeats: int,
                 dtype: str = "bfloat16") -> tuple[list[float], list[int]]:
    """(seconds of each run, the first prompt's best beam's tokens) of Conveyor's or vLLM's `beam_search`."""
    if engine == "ours":
        from conveyor import LLM, BeamSearchParams
        llm = LLM(model, dtype=dtype)
    else:
        from vllm import LLM  # type: ignore[no-redef]
        from vllm.sampling_params import BeamSearchParams  # type: ignore[no-redef]
        llm = LLM(model, dtype=dtype, max_model_len=2048)
    params = BeamSearchParams(beam_width=width, max_tokens=tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    llm.beam_search(inputs[:2], params)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = llm.beam_search(inputs, params)
        times.append(time.perf_counter() - started)
    return times, out[0].sequences[0].tokens[len(prompts[0]):]


def transformers_beams(model: str, prompts: list[list[int]], width: int, tokens: int, repeats: int,
                       dtype: str = "bfloat16") -> tuple[list[float], list[int]]:
    """The same for transformers' `generate(num_beams=width)` over the prompts in one left-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    times = []
    for run in range(repeats + 1):  # the first is the warm-up
        started = time.perf_counter()
        with torch.inference_mode():
            out = net.generate(ids, attention_mask=mask, num_beams=width, do_sample=False, max_new_tokens=tokens,
                               min_new_tokens=tokens, pad_token_id=0)
        if run:
            times.append(time.perf_counter() - started)
    return times, out[0, longest:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=["ours", "vllm", "hf"])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for name in ("prompts", "width", "tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    from transformers import AutoTokenizer
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model), args.prompts)
    if args.engine == "hf":
        times, best = transformers_beams(args.model, prompts, args.width, args.tokens, args.repeats)
    else:
        times, best = engine_beams(args.engine, args.model, prompts, args.width, args.tokens, args.repeats)
    print(json.dumps({"engine": args.engine, "seconds": [round(t, 3) for t in times], "best": best}))
    return 0


if __name__ == "__main__":  # vLLM's engine starts processes: the guard keeps them from re-running this
    sys.exit(main())
