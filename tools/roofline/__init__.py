"""How close is a decode step to what the hardware and the model allow? `python -m tools.roofline`.

Four measurements, all on the same model object (a `CausalLM`, as `LLM` builds it for the
`--dtype` and `--quantization` asked for):

1. Matmul rate (`measure.py`): the model's own linear layers (as its forward runs them:
   oneDNN-packed on CPU fp32, the quantized kernels for quantized weights) on each distinct weight
   shape (fused qkv_proj, o_proj, gate_up_proj, down_proj of one layer, and the LM head) at M =
   batch rows (a mixture-of-experts model's experts at their share, batch x top-k / experts:
   `expert_load.py`). FLOPs per token are 2 x the parameters touched per token (every layer's
   linears plus the LM head), so the per-shape times, weighted by how often each shape runs, give
   the tok/s ceiling of the linear layers alone; each shape's weight bytes over its time give its
   streaming rate. On CPU each shape also names the instruction path it took, and its GFLOP/s is
   set against that path's peak measured on the same threads (`peaks.py`).
2. Dense ceiling (`measure.py`): ONE decode step of `batch` sequences of `context` cached tokens
   through the model's own `forward` (its own weights, quantized or not) with
   `DenseDecodeAttention`: contiguous per-layer K/V `[batch, kv_heads, context + 1, head_dim]`, the
   new token's K/V written at position `context`, one `scaled_dot_product_attention` per layer with
   no gather, no mask, no paging, no scheduling; then `compute_logits` and an argmax. Everything
   Conveyor adds on top of this is overhead.
3. Conveyor's real step (`step.py`, `step` only): `batch` requests with random `context`-token
   prompts are prefilled, then `Engine.step()` is timed and split into model forward, LM head +
   sampling, input preparation (`ModelRunner.prepare`) and the rest (scheduling, token append,
   detokenization), by wrapping those methods on the instances for the duration of the timing.
4. Weight streaming (`conveyor.bench.bandwidth`, `step` only): the weight bytes a step reads over its model
   forward + LM head time, against the machine's read bandwidth probed right after.

`ceiling` reports 1 and 2; `step` reports all four and the ratio of Conveyor's step to the dense
ceiling measured in the same run: there each dense step runs right after a timed engine step, so
both see the same machine (on a shared CPU, contention comes and goes within minutes). Times are
medians after warm-up. `pair` (`pair.py`) interleaves two models' engine steps. The reports are in
`report.py`, the command line in `cli.py`.
"""
