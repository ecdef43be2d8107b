"""The long native kernels run without the GIL, so a server's event loop renders and sends tokens while
the model computes (the LM head's matmul, sampling, attention and the decode stack release it)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from conveyor.kernels import cpu_matmul_ops, cpu_sampling_ops
from conveyor.layers.quantization.linear import QuantMatmul
from conveyor.layers.quantization.tensors import quantize_int8


def python_progress_during(call: Callable[[], object], repeats: int) -> int:
    """How many times another thread ran Python while `call()` ran `repeats` times: none if `call` holds
    the GIL throughout. The interpreter's switch interval is made long, so the caller keeps the GIL
    between calls and the other thread (which lets go of it at every turn) runs only inside them; the
    calls run on one OpenMP thread, so a core is free for it."""
    stamps: list[float] = []
    windows: list[tuple[float, float]] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0)  # lets go of the GIL

    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=other)
    try:
        thread.start()
        time.sleep(0.05)
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            windows.append((start, time.perf_counter()))
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    return sum(1 for s in stamps for a, b in windows if a + 0.001 < s < b - 0.001)


def test_lm_head_matmul_and_sampling_release_the_gil() -> None:
    ops, sampling = cpu_matmul_ops(), cpu_sampling_ops()
    if ops is None or sampling is None:
        pytest.skip("native kernels unavailable")
    head = QuantMatmul([quantize_int8(torch.randn(16384, 576))])
    x = torch.randn(256, 576)
    # measured: ~150 a call released (the other thread's turns cost ~0.15 ms each here), ~15 a call held
    assert python_progress_during(lambda: head(x), 4) > 200
    logits = torch.randn(400, 49152)
    params = torch.tensor([[1.0, 0.0, 0.9, 0.0]] * 400, dtype=torch.float64)
    sample = lambda: sampling.sample_rows(logits, params, torch.rand(400, dtype=torch.float64))  # noqa: E731
    assert python_progress_during(sample, 2) > 200
