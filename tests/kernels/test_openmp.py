"""`LLM` leaves no OpenMP team on the thread that built it (`kernels/openmp.py`): the engine thread's is
the process's only one, so libgomp keeps spinning at barriers instead of sleeping on futexes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.kernels.openmp import run_on_fresh_thread

from tests.utils import TinyModel

# In a fresh process (the test runner's main thread has teams of its own by now): native threads that are
# not Python threads, i.e. OpenMP workers, before and after building an LLM whose loader runs a parallel op,
# then after the main thread runs one itself (the check can fail).
NATIVE_THREADS = r"""
import os, sys, threading, time
import torch

def native_threads():
    time.sleep(0.3)  # a finished thread's pool workers leave asynchronously
    return len(os.listdir("/proc/self/task")) - threading.active_count()
"""

SCRIPT = NATIVE_THREADS + r"""
import conveyor.llm

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


def thread_counts(script: str, model: TinyModel, count: int) -> list[int]:
    """The last `count` numbers `script` prints, run in a fresh process on `model`."""
    if sys.platform != "linux":
        pytest.skip("reads /proc")
    out = subprocess.run([sys.executable, "-c", script, str(model.path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(n) for n in out.stdout.split()[-count:]]


def test_llm_leaves_no_openmp_team_on_the_caller(tiny_llama: TinyModel) -> None:
    before, after, main_team = thread_counts(SCRIPT, tiny_llama, 3)
    assert after == before, (before, after, main_team)
    assert main_team == before + 1, (before, after, main_team)  # the main thread's own team: one worker more


# A served LLM: requests, a /metrics scrape (the KV pool's resident pages: 40,000 pages a layer, more than
# one OpenMP grain) and a streamed request start no OpenMP team on the server's threads.
SERVED = NATIVE_THREADS + r"""
import json, urllib.request
from conveyor import LLM
from conveyor.server import BackgroundServer

def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=60).read()

torch.set_num_threads(2)
llm = LLM(sys.argv[1], dtype="float32", num_gpu_blocks_override=40000)
with BackgroundServer(llm) as url:
    post(url + "/v1/completions", {"model": llm.model_name, "prompt": [5, 6, 7], "max_tokens": 4})
    before = native_threads()
    metrics = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    assert "kv_cache_resident_bytes" in metrics
    post(url + "/v1/completions", {"model": llm.model_name, "prompt": [8, 9], "max_tokens": 4, "stream": True})
    print(before, native_threads())
"""


def test_serving_starts_no_second_openmp_team(tiny_llama: TinyModel) -> None:
    before, after = thread_counts(SERVED, tiny_llama, 2)
    assert after == before, (before, after)


def test_run_on_fresh_thread_returns_and_raises() -> None:
    import threading

    main = threading.get_ident()
    assert run_on_fresh_thread(lambda: threading.get_ident()) != main
    with pytest.raises(KeyError, match="boom"):
        run_on_fresh_thread(lambda: {}["boom"])
