"""One OpenMP team per process: heavy set-up work runs on a thread that exits, not on the caller's.

libgomp keeps a pool of worker threads for every thread that ever started a parallel region, for as
long as that thread lives, and counts them all. Once they outnumber the CPUs, every team spins only
~100 times at a barrier or at the end of a region before sleeping on a futex, so each of the
thousands of regions a step starts (every PyTorch op over a big tensor, MKL's GEMMs, the native
kernels) pays a futex wake-up, which costs tens of microseconds in a VM. The main thread that
loads the model (and lives forever) leaves such a pool behind, and the engine thread that runs the
steps starts a second one: measured on 2 cores, a 1024 x 2048 fp32 add on a thread took 530-715 us
with the main thread's pool alive against 355-400 us without; the native decode stack at 2 threads
took 20-35 ms a step against 9 ms. So `LLM` builds the model and the engine on a short-lived
thread (`run_on_fresh_thread`): its pool goes when it exits, and the engine thread's is the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_on_fresh_thread(fn: Callable[[], T], name: str = "conveyor-setup") -> T:
    """`fn()` on a new thread, joined: its result, or its exception re-raised here."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller, who sees it as if fn ran there
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
