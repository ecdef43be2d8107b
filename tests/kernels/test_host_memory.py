"""The CPU process's memory (kernels/host_memory.py). Huge pages: where the kernel gives them, a large
tensor starts on a 2 MiB boundary of memory marked MADV_HUGEPAGE, and behaves as torch.empty's;
CONVEYOR_HUGE_PAGES=0 and small tensors keep plain allocations. Freed memory kept: a step's buffers
come back without page faults."""

import subprocess
import sys

import pytest
import torch

from conveyor.kernels import cpu_matmul_ops, host_memory

from tests.utils import smaps_fields


@pytest.fixture
def mode(monkeypatch):
    def set_mode(flag: str | None) -> str:
        if flag is None:
            monkeypatch.delenv("CONVEYOR_HUGE_PAGES", raising=False)
        else:
            monkeypatch.setenv("CONVEYOR_HUGE_PAGES", flag)
        host_memory.thp_mode.cache_clear()
        return host_memory.thp_mode()

    yield set_mode
    host_memory.thp_mode.cache_clear()


def test_a_large_tensor_is_aligned_marked_and_usable(mode):
    if mode(None) == "off":
        pytest.skip("transparent huge pages are off on this machine")
    t = host_memory.empty((3, 5 * 2**20 // 4 + 7), torch.float32)
    assert t.shape == (3, 5 * 2**20 // 4 + 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    if host_memory.thp_mode() == "madvise":
        assert "hg" in smaps_fields(t.data_ptr())["VmFlags"]
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert t[2, -1].item() == t.numel() - 1 and t.sum().item() == pytest.approx(t.numel() * (t.numel() - 1) / 2)


def test_small_tensors_and_the_switch_keep_plain_allocations(mode):
    mode(None)
    small = host_memory.empty((1000,), torch.bfloat16)
    assert small.untyped_storage().nbytes() == 2000  # no padding for a tensor under two huge pages
    assert mode("0") == "off"
    large = host_memory.empty((8 * 2**20,), torch.uint8)
    assert large.untyped_storage().nbytes() == 8 * 2**20  # torch.empty's own (no 2 MiB alignment padding)


def test_weight_tiles_start_on_huge_pages(mode):
    if mode(None) == "off":
        pytest.skip("transparent huge pages are off on this machine")
    ops = cpu_matmul_ops()
    if ops is None:
        pytest.skip("no native kernels")
    rows = torch.randint(0, 256, (2048, ops.row_bytes(8, 2048)), dtype=torch.uint8)  # Q8_0
    assert ops.repack_tiles(rows, 8, 2048).data_ptr() % host_memory.HUGE_PAGE == 0


ROUNDS = """
import resource, sys, torch
from conveyor.kernels import host_memory
if sys.argv[1] == "keep" and not host_memory.keep_freed_memory():
    print("not glibc"); sys.exit()
for _ in range(5):  # a step's worth of buffers: allocated, written, all freed at its end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(2 * 2**20, dtype=torch.float32) for _ in range(6)]  # 8 MiB each
    for b in buffers:
        b.fill_(1.0)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del buffers
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_freed_memory_comes_back_without_page_faults():
    # in a fresh interpreter: what glibc does with a long-lived process' heap depends on its history
    def faults(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True).stdout
        if "not glibc" in out:
            pytest.skip("not glibc")
        return [int(x) for x in out.split()]

    pages = 6 * 8 * 2**20 // 4096
    # the heap settles within a few rounds (its first ones may still fault part of it in), then reuses them
    assert faults("keep")[-1] < 0.1 * pages
    assert faults("default")[1] > 0.5 * pages  # by glibc's own thresholds the second round faulted afresh
