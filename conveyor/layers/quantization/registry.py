"""The one table of weight formats (`quantization=`): how float weights become each, which kernel types
its layers hold, where it runs, and whether a file's quantized tensors are kept as stored.

The CLI offers its names, `precision` validates a choice against it, checkpoint loading and
`plan_weights` follow it, and `SpeculativeConfig` takes its self-draft formats from it. A new format
is a row here plus its quantizer and kernel in their own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tensors import F32, I8, KERNEL_TYPES, GGMLType, QuantizedTensor, quantize_int4, quantize_int8, type_name


@dataclass(frozen=True)
class QuantizationMethod:
    name: str
    quantize: Callable[[torch.Tensor], QuantizedTensor] | None  # float matrix -> quantized; None: not from floats
    weight_types: tuple[str, ...]  # the `QuantizedTensor` types its layers hold (empty: dense weights)
    devices: tuple[str, ...]  # device types with kernels for it
    # a checkpoint's quantized tensors stay as stored (not dequantized): those of the stored format named as
    # the method ("gguf": a GGUF file's; "mxfp4": an MXFP4 checkpoint's blocks; "compressed-tensors", "gptq",
    # "awq": such a checkpoint's integer weights)
    keeps_stored: bool = False
    self_draft: bool = False  # the target's own weights in this format can be speculative decoding's draft

    @property
    def dense(self) -> bool:
        """Dense weights in the compute dtype: the only format the exact fp32 path takes."""
        return not self.weight_types


_PACKED_TYPES = tuple(type_name(t) for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, I8))
QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {m.name: m for m in (
    # dense weights in the compute dtype (a GGUF file's tensors dequantized)
    QuantizationMethod("none", None, (), ("cpu", "cuda")),
    # per-channel int8, one fp32 scale per output row
    QuantizationMethod("int8", quantize_int8, (type_name(I8),), ("cpu",), self_draft=True),
    # 4-bit in groups of 32 with an fp16 scale and minimum (GGUF's Q4_1 layout)
    QuantizationMethod("int4", quantize_int4, (type_name(GGMLType.Q4_1),), ("cpu",), self_draft=True),
    # a GGUF file's own quantized tensors, kept as they are
    QuantizationMethod("gguf", None, tuple(type_name(t) for t in KERNEL_TYPES if t not in (I8, F32)), ("cpu",),
                       keeps_stored=True, self_draft=True),
    # an MXFP4 checkpoint's blocks (gpt-oss's experts), kept as llama.cpp's MXFP4 rows (`mxfp4`)
    QuantizationMethod("mxfp4", None, (type_name(GGMLType.MXFP4),), ("cpu",), keeps_stored=True),
    # a compressed-tensors (llm-compressor's W4A16, W8A8), GPTQ or AWQ checkpoint's integer weights, kept where a
    # kernel type holds them (`layers.quantization.packing`)
    *(QuantizationMethod(name, None, _PACKED_TYPES, ("cpu",), keeps_stored=True)
      for name in ("compressed-tensors", "gptq", "awq")),
)}
QUANTIZATIONS = tuple(QUANTIZATION_METHODS)
# vLLM's names of its own kernels for the same checkpoints, taken as the format's.
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


def self_draft_quantizations() -> tuple[str, ...]:
    """The formats the target's own weights may take as speculative decoding's draft."""
    return tuple(name for name, m in QUANTIZATION_METHODS.items() if m.self_draft)


def canonical_quantization(name: str | None) -> str | None:
    """`name`, or the format a vLLM alias of it names (`ALIASES`)."""
    return ALIASES.get(name, name) if name is not None else None


def quantization_method(name: str) -> QuantizationMethod:
    """The row for `name` (or its alias); ValueError naming the choices."""
    method = QUANTIZATION_METHODS.get(ALIASES.get(name, name))
    if method is None:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None (auto), got {name!r}")
    return method
