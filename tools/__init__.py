"""A checkout's diagnostics, QA harnesses and simulations: not part of the installed package.

Each tool runs from the repository root as `python -m tools.NAME --help` (tools/README.md lists them).
Tools import `conveyor`; nothing in `conveyor` imports them (tests/architecture/test_architecture.py
checks).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from conveyor.errors import MissingDependencyError, require


def has_requirements(prog: str, requirements: Sequence[tuple[str, str]]) -> bool:
    """Whether every (module, pyproject extra) imports; if one does not, one `error:` line on stderr that
    names it and the command that installs it, before the tool starts anything."""
    try:
        for module, extra in requirements:
            require(module, extra, prog)
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True
