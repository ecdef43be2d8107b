"""The native kernels' build cache: what its key covers, that two environments keep their own builds,
that checkouts of the same sources share one, stale locks, that a build says what it does, and
`conveyor build-kernels`."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from conveyor import cli, kernels


class NinjaLikeLoad:
    """Stands in for torch's `load`: one build folder per extension name, rebuilt (as ninja does) when the
    compile command differs from the one it was built with; the command holds the torch headers' path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.builds: list[str] = []

    def __call__(self, name: str, sources: list[str], extra_cflags: list[str], extra_ldflags: list[str],
                 verbose: bool) -> types.ModuleType:
        folder = self.root / name
        command = " ".join([*extra_cflags, "-isystem", str(Path(torch.__file__).parent / "include"), *sources])
        so, recorded = folder / f"{name}.so", folder / "command"
        if not so.exists() or recorded.read_text() != command:
            folder.mkdir(exist_ok=True)
            so.write_bytes(b"built")
            recorded.write_text(command)
            self.builds.append(name)
        return types.ModuleType(name)


def in_environment(monkeypatch: pytest.MonkeyPatch, root: Path, venv: str) -> None:
    """As if torch were installed in another virtual environment (same version, another folder)."""
    monkeypatch.setattr(torch, "__file__", str(root / venv / "site-packages" / "torch" / "__init__.py"))


def test_two_environments_do_not_evict_each_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    load = NinjaLikeLoad(cache)
    monkeypatch.setattr(cpp_extension, "load", load)
    caplog.set_level(logging.INFO, logger="conveyor")
    for venv in ("venv-a", "venv-b", "venv-a", "venv-b", "venv-a"):  # starts alternating between two venvs
        in_environment(monkeypatch, tmp_path, venv)
        assert kernels._build("conveyor_test_kernel", ["fused_cpu.cpp"], "-ffp-contract=off") is not None
    assert len(load.builds) == 2 and len(set(load.builds)) == 2  # each environment built once, kept its own
    assert sorted(p.name for p in cache.iterdir() if p.name != "sources") == sorted(load.builds)
    building = [r.getMessage() for r in caplog.records if r.getMessage().startswith("building native kernel")]
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built native kernel")]
    assert len(building) == 2 and len(built) == 2  # cached loads say nothing
    assert "fused_cpu.cpp" in building[0] and str(cache) in building[0] and "about 40 s" in building[0]
    assert load.builds[0] in built[0] and built[0].endswith(" s")


def test_cache_key_covers_source_flags_torch_and_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    base = kernels._build_key([source], ["-O3"])
    assert kernels._build_key([source], ["-O3"]) == base  # deterministic: a second start finds its build
    assert kernels._build_key([source], ["-O2"]) != base
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.1")
        assert kernels._build_key([source], ["-O3"]) != base
    with monkeypatch.context() as m:
        m.setattr(sys, "version", "3.0.0 (another interpreter)")
        assert kernels._build_key([source], ["-O3"]) != base
    with monkeypatch.context() as m:
        in_environment(m, tmp_path, "other-venv")
        assert kernels._build_key([source], ["-O3"]) != base
    source.write_text("int f() { return 2; }\n")
    assert kernels._build_key([source], ["-O3"]) != base


def test_build_kernels_command_reports_each_kernel(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(kernels, "KERNELS", {"paged attention": lambda: types.ModuleType("a"),
                                             "matmuls": lambda: None})
    assert cli.main(["build-kernels"]) == 1
    out = capsys.readouterr().out
    assert "paged attention: ready" in out and "matmuls: unavailable" in out
    monkeypatch.setattr(kernels, "KERNELS", {"fused ops": lambda: types.ModuleType("f")})
    assert cli.main(["build-kernels"]) == 0
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert cli.main(["build-kernels"]) == 0 and "nothing to build" in capsys.readouterr().out


def test_checkouts_with_the_same_sources_build_from_the_same_paths(tmp_path: Path) -> None:
    staged = []
    for checkout in ("a", "b"):
        src = tmp_path / checkout
        src.mkdir()
        (src / "k.cpp").write_text("int f() { return 1; }\n")
        (src / "k.h").write_text("int f();\n")
        staged.append(kernels._stage([src / "k.cpp", src / "k.h"], tmp_path / "cache" / "k_0123"))
    assert staged[0] == staged[1] == [tmp_path / "cache" / "k_0123" / "k.cpp", tmp_path / "cache" / "k_0123" / "k.h"]
    assert staged[0][0].read_text() == "int f() { return 1; }\n"
    mtime = staged[0][0].stat().st_mtime_ns
    kernels._stage([tmp_path / "a" / "k.cpp", tmp_path / "a" / "k.h"], tmp_path / "cache" / "k_0123")
    assert staged[0][0].stat().st_mtime_ns == mtime  # not copied again: torch sees an unchanged source


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    import os
    import time

    for name, age in (("old_1", kernels.STALE_LOCK_S + 5), ("new_1", 5)):
        (tmp_path / "py311_cpu" / name).mkdir(parents=True)
        lock = tmp_path / "py311_cpu" / name / "lock"
        lock.touch()
        os.utime(lock, (time.time() - age, time.time() - age))
        kernels._clear_stale_lock(tmp_path, name)
    assert not (tmp_path / "py311_cpu" / "old_1" / "lock").exists()
    assert (tmp_path / "py311_cpu" / "new_1" / "lock").exists()
