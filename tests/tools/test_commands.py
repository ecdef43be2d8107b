"""Every tool answers `--help` through its `main()`; `python -m tools.NAME` runs from the repository root;
and the commands that left `conveyor bench` get argparse's own "invalid choice", not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main as conveyor_main
from tools import fuzz, gpu_check, soak
from tools.peer_speed import decode_speed, prompt_speed
from tools.roofline import cli as roofline
from tools.simulate import cli as simulate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--help"], ["ceiling", "--help"], ["step", "--help"], ["pair", "--help"]])
def test_roofline_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        roofline.main(argv)
    assert exit_.value.code == 0 and "usage: python -m tools.roofline" in capsys.readouterr().out


@pytest.mark.parametrize("tool", [simulate, fuzz, soak, gpu_check, prompt_speed, decode_speed],
                         ids=lambda m: m.__name__)
def test_every_tool_answers_help(tool, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--help"])
    prog = tool.__name__.removesuffix(".cli")
    assert exit_.value.code == 0 and f"usage: python -m {prog}" in capsys.readouterr().out


def test_a_tool_runs_as_a_module_from_the_repository_root() -> None:
    """The convention the README gives: `python -m tools.NAME` in the checkout, nothing installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "tools.simulate", "--no-scheduler", "--lengths", "3,1,2",
                           "--slots", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "continuous batching (ideal)" in done.stdout


@pytest.mark.parametrize("command", ["roofline", "step", "step-pair", "simulate", "fuzz", "soak", "gpu-check"])
def test_moved_commands_are_gone_from_conveyor_bench(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        conveyor_main(["bench", command])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"invalid choice: '{command}'" in err and "Traceback" not in err
