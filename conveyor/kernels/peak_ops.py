"""The compute-peak loops of each instruction path (peak_cpu.cpp), which the roofline diagnostics set
the linears' rates against. Their own library, built at first use."""

from __future__ import annotations

import ctypes

from .native import F64, I32, I64, Native, bind


class PeakOps(Native):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._kinds = bind(lib, "conveyor_peak_kinds", ctypes.c_char_p)
        self._gops = bind(lib, "conveyor_peak_gops", I32, ctypes.c_char_p, I64, ctypes.POINTER(F64))

    def peak_kinds(self) -> list[str]:
        """The instruction paths this build measures."""
        kinds = self._kinds().decode()
        return kinds.split(",") if kinds else []

    def peak_gops(self, kind: str, threads: int) -> float:
        """GOP/s of path `kind` on `threads` threads (a multiply-add counts 2)."""
        gops = ctypes.c_double()
        self.check(self._gops(kind.encode(), threads, ctypes.byref(gops)))
        return gops.value
