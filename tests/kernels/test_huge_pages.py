"""Weight tiles sit on transparent huge pages (kernels/huge_pages.py) where the kernel gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.kernels import huge_pages

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not MODE.exists() or "[never]" in MODE.read_text(), reason="no transparent huge pages here")
def test_buffer_is_aligned_and_backed_by_huge_pages() -> None:
    for _ in range(3):  # after big frees the heap holds touched 4 KiB pages: not these
        torch.empty(20 << 20, dtype=torch.uint8).fill_(0)
    t = huge_pages.empty(4, 3 << 20)
    assert t.shape == (4, 3 << 20) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1)  # the first writes fault the pages in
    assert anon_huge_kib(t.data_ptr()) >= 12 << 10
    assert int(t.sum()) == 12 << 20


def test_small_buffers_and_the_off_switch_take_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert huge_pages.empty(1 << 20).shape == (1 << 20,)
    monkeypatch.setenv("CONVEYOR_HUGE_PAGES", "0")
    t = huge_pages.empty(8, 1 << 20, dtype=torch.float32)
    assert t.shape == (8, 1 << 20) and t.dtype == torch.float32
    assert not huge_pages.enabled()
