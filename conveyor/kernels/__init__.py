"""Optional native kernels, compiled on first use with torch's C++ extension builder.

Built once per machine and environment (cached by torch under `~/.cache/torch_extensions`, or
`$TORCH_EXTENSIONS_DIR`, ~40 s each the first time) for CPU: paged attention, the fused elementwise
ops of the decoder layer (RMSNorm, RoPE, SiLU * up), the weight-streaming matmuls over quantized,
bf16 and fp32 weights, and the compute-peak loops the benchmarks measure against. Each extension's
name carries a digest of its source, the compiler flags, the torch version and install folder (its
headers' paths are in the compile command, which ninja rebuilds on when it changes), the Python
version and headers, and the CPU's vector-instruction flags, so two environments (or two CPUs
sharing a home directory) never load or rebuild each other's builds; the sources are built from a
copy named by that digest, so checkouts of the same sources share one build. `conveyor
build-kernels` (run by scripts/setup.sh) builds them all ahead of the first start; a build logs what it
builds, where, and how long it took. `-march=native` picks the instruction set of the CPU it is
built on (AVX2, AVX-512, VNNI, BF16). `CONVEYOR_MARCH` overrides that target (e.g. `haswell` for the
AVX2 paths, `x86-64` for the plain C++ ones: how the tests check the code paths this CPU would not
take). If one cannot be built (no compiler), the PyTorch code runs instead.
`CONVEYOR_NATIVE_KERNELS=0` turns them all off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("conveyor")

# CPU flags that change what -march=native compiles; read from /proc/cpuinfo where there is one.
_VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                 "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")


def native_kernels_enabled() -> bool:
    return os.environ.get("CONVEYOR_NATIVE_KERNELS") != "0"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vector_flags() -> list[str]:
    """The vector-instruction flags of this CPU that matter to the kernels, for logs and figures."""
    return [f for f in _VECTOR_FLAGS if f in cpu_flags()]


def _build_key(sources: list[Path], cflags: list[str]) -> str:
    import torch

    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode())  # includes resolve by name in the staged copy
        digest.update(source.read_bytes())
    environment = [torch.__version__, str(Path(torch.__file__).resolve().parent), sys.version,
                   sysconfig.get_paths()["include"], platform.machine(), *vector_flags()]
    digest.update(" ".join([*cflags, *environment]).encode())
    return digest.hexdigest()[:12]


def _extensions_root() -> Path:
    """Where torch builds extensions: `$TORCH_EXTENSIONS_DIR/NAME`, else `~/.cache/torch_extensions/py3XX_cpu/NAME`."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _build_dirs(root: Path, full_name: str, pattern: str) -> list[Path]:
    """`pattern` in the extension's build folder, with or without torch's `py3XX_cpu` level."""
    return [*root.glob(f"{full_name}/{pattern}"), *root.glob(f"*/{full_name}/{pattern}")]


def _stage(files: list[Path], folder: Path) -> list[Path]:
    """The files copied into `folder` (once; named by the build key, so the content is the same): torch
    rebuilds an extension whose source paths change, so two checkouts of the same sources would
    otherwise rebuild each other's build on every start."""
    staged = [folder / f.name for f in files]
    if not all(s.exists() for s in staged):
        folder.mkdir(parents=True, exist_ok=True)
        for source, target in zip(files, staged):
            tmp = target.with_suffix(f"{target.suffix}.{os.getpid()}.tmp")
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
    return staged


# A build lock older than this was left by a build that died (builds take ~1 minute).
STALE_LOCK_S = 600


