"""The precision options every benchmark that builds an `LLM` takes, and how reports name the mode.

A figure means little without the mode it was measured in: reports carry the dtype and weight
format `LLM` resolved (not just what was asked for) and the CPU's vector flags, which decide the
kernels "auto" picks.
"""

from __future__ import annotations

from typing import Any

DTYPE_HELP = ("as LLM's dtype=: auto (default: bf16 on CUDA and on CPUs with native bf16 dot products, else fp32), "
              "float32 (the exact path), bfloat16, float16")
QUANTIZATION_HELP = ("as LLM's quantization= (default: gguf for a quantized GGUF file unless --dtype float32, "
                     "else none)")


def add_mode_arguments(parser: Any) -> None:
    """`--dtype` and `--quantization`, passed to `LLM` as they are."""
    from ..layers.quantization.registry import QUANTIZATIONS

    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)


def resolved_mode(llm: Any) -> dict[str, str]:
    """What `llm` runs in: the dtype and the weight format as resolved."""
    return {"dtype": str(llm.dtype).removeprefix("torch."), "quantization": llm.quantization}


def describe_mode(model: dict[str, Any], environment: dict[str, Any]) -> str:
    """"bfloat16, weights gguf; CPU flags avx2 fma ...", for report headers (`model` holds `resolved_mode`'s
    keys, `environment` the `cpu_flags`)."""
    return (f"{model['dtype']}, weights {model['quantization']}; CPU flags "
            f"{' '.join(environment['cpu_flags']) or 'unknown'}")
