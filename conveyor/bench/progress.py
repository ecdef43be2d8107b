"""Progress bars of long bench runs: requests done and output tok/s, on a terminal only.

A bar is drawn when stderr (where tqdm writes) is a terminal and `--no-progress` is not given; piped
or redirected into a log, a run prints only its results."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def add_progress_argument(parser: Any) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they are shown only when stderr is a terminal)")


def progress_wanted(no_progress: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw bars: not turned off, and `stream` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return not no_progress and stream.isatty()


class TokenRate:
    """Output tokens per second since it was made, as a bar's postfix."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int, bar: Any) -> None:
        self.tokens += tokens
        bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.started, 1e-9):.1f} output tok/s",
                            refresh=False)
