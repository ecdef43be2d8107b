"""vLLM's side of `conveyor bench throughput --compare vllm`: run in vLLM's own interpreter, by path.

    VLLM_PYTHON conveyor/bench/vllm_runner.py REQUEST.json RESULT.json

vLLM is never a dependency of Conveyor, so this file imports nothing from Conveyor (that
interpreter need not have it) and imports vllm only here. REQUEST.json (protocol 1), written by
`vllm_compare.py`:

    {"protocol": 1, "model": str, "tokenizer": str | null, "dtype": "bfloat16" | "float32" | "float16",
     "llm_kwargs": {...}, "prompts": [[token ids]], "max_tokens": [int], "ignore_eos": [bool],
     "stop_token_ids": [int], "temperature": 0.0, "warmup_prompt": [token ids], "warmup_max_tokens": int}

Greedy, one `SamplingParams` per request: `stop_token_ids` (Conveyor's EOS ids) apply where EOS
is not ignored. One small warm-up generate runs first; only the timed `LLM.generate` over every
prompt at once is in `wall_s` (not the load). RESULT.json:

    {"protocol": 1, "vllm_version": str, "load_s": float, "wall_s": float, "token_ids": [[int]],
     "finish_reasons": [str | null], "dtype": str | null, "quantization": str | null, "env": {VLLM_*: str}}

With "task": "embed" (`conveyor bench embed --compare vllm`) the model loads as a pooling model
(`runner="pooling"`), the warm-up (over every prompt, as Conveyor's side warms up) and the timed call
are `LLM.embed`, and RESULT.json has "embeddings": [[float]] in place of "token_ids" and
"finish_reasons"; "warmup_prompt" is not used.

Exit status 0 on success; otherwise the traceback is on stderr and no RESULT.json is written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROTOCOL = 1


def _model_config(llm: Any) -> Any:
    """vLLM's resolved model config, wherever this version keeps it (None if nowhere known)."""
    config = getattr(llm, "model_config", None)
    return config if config is not None else getattr(getattr(llm, "llm_engine", None), "model_config", None)


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load the model in vLLM, warm up, time one generate (or embed) over every prompt; the RESULT dict."""
    if request.get("protocol") != PROTOCOL:
        raise ValueError(f"vllm_runner speaks protocol {PROTOCOL}, the request is {request.get('protocol')!r}")
    import vllm

    embed = request.get("task") == "embed"
    started = time.perf_counter()
    llm = vllm.LLM(model=request["model"], tokenizer=request["tokenizer"], dtype=request["dtype"],
                   **({"runner": "pooling"} if embed else {}), **request["llm_kwargs"])
    load_s = time.perf_counter() - started
    config = _model_config(llm)
    dtype = getattr(config, "dtype", None)
    result = {"protocol": PROTOCOL, "vllm_version": getattr(vllm, "__version__", None), "load_s": load_s,
              "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
              "quantization": getattr(config, "quantization", None),
              "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}
    if embed:
        prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
        llm.embed(prompts, use_tqdm=False)
        started = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        return {**result, "wall_s": time.perf_counter() - started,
                "embeddings": [list(o.outputs.embedding) for o in outputs]}

    def params(max_tokens: int, ignore_eos: bool) -> Any:
        return vllm.SamplingParams(max_tokens=max_tokens, temperature=request["temperature"], ignore_eos=ignore_eos,
                                   stop_token_ids=None if ignore_eos else request["stop_token_ids"])

    llm.generate([{"prompt_token_ids": request["warmup_prompt"]}], params(request["warmup_max_tokens"], True),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in request["prompts"]]
    sampling = [params(m, e) for m, e in zip(request["max_tokens"], request["ignore_eos"])]
    started = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    wall_s = time.perf_counter() - started
    return {**result, "wall_s": wall_s, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outputs]}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    result = run(json.loads(Path(argv[0]).read_text()))
    partial = Path(argv[1] + ".partial")
    partial.write_text(json.dumps(result))
    partial.replace(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
