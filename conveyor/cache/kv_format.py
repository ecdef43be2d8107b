"""How K/V rows are stored in the pool (`kv_cache_dtype`, vLLM's name): in the model's dtype ("auto"),
quantized to int8 ("int8", CPU), or in fp8 ("fp8" = "fp8_e4m3", "fp8_e5m2": the Triton kernel on CUDA,
and the PyTorch backend anywhere).

int8 rows are symmetric with one scale per token and KV head: a head's D values `x` are stored as
`q = round(x / s)` in [-127, 127] with `s = max|x| / 127` (s = 0 for an all-zero row), and the fp32
scale sits in the 4 bytes after them. So a pool tensor is bytes, `[2, slots, kv_heads, D + 4]`, a
slot's scales travel with its values wherever a page is copied (the swap pool, prefix sharing), and
a token costs D + 4 bytes per head and K or V instead of 2D in bf16 (1.88x the tokens at D = 64,
1.94x at D = 128). Rows are quantized once, when the pass writes them, and read in place.

The attention kernels take the scales out of the inner loops: over int8 keys the query row (q times
the attention scale) is quantized as a K row is, a score is the integer dot product of the two rows
times both scales (VNNI's byte dot products), and a value row enters the output as `fmadd(p * s_v,
v_int, o)` (docs/design/kv-cache.md). `quantize_kv` and `dequantize_kv` here are the reference every
kernel's writes and reads are tested against; `int8_key_query` gives the PyTorch backend the query the
kernels score with.

fp8 rows are the values cast to `float8_e4m3fn` or `float8_e5m2`, saturated at the format's largest
finite value, with no scale (vLLM's default, a scale of 1.0): half the bytes of bf16, and readers
widen them as they load them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # an fp32 scale after each int8 row
INT8_MAX = 127


@dataclass(frozen=True)
class KVFormat:
    """The storage of one pool: `dtype` and `row` (elements per head row) of its tensors."""

    name: str
    dtype: torch.dtype
    head_dim: int

    @property
    def quantized(self) -> bool:
        return self.name == "int8"

    @property
    def row(self) -> int:
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def bytes_per_row(self) -> int:
        return self.row * torch.tensor([], dtype=self.dtype).element_size()


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device, head_dim: int) -> KVFormat:
    """The format `kv_cache_dtype` asks for, or a `ConfigError` naming the choices this device runs."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return KVFormat("auto", model_dtype, head_dim)
    if kv_cache_dtype == "int8":
        if device.type != "cpu":
            raise ConfigError(f"kv_cache_dtype='int8' runs on CPU; on {device.type} use 'fp8' or 'auto'")
        if head_dim % SCALE_BYTES:
            raise ConfigError(f"kv_cache_dtype='int8' needs a head dim that is a multiple of {SCALE_BYTES} (its "
                              f"scale is stored after the values), got {head_dim}; use 'auto'")
        return KVFormat("int8", torch.uint8, head_dim)
    return KVFormat(kv_cache_dtype, FP8_DTYPES[kv_cache_dtype], head_dim)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's bytes (PyTorch has no index_copy_ or index_select for fp8 on CPU), others as they are:
    copies of pages and rows go through this view."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def is_encoded(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds rows that readers decode (int8 rows or fp8), not model-dtype values."""
    return dtype == torch.uint8 or is_fp8(dtype)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the fp8 `dtype`, saturated at its largest finite value (a plain cast would make them NaN)."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Rows `x [..., D]` (any float dtype) as int8 rows with their scales: uint8 `[..., D + 4]`."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inverse).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows with their scales `uint8 [..., D + 4]` as values `[..., D]` in `dtype` (q * s in fp32)."""
    d = rows.shape[-1] - SCALE_BYTES
    q = rows[..., :d].view(torch.int8).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (q * scale).to(dtype)


def int8_key_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The query `q [..., D]` as the native kernels score it against int8 keys: `q * scale` (fp32) quantized
    per head as a K row is, back in q's dtype; attend to the dequantized rows with a scale of 1."""
    return dequantize_kv(quantize_kv(q.float() * scale), q.dtype)


def encode_kv(cache_dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """Rows `x [T, Hkv, D]` as a cache of `cache_dtype` stores them (int8 rows, fp8, or as they are)."""
    if cache_dtype == torch.uint8:
        return quantize_kv(x)
    return to_fp8(x, cache_dtype) if is_fp8(cache_dtype) else x


def decode_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows as values in `dtype`: int8 rows dequantized, fp8 widened, others as they are."""
    if rows.dtype == torch.uint8:
        return dequantize_kv(rows, dtype)
    return rows.to(dtype) if is_fp8(rows.dtype) else rows


def write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass's new K and V `[T, Hkv, D]` into the cache's `slots`, encoded as the cache stores them; K
    and V as the cache now holds them (decoded, in k's dtype), for attention over the pass's own tokens."""
    kq, vq = encode_kv(kv_cache.dtype, k), encode_kv(kv_cache.dtype, v)
    as_bytes(kv_cache[0]).index_copy_(0, slots, as_bytes(kq))
    as_bytes(kv_cache[1]).index_copy_(0, slots, as_bytes(vq))
    return decode_kv(kq, k.dtype), decode_kv(vq, v.dtype)
