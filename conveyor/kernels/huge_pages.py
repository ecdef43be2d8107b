"""Transparent huge pages for the weights a decode step streams.

One decode step reads every weight byte once. On 4 KiB pages that is a TLB miss every 4 KiB, and the
hardware prefetchers stop at each page's end; on 2 MiB pages the stream runs on. Linux backs anonymous
memory with huge pages where a program asks (`madvise(MADV_HUGEPAGE)`, the default "madvise" mode of
/sys/kernel/mm/transparent_hugepage/enabled), as the pages are first touched. So `empty` gives a
buffer of its own: a fresh anonymous mapping, advised before anything touches it, the tensor starting
on a 2 MiB boundary (memory from the allocator's heap may already hold 4 KiB pages). Advisory: where
the kernel refuses (mode "never", another OS) the buffer is plain memory. `CONVEYOR_HUGE_PAGES=0` turns
it off.
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("CONVEYOR_HUGE_PAGES", "1") != "0")


def empty(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """`torch.empty(shape, dtype)`, on huge pages where Linux gives them (buffers of at least one)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous: no page touched yet
    flat = torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -flat.data_ptr() % HUGE_PAGE
    try:  # the whole huge pages only: a partial one at the end would take 2 MiB for less
        area.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # the kernel refuses: plain pages
        pass
    return flat[start:start + nbytes].view(dtype).view(shape)
