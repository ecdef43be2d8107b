"""`LLM` leaves no OpenMP team on the thread that built it (`kernels/openmp.py`): the engine thread's is
the process's only one, so libgomp keeps spinning at barriers instead of sleeping on futexes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.kernels.openmp import run_on_fresh_thread

# In a fresh process (the test runner's main thread has teams of its own by now): native threads that are
# not Python threads, i.e. OpenMP workers, before and after building an LLM whose loader runs a parallel op,
# then after the main thread runs one itself (the check can fail).
SCRIPT = r"""
import os, sys, threading, time
import torch
import conveyor.llm

def native_threads():
    time.sleep(0.3)  # a finished thread's pool workers leave asynchronously
    return len(os.listdir("/proc/self/task")) - threading.active_count()

build_model = conveyor.llm.build_model
def parallel_build(*args, **kwargs):
    torch.randn(2048, 1024).add(1.0)  # big enough for an OpenMP team
    return build_model(*args, **kwargs)
conveyor.llm.build_model = parallel_build
torch.set_num_threads(2)
before = native_threads()
llm = conveyor.llm.LLM(sys.argv[1], dtype="float32")
after = native_threads()
torch.randn(2048, 1024).add(1.0)
print(before, after, native_threads())
"""


def test_llm_leaves_no_openmp_team_on_the_caller(tiny_llama) -> None:
    if sys.platform != "linux":
        pytest.skip("reads /proc")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama.path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after, main_team = map(int, out.stdout.split()[-3:])
    assert after == before, out.stdout
    assert main_team == before + 1, out.stdout  # the main thread's own team: one worker thread more


def test_run_on_fresh_thread_returns_and_raises() -> None:
    import threading

    main = threading.get_ident()
    assert run_on_fresh_thread(lambda: threading.get_ident()) != main
    with pytest.raises(KeyError, match="boom"):
        run_on_fresh_thread(lambda: {}["boom"])
