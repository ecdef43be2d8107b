"""The container images (`Dockerfile` for CPU, `Dockerfile.cuda`) are built by the README's setup, the
`scripts/setup.sh` that CI runs on a clean clone, and serve with `conveyor serve` flags that exist. No
Docker daemon is needed: the Dockerfiles are read, not built (building takes minutes and the network)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests.serving_helpers import serve_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in joined.splitlines()
            if line.strip()]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_is_built_by_the_readmes_setup(name: str) -> None:
    steps = instructions(ROOT / name)
    runs = [args for kind, args in steps if kind == "RUN"]
    setup = [args for args in runs if "scripts/setup.sh" in args]
    assert len(setup) == 1 and shlex.split(setup[0])[-1] == "scripts/setup.sh", runs  # no --test: runtime only
    assert "scripts/setup.sh" in (ROOT / "README.md").read_text() and "scripts/setup.sh" in (ROOT / ".ci/run").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for args in runs:  # the other steps: system packages, the user, and the extras pyproject.toml declares
        if args not in setup:
            assert "apt-get install" in args or 'pip install --quiet -e ".[$EXTRAS]"' in args, args
    default = next(args for kind, args in steps if kind == "ARG" and args.startswith("EXTRAS="))
    assert all(extra in extras for extra in default.split("=", 1)[1].strip('"').split(",") if extra)
    sources = [src for kind, args in steps if kind == "COPY" for src in shlex.split(args)[:-1]
               if not src.startswith("--")]  # what setup.sh's editable install reads
    assert {"pyproject.toml", pyproject["project"]["readme"], "scripts", "conveyor"} <= set(sources)
    assert all((ROOT / src).exists() for src in sources)
    python = next(args for kind, args in steps if kind == "FROM")
    version = re.fullmatch(r"python:(\d+)\.(\d+)-slim", python)
    assert version and (int(version[1]), int(version[2])) >= (3, 10)  # requires-python


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_serves_on_every_interface(name: str) -> None:
    steps = dict(instructions(ROOT / name))
    entrypoint = json.loads(steps["ENTRYPOINT"])
    assert entrypoint[:2] == ["conveyor", "serve"]
    args = serve_parser().parse_args(entrypoint[2:] + ["org/model"])  # what `docker run IMAGE MODEL` gives
    assert (args.host, args.model_tag, str(args.port)) == ("0.0.0.0", "org/model", steps["EXPOSE"])
    assert f"-p {args.port}:{args.port}" in (ROOT / "docs/operating.md").read_text()
