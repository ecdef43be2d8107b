"""The CPU process's memory as the kernels want it: huge pages for the weights' tiles and the KV pool,
which every decode step streams, and glibc's malloc kept from handing the steps' buffers back to the OS.

Huge pages. A decode step reads every weight byte once, and at depth every cached K and V row. On 4 KiB
pages those streams cross a page every 64 cache lines, or every few positions of the KV cache (a TLB
miss each, and the hardware prefetchers stop at each boundary); on 2 MiB transparent huge pages they
read faster (docs/benchmarks.md#huge-pages). The KV pool's pages are still committed as requests first
write them, 2 MiB at a time: a pool holds at least a huge page of each layer's K and of its V from the
start (its reserved chunks are zeroed).
Linux backs anonymous memory with huge pages where `/sys/kernel/mm/transparent_hugepage/enabled` is
`always`, and where it is `madvise` (many distributions' default) only the ranges a process marks
with madvise(MADV_HUGEPAGE): `empty` marks its tensor's, 2 MiB-aligned, before anything touches them.
`never` (or `CONVEYOR_HUGE_PAGES=0`) keeps 4 KiB pages.

The steps' buffers. Every forward allocates its activations anew (PyTorch ops return new tensors).
glibc serves a block over its mmap threshold with a fresh mapping and unmaps it when freed, and gives
the top of its heap back once more than its trim threshold is free there, so each step faulted in
and the kernel zeroed megabytes of pages it had just taken away. `keep_freed_memory` raises both
thresholds once the model is loaded (`release_freed_memory` first returns what the load freed), so a
step reuses the last one's memory.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import math
import os
import sys

import torch

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest mmap threshold glibc accepts on 64-bit machines
TRIM_THRESHOLD = 2**31 - 1       # the largest mallopt takes (an int): in effect, never trim between steps


@functools.cache
def thp_mode() -> str:
    """The kernel's transparent huge page setting (`always`, `madvise`), or `off` where this process does
    not use them (`never`, not Linux, or CONVEYOR_HUGE_PAGES=0)."""
    if not sys.platform.startswith("linux") or os.environ.get("CONVEYOR_HUGE_PAGES") == "0":
        return "off"
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return "off"
    chosen = setting[setting.find("[") + 1:setting.find("]")] if "[" in setting else setting.strip()
    return chosen if chosen in ("always", "madvise") else "off"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, on huge pages where the kernel gives them: a tensor
    of at least two huge pages starts on a 2 MiB boundary of a buffer (its storage up to 2 MiB larger,
    never touched) whose whole huge pages under the tensor are marked MADV_HUGEPAGE; the partial one at
    its end is not, so nothing past the tensor is committed. Smaller tensors, and every tensor where huge
    pages are off, are plain `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < 2 * HUGE_PAGE or thp_mode() == "off":
        return torch.empty(shape, dtype=dtype)
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    libc = _libc()
    if thp_mode() == "madvise" and libc is not None:  # a refusal (an old kernel) leaves 4 KiB pages
        libc.madvise(buffer.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return buffer[start:start + nbytes].view(dtype).view(shape)


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS. glibc keeps it after a big load (a checkpoint widened to
    fp32, then quantized to int8, stays resident otherwise). Built-in model, process RSS after load:
    int8 1337 -> 482 MiB, gguf 591 -> 441 MiB."""
    libc = _libc()
    if libc is not None:
        gc.collect()
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """From now on, glibc keeps freed memory for the next allocations instead of unmapping or trimming
    it (blocks up to `MMAP_THRESHOLD_MAX` come from the heap; the heap is not trimmed): the steps reuse
    each other's buffers. Whether glibc took the settings."""
    libc = _libc()
    if libc is None:
        return False
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    return bool(mmap_set and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
