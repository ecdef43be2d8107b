"""Conveyor's speed in the measures its peers publish, to set the figures side by side.

- `prompt_speed`: prompt processing of one request, tokens/s (llama.cpp's `llama-bench -p 512`).
- `decode_speed`: one stream's decode, tokens/s after the first token (`llama-bench -n 128`).
- `served_one_stream.sh`: one stream served by `conveyor serve`, measured by `vllm bench serve`, next
  to the offline decode rate of the same run (what the server path costs).
- `served_concurrent.sh`: `vllm bench serve` at 64 concurrent requests against `conveyor serve` and
  `vllm serve` on the same model, in turn.
"""
