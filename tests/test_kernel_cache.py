"""The native kernels' build cache: checkouts of the same sources share one build."""

from __future__ import annotations

from pathlib import Path

from conveyor import kernels


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
