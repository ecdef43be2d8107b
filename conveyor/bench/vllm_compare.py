"""`throughput --compare vllm`: vLLM's offline `LLM` on the same prompts, in vLLM's own interpreter.

vLLM is never a dependency of ours: `--vllm-python PATH` names an interpreter that has it, and
`vllm_runner.py` (shipped beside this file, importing nothing of Conveyor) runs there as a
subprocess. It gets what Conveyor's run got: the same chat-templated prompt token ids, each
request's max_new_tokens and ignore_eos, greedy decoding, Conveyor's EOS ids as stop tokens, and
the model file Conveyor loaded (overridable with `--vllm-model`: vLLM 0.32's CPU backend reads
no GGUF, so give it an HF directory of the same weights; `--vllm-tokenizer`) in the dtype
Conveyor resolved (bf16 or fp32), on as many cores as Conveyor's torch threads. Unless set:
`VLLM_CPU_KVCACHE_SPACE=4` (GiB); `VLLM_CPU_OMP_THREADS_BIND` = the first of our CPUs, one per
thread (vLLM's "auto" keeps one core per worker for its scheduler, which on a 2-core machine
halves its compute threads); `HF_HUB_OFFLINE=1` (nothing reaches a model hub). Only vLLM's
generate call is timed, after its own warm-up. The child's output goes to our stderr, so stdout
stays the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .hf_baselines import RunResult
from .throughput_report import count_values

RUNNER = Path(__file__).with_name("vllm_runner.py")
PROTOCOL = 1  # vllm_runner.PROTOCOL (that file is not imported here: it runs in another interpreter)
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# LLM(...) arguments set from Conveyor's run, not from --vllm-kwargs.
RESERVED_KWARGS = {"model": "--vllm-model", "tokenizer": "--vllm-tokenizer", "dtype": "--dtype"}


class VllmError(RuntimeError):
    """The vLLM run could not be made or did not answer the protocol."""


@dataclass
class VllmOptions:
    """How to run vLLM: its interpreter, optional model/tokenizer overrides, extra `LLM(...)` kwargs."""

    python: str
    model: str | None = None
    tokenizer: str | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        taken = sorted(set(self.llm_kwargs) & set(RESERVED_KWARGS))
        if taken:
            raise ValueError(f"--vllm-kwargs may not set {taken}: use {[RESERVED_KWARGS[k] for k in taken]}")


def add_vllm_arguments(parser: Any) -> None:
    """The `--vllm-*` options of a benchmark with `--compare vllm`."""
    vl = parser.add_argument_group("vLLM baseline (--compare vllm; run in its own interpreter, see vllm_compare.py)")
    vl.add_argument("--vllm-python", default=None, metavar="PATH", help="a Python interpreter with vLLM installed")
    vl.add_argument("--vllm-model", default=None,
                    help="what vLLM loads (default: the model file Conveyor loaded); e.g. an HF directory")
    vl.add_argument("--vllm-tokenizer", default=None, help="vLLM's tokenizer (default: vLLM's choice for the model)")
    vl.add_argument("--vllm-kwargs", default=None, metavar="JSON",
                    help="more vllm.LLM(...) arguments as a JSON object, e.g. '{\"max_model_len\": 2048}'")
    vl.add_argument("--vllm-timeout", type=float, default=None, metavar="S", help="give up on vLLM after S seconds")


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """`--vllm-kwargs` JSON object (e.g. '{"max_model_len": 2048}') -> dict."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--vllm-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--vllm-kwargs must be a JSON object, got {text!r}")
    return value


def vllm_dtype(dtype: torch.dtype) -> str:
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"no vLLM dtype for {dtype}; choose from {sorted(VLLM_DTYPES.values())}")
    return VLLM_DTYPES[dtype]


def build_request(options: VllmOptions, *, model: str, dtype: torch.dtype, prompts: list[list[int]],
                  max_new: Sequence[int], ignore_eos: Sequence[bool], eos_ids: Sequence[int],
                  warmup_prompt: Sequence[int], warmup_new_tokens: int) -> dict[str, Any]:
    """The runner's REQUEST (see `vllm_runner.py`): Conveyor's prompts and settings."""
    return {"protocol": PROTOCOL, "model": options.model or model, "tokenizer": options.tokenizer,
            "dtype": vllm_dtype(dtype), "llm_kwargs": options.llm_kwargs, "prompts": prompts,
            "max_tokens": list(max_new), "ignore_eos": list(ignore_eos), "stop_token_ids": list(eos_ids),
            "temperature": 0.0, "warmup_prompt": list(warmup_prompt), "warmup_max_tokens": warmup_new_tokens}


def thread_binding(threads: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `threads` OpenMP threads: the first CPUs this process may run on."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[:max(threads, 1)])


def call_runner(options: VllmOptions, request: dict[str, Any]) -> dict[str, Any]:
    """Run `request` through `vllm_runner.py` in `options.python`; its RESULT (protocol checked)."""
    env = os.environ.copy()
    for key, value in {**ENV_DEFAULTS, "VLLM_CPU_OMP_THREADS_BIND": thread_binding(torch.get_num_threads())}.items():
        env.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="conveyor-vllm-") as tmp:
        request_path, result_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        request_path.write_text(json.dumps(request))
        try:
            proc = subprocess.run([options.python, str(RUNNER), str(request_path), str(result_path)], env=env,
                                  stdin=subprocess.DEVNULL, stdout=2, timeout=options.timeout_s)
        except FileNotFoundError:
            raise VllmError(f"--vllm-python {options.python}: no such interpreter") from None
        except subprocess.TimeoutExpired:
            raise VllmError(f"the vLLM run took longer than {options.timeout_s} s") from None
        if not result_path.exists():
            raise VllmError(f"the vLLM runner ({options.python} {RUNNER.name}) exited with status {proc.returncode}; "
                            "its output is above")
        if proc.returncode != 0:  # RESULT.json is written whole after the timed call: only the teardown failed
            print(f"note: the vLLM runner wrote its result, then exited with status {proc.returncode} (at shutdown)",
                  file=sys.stderr)
        result = json.loads(result_path.read_text())
    key = "embeddings" if request.get("task") == "embed" else "token_ids"
    if result.get("protocol") != PROTOCOL or len(result.get(key, ())) != len(request["prompts"]):
        raise VllmError(f"the vLLM runner answered protocol {result.get('protocol')!r} with "
                        f"{len(result.get(key, ()))} outputs for {len(request['prompts'])} prompts")
    return result


def run_vllm(options: VllmOptions, request: dict[str, Any]) -> RunResult:
    """Run a generate `request` in vLLM; its tokens, timing and resolved settings."""
    result = call_runner(options, request)
    reasons = result["finish_reasons"]
    return RunResult(
        token_ids=[list(t) for t in result["token_ids"]], wall_s=float(result["wall_s"]),
        errors=[f"finish_reason={r}" if r in ("abort", "error") else None for r in reasons],
        extra={"api": "vllm.LLM.generate", "vllm_version": result.get("vllm_version"),
               "load_s": result.get("load_s"), "python": options.python, "model": request["model"],
               "tokenizer": request["tokenizer"], "dtype_requested": request["dtype"],
               "dtype": result.get("dtype"), "quantization": result.get("quantization"),
               "llm_kwargs": request["llm_kwargs"], "env": result.get("env", {}),
               "finish_reasons": count_values(reasons)})
