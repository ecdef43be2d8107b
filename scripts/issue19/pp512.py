"""Prompt processing of the built-in GGUF at 512 tokens, one request, default mode: tokens/s (median of 5),
the same measure as llama-bench -p 512 (prefill only, no generation beyond the first token)."""
import statistics, sys, time
import torch
from conveyor import LLM, SamplingParams
llm = LLM()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (512,), generator=g).tolist()
params = SamplingParams(max_tokens=1, temperature=0.0)
llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
times = []
for i in range(5):
    p = [(x + i + 1) % 40000 + 100 for x in prompt]  # no prefix-cache hits
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False); times.append(time.perf_counter() - t)
print(f"conveyor pp512: {512 / statistics.median(times):.1f} tok/s (median of 5; {[round(512/t) for t in times]})")
