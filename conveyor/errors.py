"""The errors Conveyor raises to its callers. An invalid request carries a typed code and the parameter at
fault, so the server maps it to an HTTP answer without reading the message. A missing optional package is
one line naming it and the command that installs it (`require`)."""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from enum import Enum
from pathlib import Path
from types import ModuleType


class ConfigError(ValueError):
    """A configuration value is out of its allowed range, or cannot run on this device."""


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, or stopped answering within the collectives' timeout: the group
    cannot run another step, so the engine dies with it (not one batch's fault)."""


class RequestErrorCode(str, Enum):
    """Why a request was refused before it was queued (OpenAI's `code` where OpenAI has one)."""

    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_new_tokens over the model's context
    CACHE_CAPACITY_EXCEEDED = "kv_cache_capacity_exceeded"  # the prompt alone does not fit the KV cache
    INVALID_PROMPT = "invalid_prompt"  # empty, or token ids outside the vocabulary
    INVALID_VALUE = "invalid_value"  # a parameter outside what this model takes (token ids, logprobs, pages)
    INVALID_STRUCTURED_OUTPUTS = "invalid_structured_outputs"  # the constraint does not compile
    DUPLICATE_REQUEST_ID = "duplicate_request_id"


class InvalidRequestError(ValueError):
    """A request that cannot be served as given; `code` says why, `param` names the parameter at fault
    (a `SamplingParams` field, or "prompt")."""

    def __init__(self, message: str, code: RequestErrorCode = RequestErrorCode.INVALID_VALUE,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed (or does not import); the message is one line
    that names it and the command that installs it."""


def install_command(extra: str) -> str:
    """The command that installs the optional extra `extra` (pyproject.toml) into this interpreter: from
    the checkout Conveyor runs from when it runs from one (README's setup installs it editable), else
    from the package index."""
    python = shlex.quote(readable_path(sys.executable))
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        return f"{python} -m pip install -e {shlex.quote(f'{readable_path(root)}[{extra}]')}"
    return f"{python} -m pip install {shlex.quote(f'conveyor[{extra}]')}"


def readable_path(path: str | os.PathLike[str]) -> str:
    """`path` relative to the working directory when it lies inside it (`.venv/bin/python`, `.`), as a
    user would type it; else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if relative.startswith("..") else relative


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`module`, imported; if its package is not installed, `MissingDependencyError`: "`feature` needs
    PACKAGE, which is not installed: COMMAND". A package that is installed but misses one of its own
    dependencies says so, with the same command."""
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise MissingDependencyError(f"{feature} needs {package}, which is not installed: "
                                         f"{install_command(extra)}", name=package) from None
        raise MissingDependencyError(f"{feature} needs {package}, which does not import ({exc}): "
                                     f"{install_command(extra)}", name=package) from exc
