"""A stand-in for vLLM's interpreter in the `--compare vllm` tests: a shell script running this Python with
`tests/bench/fake_vllm` (a fake `vllm` module) on its path."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

FAKE_VLLM = Path(__file__).with_name("fake_vllm")


def interpreter(tmp_path: Path, body: str | None = None) -> str:
    """An executable standing in for vLLM's Python: ours with the fake vllm importable (or `body`)."""
    path = tmp_path / "vllm-python"
    path.write_text(body or f'#!/bin/sh\nPYTHONPATH="{FAKE_VLLM}" exec "{sys.executable}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)
