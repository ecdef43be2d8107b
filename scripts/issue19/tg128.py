"""One stream decode of the built-in GGUF, default mode: (128 new tokens) / (time - time to first token),
median of 5; the measure llama-bench -n 128 reports (generation from a near-empty context). Greedy by
default; `tg128.py 1.0` samples at temperature 1 (what `vllm bench serve` asks for unless told
`--temperature 0`)."""
import statistics, sys, time
from conveyor import LLM, SamplingParams
temperature = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
llm = LLM()
first = SamplingParams(max_tokens=1, temperature=temperature)
full = SamplingParams(max_tokens=129, temperature=temperature, ignore_eos=True)
rates = []
for i in range(6):
    p = [{"prompt_token_ids": [1, 100 + i, 200 + i, 300 + i]}]
    t = time.perf_counter(); llm.generate(p, first, use_tqdm=False); t1 = time.perf_counter() - t
    p = [{"prompt_token_ids": [1, 101 + i, 201 + i, 301 + i]}]
    t = time.perf_counter(); llm.generate(p, full, use_tqdm=False); t2 = time.perf_counter() - t
    if i: rates.append(128 / (t2 - t1))
print(f"conveyor tg128 (temperature {temperature}): {statistics.median(rates):.1f} tok/s "
      f"(median of 5; {[round(r) for r in rates]})")
