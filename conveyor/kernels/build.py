"""Compiling the native CPU kernels into shared libraries, once per compiler and CPU.

The kernels are plain C++ behind a C ABI (no torch, pybind11 or Python headers: `runtime.h`), so a
build depends on its sources, its flags, the compiler and the CPU's vector instructions and nothing
else: it is cached under `~/.cache/conveyor/kernels/NAME-KEY/` (or `$CONVEYOR_KERNEL_CACHE`), and every
virtual environment, checkout and Python version on the machine loads the same file. The sources of a
library compile in parallel, one compiler process per core, then link; a file lock makes a second
process wait for a build under way instead of building again (the lock dies with its process, so a
build killed half way leaves nothing stale). `-march=native` targets the CPU it runs on;
`CONVEYOR_MARCH` overrides the target (`haswell`: the AVX2 paths, `x86-64`: the plain C++ ones).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .cpu import vector_flags

logger = logging.getLogger("conveyor")

SOURCE_DIR = Path(__file__).parent
COMPILERS = ("c++", "g++", "clang++")
INSTALL_HINT = ("install one (Debian/Ubuntu: `apt-get install g++`; Fedora: `dnf install gcc-c++`) and run "
                "`conveyor build-kernels`")


@dataclass(frozen=True)
class Library:
    """One shared library: its sources (largest first, so the parallel build ends together), the flags
    each adds (contraction into fused multiply-adds off where a kernel must round as PyTorch does)."""

    name: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]


KERNELS = Library("conveyor_kernels", (
    ("decode_attention_bf16.cpp", ("-ffp-contract=off",)),
    ("decode_attention_f32.cpp", ("-ffp-contract=off",)),
    ("decode_attention_i8.cpp", ("-ffp-contract=off",)),
    ("prefill_attention_cpu.cpp", ("-ffp-contract=off",)),
    ("quant_gemm.cpp", ("-ffp-contract=fast",)),
    ("decode_stack_cpu.cpp", ("-ffp-contract=fast",)),
    ("moe_cpu.cpp", ("-ffp-contract=fast",)),
    ("lora_cpu.cpp", ("-ffp-contract=fast",)),
    ("sampling_cpu.cpp", ("-ffp-contract=fast",)),
    ("matmul_cpu.cpp", ("-ffp-contract=fast",)),
    ("quant_tiles.cpp", ("-ffp-contract=fast",)),
    ("fused_cpu.cpp", ("-ffp-contract=off",)),
    ("ssm_cpu.cpp", ("-ffp-contract=off",)),
    ("paged_attention_cpu.cpp", ("-ffp-contract=off",)),
    ("runtime.cpp", ()),
))
# The compute-peak loops only the roofline diagnostics use: built at their first use, never at start.
PEAKS = Library("conveyor_peak", (("peak_cpu.cpp", ()), ("runtime.cpp", ())))


class BuildError(RuntimeError):
    """A compile or link that failed; the message holds the compiler's own last lines."""


def compiler() -> str | None:
    """The C++ compiler: `$CXX`, else the first of c++, g++, clang++ on the PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


@cache
def compiler_identity(cxx: str) -> str:
    """What the compiler says it is (`--version`, `-dumpmachine`): another compiler is another build."""
    out = [subprocess.run([cxx, flag], capture_output=True, text=True, timeout=60).stdout.strip()
           for flag in ("--version", "-dumpmachine")]
    return "\n".join(out)


def common_flags() -> list[str]:
    march = os.environ.get("CONVEYOR_MARCH", "native")
    return ["-std=c++20", "-O3", f"-march={march}", "-fPIC", "-fopenmp", "-fvisibility=hidden"]


def cache_root() -> Path:
    if os.environ.get("CONVEYOR_KERNEL_CACHE"):
        return Path(os.environ["CONVEYOR_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "conveyor" / "kernels"


def build_key(library: Library, cxx: str, flags: list[str]) -> str:
    """A digest of everything a build depends on: the sources and every header beside them, the flags,
    the compiler and (for -march=native) the CPU's vector flags. Not torch or Python: none is included."""
    digest = hashlib.sha256()
    files = sorted({*(s for s, _ in library.sources), *(p.name for p in SOURCE_DIR.glob("*.h"))})
    for name in files:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    for source, extra in library.sources:
        digest.update(f"{source}:{' '.join(extra)}".encode())
    digest.update(" ".join([*flags, compiler_identity(cxx), *vector_flags()]).encode())
    return digest.hexdigest()[:16]


def library_path(library: Library, cxx: str) -> Path:
    key = build_key(library, cxx, common_flags())
    return cache_root() / f"{library.name}-{key}" / f"lib{library.name}.so"


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
        raise BuildError(f"`{' '.join(command)}` failed:\n{tail}")


def compile_library(library: Library, cxx: str, target: Path, jobs: int | None = None) -> None:
    """Every source compiled in parallel (`jobs` processes, default one per CPU), then linked into
    `target`, written last and atomically (a reader sees the whole file or none)."""
    flags = common_flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as tmp:
        objects = [Path(tmp) / f"{Path(s).stem}.o" for s, _ in library.sources]
        commands = [[cxx, *flags, *extra, "-c", str(SOURCE_DIR / source), "-o", str(obj)]
                    for (source, extra), obj in zip(library.sources, objects)]
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            for _ in pool.map(_run, commands):
                pass
        linked = Path(tmp) / target.name
        _run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(linked)])
        os.replace(linked, target)


def build(library: Library) -> Path | None:
    """The library's file, built first if this compiler and CPU have none yet; None (with one log line
    saying why and what to do) when there is no compiler or the build fails."""
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (looked for $CXX, %s): the native CPU kernels are off and the "
                       "slower PyTorch code runs instead; %s", ", ".join(COMPILERS), INSTALL_HINT)
        return None
    target = library_path(library, cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then take its file
        if target.exists():
            return target
        logger.info("building native kernels %s (%d sources, %d at a time) under %s: once per compiler and CPU",
                    library.name, len(library.sources), os.cpu_count() or 1, target.parent)
        started = time.monotonic()
        try:
            compile_library(library, cxx, target)
        except (BuildError, OSError) as exc:
            logger.warning("native kernels %s could not be built, the PyTorch code runs instead: %s",
                           library.name, exc)
            return None
        logger.info("built native kernels %s in %.0f s", library.name, time.monotonic() - started)
    return target