def _clear_stale_lock(root: Path, full_name: str) -> None:
    """torch waits forever on the lock file of a build that was killed (Ctrl-C during the first
    start): remove one that has not moved for `STALE_LOCK_S` seconds, with a warning."""
    for lock in _build_dirs(root, full_name, "lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > STALE_LOCK_S:
                logger.warning("removing the stale build lock %s (%.0f s old: a build that died)", lock, age)
                lock.unlink()
        except FileNotFoundError:
            pass


def _build(name: str, sources: list[str], *cflags: str, headers: tuple[str, ...] = ()) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    paths = [Path(__file__).with_name(s) for s in sources]
    flags = ["-O3", f"-march={os.environ.get('CONVEYOR_MARCH', 'native')}", *cflags, "-fopenmp"]
    full_name = f"{name}_{_build_key(paths + [Path(__file__).with_name(h) for h in headers], flags)}"
    root = _extensions_root()
    paths = _stage(paths + [Path(__file__).with_name(h) for h in headers], root / "sources" / full_name)[:len(paths)]
    fresh = not _build_dirs(root, full_name, "*.so")
    _clear_stale_lock(root, full_name)
    if fresh:
        logger.info("building native kernel %s from %s under %s (once per environment, about 40 s on a quiet "
                    "machine; `conveyor build-kernels` does it ahead)", full_name, ", ".join(sources), root)
    started = time.monotonic()
    try:
        module = load(name=full_name, sources=[str(p) for p in paths], extra_cflags=flags,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers: the PyTorch path still works
        logger.warning("native kernel %s unavailable, using PyTorch instead: %s", name, exc)
        return None
    if fresh:
        logger.info("built native kernel %s in %.0f s", full_name, time.monotonic() - started)
    return module


@cache
def cpu_paged_attention() -> ModuleType | None:
    """The paged attention extension (decode and prefill), or None when the build fails. No contraction
    into fused multiply-adds: the kernels say where they fuse (`fmadd`), so decode and prefill round a
    query's arithmetic alike (`attention_blocks.h`)."""
    return _build("conveyor_paged_attention_cpu", ["paged_attention_cpu.cpp", "prefill_attention_cpu.cpp"],
                  "-ffp-contract=off",
                  headers=("attention_blocks.h", "attention_cpu.h", "prefill_attention_cpu.h", "vec_math.h"))


@cache
def cpu_fused_ops() -> ModuleType | None:
    """The fused elementwise ops (`rms_norm`, `rope_`, `silu_mul`), or None when the build fails. No
    contraction into fused multiply-adds, so each op rounds like the PyTorch ops it replaces."""
    return _build("conveyor_fused_cpu", ["fused_cpu.cpp"], "-ffp-contract=off", headers=("row_ops.h", "vec_math.h"))


@cache
def cpu_matmul_ops() -> ModuleType | None:
    """Weight-streaming matmuls over GGUF-quantized, int8, bf16 and fp32 weights (`matmul_cpu.cpp`,
    `quant_tiles.cpp`, `quant_gemm.cpp`), the native decode stack (`decode_stack_cpu.cpp`) and a
    mixture-of-experts layer's grouped experts (`moe_cpu.cpp`), or None when the build fails."""
    return _build("conveyor_matmul_cpu", ["matmul_cpu.cpp", "quant_tiles.cpp", "quant_gemm.cpp", "decode_stack_cpu.cpp",
                                          "moe_cpu.cpp"],
                  "-ffp-contract=fast",
                  headers=("quant.h", "quant_layout.h", "attention_blocks.h", "attention_cpu.h", "row_ops.h",
                           "tiled_linear.h", "vec_math.h"))


@cache
def cpu_sampling_ops() -> ModuleType | None:
    """Sampling of many rows (`sampling_cpu.cpp`: `sample_rows`), or None when the build fails."""
    return _build("conveyor_sampling_cpu", ["sampling_cpu.cpp"], headers=("vec_math.h",))


@cache
def cpu_peak_ops() -> ModuleType | None:
    """The compute-peak loops of each instruction path (`peak_cpu.cpp`: `peak_kinds()`,
    `peak_gops(kind, threads)`) that `bench roofline`/`step` set the linears against, or None."""
    return _build("conveyor_peak_cpu", ["peak_cpu.cpp"])


KERNELS = {"paged attention": cpu_paged_attention, "fused ops": cpu_fused_ops, "matmuls": cpu_matmul_ops,
           "sampling": cpu_sampling_ops, "peak loops": cpu_peak_ops}


def build_all() -> dict[str, bool]:
    """Build (or load from the cache) every native kernel; whether each is available."""
    return {name: build() is not None for name, build in KERNELS.items()}
