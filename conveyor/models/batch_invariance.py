"""Batch invariance (`ContinuousBatchingConfig.batch_invariant`, vLLM's VLLM_BATCH_INVARIANT): a request's
tokens and logprobs do not depend on what it is batched with or how its prompt is chunked.

That needs every step to do the same arithmetic for a token row whatever else the step holds, and on CPU
with the native kernels it does, by construction: the linears quantize each activation row on its own
and sum over K in one order whatever the row count (`QuantMatmul`, quantized or bf16 tiles); the norms,
RoPE and SiLU are per row; attention takes keys in blocks at absolute positions with one arithmetic for
prefill and decode (`kernels/attention_blocks.h`), so a token gets the same bits in any chunk and in
decode (and a recomputed request its K/V back bit for bit); the native decode stack computes what the
eager layers compute (`decode_stack.py`). So in bf16 (and with quantized weights in fp32) this is the
default; `batch_invariant=True` makes it a guarantee: it refuses what cannot keep it (dense fp32, whose
linears run on MKL/oneDNN with a reduction order that changes with the row count; other devices and
attention backends; linears left on PyTorch's matmul) and turns off the batch-dependent paths of AMX
CPUs: bf16 inputs of more than `BF16_KERNEL_MAX_ROWS` rows dequantized for oneDNN's AMX matmul, and
prefill attention's products on the tiles (`CpuPagedAttention.amx`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..layers.attention import AttentionBackend, CpuPagedAttention
from ..layers.linear import PackedLinear
from ..layers.moe import SparseMoe
from ..layers.quantization.linear import QuantLinear, QuantMatmul


def make_batch_invariant(model: nn.Module, attention: AttentionBackend, device: torch.device,
                         dtype: torch.dtype) -> None:
    """Keep every row count of `model` on the native kernels, or raise a `ConfigError` saying why it cannot
    be batch-invariant here."""
    if device.type != "cpu":
        raise ConfigError(f"batch_invariant=True runs on CPU with the native kernels; this engine is on {device.type}")
    if not isinstance(attention, CpuPagedAttention):
        raise ConfigError("batch_invariant=True needs the native CPU attention kernels (float32 or bfloat16, "
                          "attention_backend 'auto' or 'cpu', and a C++ compiler to build them); this engine uses "
                          f"{type(attention).__name__}")
    head = getattr(model, "lm_head_fn", None)
    plain = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, PackedLinear))]
    if plain or not isinstance(head, QuantMatmul):
        where = plain[0] if plain else "the LM head"
        if dtype == torch.float32:
            raise ConfigError(f"batch_invariant=True: {where} is a dense float32 linear, run by MKL/oneDNN, whose "
                              "reduction order changes with the number of rows; use dtype='bfloat16', or quantized "
                              "weights (quantization='int8', 'int4' or a GGUF file)")
        raise ConfigError(f"batch_invariant=True needs every linear layer on the native kernels; {where} runs on "
                          "PyTorch's matmul (CONVEYOR_NATIVE_KERNELS=0, or kernels that did not build)")
    for kernel in [head] + [m.kernel for m in model.modules() if isinstance(m, QuantLinear)]:
        kernel.bf16_max_rows = None  # every row count on the native kernel (AMX CPUs: not oneDNN above it)
    for block in model.modules():
        if isinstance(block, SparseMoe):
            block.amx_rows = None  # every chunk through the native block, its routing included
    attention.amx = False  # prefill attention's products off the AMX tiles, in decode's arithmetic
