"""The native kernels' build (kernels/build.py): what its key covers (and that torch and Python are not
in it, so every environment shares one build), one build for many processes, the lock that makes a
second one wait, the one line a machine without a compiler gets, a failed compile's message, and
`conveyor build-kernels`."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conveyor import cli, kernels
from conveyor.kernels import build

SOURCES = {"answer.cpp": '#include "api.h"\nAPI int answer() { return 42; }\n',
           "twice.cpp": '#include "api.h"\nAPI int twice(int x) { return 2 * x; }\n',
           "api.h": '#pragma once\n#define API extern "C" __attribute__((visibility("default")))\n'}
TINY = build.Library("conveyor_tiny", (("answer.cpp", ()), ("twice.cpp", ("-ffp-contract=off",))))


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of tiny sources in place of the kernels', and an empty cache."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name, text in SOURCES.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(build, "SOURCE_DIR", folder)
    monkeypatch.setenv("CONVEYOR_KERNEL_CACHE", str(tmp_path / "cache"))
    return folder


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every compiler command a build runs."""
    commands: list[list[str]] = []
    run = build._run

    def counted(command: list[str]) -> None:
        commands.append(command)
        run(command)

    monkeypatch.setattr(build, "_run", counted)
    return commands


def key(cxx: str = "c++") -> str:
    return build.build_key(TINY, cxx, build.common_flags())


def test_key_covers_sources_headers_flags_compiler_and_cpu(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build.compiler_identity.cache_clear()
    monkeypatch.setattr(build, "compiler_identity", lambda cxx: f"compiler {cxx}")
    base = key()
    assert key() == base  # deterministic: a second start finds its build
    assert key("clang++") != base
    with monkeypatch.context() as m:
        m.setenv("CONVEYOR_MARCH", "haswell")
        assert key() != base
    with monkeypatch.context() as m:
        m.setattr(build, "vector_flags", lambda: ["avx2"])
        assert key() != base
    (sources / "api.h").write_text(SOURCES["api.h"] + "// changed\n")
    changed_header = key()
    assert changed_header != base
    (sources / "answer.cpp").write_text(SOURCES["answer.cpp"].replace("42", "43"))
    assert key() not in (base, changed_header)


def test_key_leaves_out_torch_and_python(sources: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two virtual environments, torch versions or Pythons on one machine load the same build."""
    base = key()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    monkeypatch.setattr(sys, "version", "3.0.0 (another interpreter)")
    assert key() == base


def test_built_once_in_parallel_then_found(sources: Path, compiles: list[list[str]],
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor")
    path = build.build(TINY)
    assert path is not None and path.name == "libconveyor_tiny.so"
    lib = ctypes.CDLL(str(path))
    assert lib.answer() == 42 and lib.twice(21) == 42
    assert len(compiles) == 3  # two sources, one link
    assert any("-ffp-contract=off" in c and c[-3].endswith("twice.cpp") for c in compiles)
    assert not any("torch" in part for c in compiles for part in c)  # no torch headers or libraries
    assert build.build(TINY) == path and len(compiles) == 3  # the cached file, nothing compiled
    assert sorted(p.name for p in path.parent.iterdir()) == ["libconveyor_tiny.so", "lock"]  # no build leftovers
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("building native kernels conveyor_tiny") for m in messages) == 1
    assert any(m.startswith("built native kernels conveyor_tiny in ") and m.endswith(" s") for m in messages)


def test_a_second_process_waits_for_the_build_under_way(sources: Path, compiles: list[list[str]]) -> None:
    """While another holds the lock, `build` waits; it then takes the other's file instead of compiling."""
    target = build.library_path(TINY, build.compiler())
    target.parent.mkdir(parents=True)
    result: list[Path | None] = []
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: result.append(build.build(TINY)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not result  # waiting on the lock
        target.write_bytes(b"built by the other process")
    waiter.join(timeout=60)
    assert result == [target] and compiles == []


def test_no_compiler_is_one_line_that_says_what_to_do(sources: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build.build(TINY) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no C++ compiler found" in warnings[0] and "PyTorch code runs instead" in warnings[0]
    assert "apt-get install g++" in warnings[0] and "conveyor build-kernels" in warnings[0]


def test_a_failed_compile_names_the_error_and_leaves_nothing(sources: Path, caplog: pytest.LogCaptureFixture) -> None:
    (sources / "answer.cpp").write_text("int answer( { return 42; }\n")
    assert build.build(TINY) is None
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "conveyor_tiny could not be built" in warning and "answer.cpp" in warning and "error" in warning
    folder = build.library_path(TINY, build.compiler()).parent
    assert [p.name for p in folder.iterdir()] == ["lock"]


def test_build_kernels_command_reports_each_library(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(kernels, "build_all", lambda peaks: {"conveyor_kernels": 12.0, "conveyor_peak": None}
                        if peaks else {"conveyor_kernels": 12.0})
    assert cli.main(["build-kernels"]) == 0
    assert "conveyor_kernels: ready (12 s)" in capsys.readouterr().out
    assert cli.main(["build-kernels", "--peaks"]) == 1
    assert "conveyor_peak: unavailable" in capsys.readouterr().out
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert cli.main(["build-kernels"]) == 0 and "nothing to build" in capsys.readouterr().out


def test_kernels_share_one_openmp_runtime_with_torch() -> None:
    """The library binds to the OpenMP runtime torch loaded (one team of threads for both)."""
    assert kernels.cpu_matmul_ops() is not None
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(loaded) == 1, loaded
