"""Where a newcomer's first try fails, the first line they read says what happened and what fixes it: a
script without the `__main__` guard under tensor parallelism, a missing optional extra (httpx, the
router, Ray, schemathesis, triton), an unknown or absent device, a port in use, a Hub id with no network.
Command-line errors are one `error:` line and exit code 2, as argparse's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import huggingface_hub
import pytest
import torch

from conveyor.bench import main as bench_main
from conveyor.cli import main
from conveyor.errors import MissingDependencyError, install_command
from conveyor.layers.attention import make_attention_backend
from conveyor.scaleout import routers

from tests.utils import TinyModel
from tools import fuzz, soak

REPO = Path(__file__).resolve().parents[2]
PYTHON = Path(sys.executable)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return TinyModel("llama", tmp_path_factory.mktemp("tiny")).path


def first_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The first line on stderr, after checking that it is the only error and no traceback came with it."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    return err.splitlines()[0]


# -- tensor parallelism from a script without `if __name__ == "__main__":` ------------------------------
def test_a_script_without_the_main_guard_is_told_to_add_it(tiny_model: Path, tmp_path: Path) -> None:
    """The spawned rank re-runs the script, builds an LLM there and leaves at once, quietly; rank 0 raises
    the one error, naming the script and the guard (not "rank 1 exited with code 1" after the child's
    multiprocessing traceback)."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""\
        from conveyor import LLM
        llm = LLM({str(tiny_model)!r}, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=16)
        print("generated", llm.generate(["w5"])[0].outputs[0].text)
    """))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "generated" not in proc.stdout
    assert proc.stderr.count("Traceback") == 1, proc.stderr  # rank 0's own; the rank printed nothing
    error = proc.stderr.strip().splitlines()[-1]  # what Python shows last, under the traceback
    assert error.startswith("conveyor.errors.DistributedError: tensor-parallel rank 1 re-ran the top level of "
                            "your script no_guard.py, which builds an LLM: put that code under "
                            '`if __name__ == "__main__":`'), error


# -- optional extras ------------------------------------------------------------------------------------
def test_install_command_is_the_checkout_s_editable_install(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """The README's setup installs the checkout editable into .venv: the command names this interpreter
    and the checkout, relative to the working directory when inside it."""
    monkeypatch.chdir(REPO)
    python = os.path.relpath(PYTHON) if not os.path.relpath(PYTHON).startswith("..") else str(PYTHON)
    assert install_command("router") == f"{python} -m pip install -e '.[router]'"
    monkeypatch.chdir(tmp_path)
    assert install_command("ray").endswith(f" -m pip install -e '{REPO}[ray]'")


def test_data_parallel_without_httpx_names_the_router_extra(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx -> ModuleNotFoundError
    assert main(["serve", "--model", "unused", "--data-parallel-size", "2"]) == 2
    assert first_error(capsys) == ("error: conveyor serve --data-parallel-size needs httpx, which is not "
                                   f"installed: {install_command('router')}")


def test_data_parallel_without_the_router_names_the_router_extra(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(routers.RouterSpec, "executable", lambda self: None)
    assert main(["serve", "--model", "unused", "--data-parallel-size", "2"]) == 2
    assert first_error(capsys) == f"error: the router 'vllm-router' is not installed: {install_command('router')}"


def test_a_benchmark_without_its_client_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:1"], prog="conveyor bench") == 2
    assert first_error(capsys) == ("error: conveyor bench serve needs httpx, which is not installed: "
                                   f"{install_command('bench')}")


@pytest.mark.parametrize("tool, module, extra", [(soak, "httpx", "bench"), (fuzz, "schemathesis", "test")])
def test_a_qa_tool_without_its_client_names_the_extra(tool: ModuleType, module: str, extra: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    assert tool.main(["--base-url", "http://127.0.0.1:1"]) == 2
    assert first_error(capsys) == (f"error: python -m {tool.__name__} needs {module}, which is not installed: "
                                   f"{install_command(extra)}")


def test_ray_serve_without_ray_names_the_ray_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.scaleout.ray_serve import conveyor_app

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(MissingDependencyError) as error:
        conveyor_app("unused")
    assert str(error.value) == ("conveyor_app (Conveyor on Ray Serve) needs ray, which is not installed: "
                                f"{install_command('ray')}")


def test_triton_attention_without_triton_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("conveyor.layers.attention.triton_available", lambda: False)
    with pytest.raises(ValueError) as error:
        make_attention_backend(torch.device("cpu"), torch.float32, "triton")
    assert str(error.value) == f"attention_backend='triton' needs triton, which is not installed: " \
                               f"{install_command('gpu')}"


# -- devices --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device, message", [
    ("tpu", "error: unknown device 'tpu': give 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("mps", "error: device 'mps': Conveyor runs on CPUs and CUDA GPUs only: give 'auto', 'cpu', 'cuda' or 'cuda:N'"),
])
def test_a_device_conveyor_does_not_run_on_says_which_do(device: str, message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """torch's own errors: a traceback listing its 20 device types, or one at the first tensor moved."""
    assert main(["generate", "--model", "unused", "--device", device, "hi"]) == 2
    assert first_error(capsys) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_to_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "unused", "--device", "cuda", "hi"]) == 2
    line = first_error(capsys)
    assert line.startswith("error: device 'cuda' was asked for, but ") and "run on the CPU (device='cpu', --device " \
                                                                          "cpu)" in line, line


# -- conveyor serve's address ---------------------------------------------------------------------------
@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_said_before_the_model_loads(busy_port: int, tiny_model: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Not uvicorn's "address already in use" (exit 3) after the load."""
    monkeypatch.setattr("conveyor.llm.LLM.__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    for extra in ([], ["--data-parallel-size", "2"]):
        assert main(["serve", str(tiny_model), "--port", str(busy_port), *extra]) == 2
        assert first_error(capsys) == (f"error: port {busy_port} on 127.0.0.1 is already in use (an earlier "
                                       "`conveyor serve` still running?): stop that process, or pass a free port, "
                                       f"e.g. --port {busy_port + 1}")


def test_a_host_that_is_not_this_machine_s_is_named(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("conveyor.llm.LLM.__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", str(tiny_model), "--host", "192.0.2.1"]) == 2  # TEST-NET-1: nobody's address
    assert first_error(capsys) == ("error: --host 192.0.2.1 is not an address of this machine: give one of its "
                                   "own, e.g. --host 127.0.0.1 or --host 0.0.0.0 (every interface)")


# -- a Hub id with no network ---------------------------------------------------------------------------
def test_a_hub_id_without_network_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Online (HF_HUB_OFFLINE unset) but the Hub does not answer: huggingface_hub's three lines become one
    that names the cause and the ways out (not only "check your internet connection" on a second line)."""
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert main(["generate", "--model", "org/model", "--download-dir", str(tmp_path), "hi"]) == 2
    line = first_error(capsys)
    assert line.startswith("error: cannot download org/model: the Hugging Face Hub did not answer (ConnectError: ")
    assert line.endswith(f"and it is not in the cache {tmp_path}: check the network (behind a proxy: HTTPS_PROXY), "
                         "or download it where the Hub answers (hf download org/model) and point --download-dir "
                         "(HF_HUB_CACHE) at that cache, or give a local model directory or .gguf file"), line
