"""Decode at depth: tok/s of streams decoding after long prompts, and the bytes a step reads against the machine's
measured read bandwidth.

At long contexts a CPU decode step reads every weight once and every stream's cached keys and values once, so
its speed is bytes over bandwidth. Each repeat sends `streams` random prompts of `context` tokens and times the
decode only: from the moment every stream has its first token to the moment the first one ends (all of them
decoding together). The KV cache dtypes asked for run interleaved, repeat by repeat, each with its own `LLM`,
so a noisy machine weighs on them alike; with `llama_bench`, llama.cpp's `llama-bench -d CONTEXT` runs in the
same rotation on the same GGUF file (one stream; q8_0 KV beside int8, f16 beside auto). A step's bytes are the
weights (`bandwidth.weight_bytes`) plus every stream's KV at its mean context over the timed window; each run's
share of the bandwidth is against a probe right after it (the median of those shares is reported).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from .bandwidth import read_bandwidth, weight_bytes
from .modes import describe_mode, resolved_mode

LLAMA_KV = {"auto": "f16", "int8": "q8_0"}  # llama.cpp's KV type beside each of ours


def kv_bytes_per_token(llm: Any) -> int:
    """Bytes one token's keys and values take over all layers, as the pool stores them (int8 rows with their
    scales, fp8, or the model dtype)."""
    return sum(layer.nbytes // layer.shape[1] for layer in llm.engine.pool.kv)


def decode_once(llm: Any, context: int, streams: int, tokens: int, seed: int) -> float:
    """One repeat: total decode tok/s over `streams` requests of `context` random prompt tokens."""
    from .. import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    manager = llm.manager
    manager.stop()  # queued together, so that the first steps see every stream
    rids = [manager.add_request([rng.randrange(8, llm.vocab_size) for _ in range(context)], params, streaming=True)
            for _ in range(streams)]
    manager.start()
    events: dict[str, list[tuple[float, int]]] = {rid: [] for rid in rids}

    def follow(rid: str) -> None:
        for out in manager.request_id_iter(rid):
            events[rid].append((time.perf_counter(), len(out.token_ids)))

    threads = [threading.Thread(target=follow, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(ev[0][0] for ev in events.values())
    end = min(ev[-1][0] for ev in events.values())
    if end <= start:  # a stream ended before the last one had its first token
        raise RuntimeError("no window where every stream decodes: raise --tokens")
    decoded = sum(max(n for when, n in ev if when <= end) - max(n for when, n in ev if when <= start)
                  for ev in events.values())
    return decoded / (end - start)


def llama_bench_once(binary: str, model: str, kv: str, context: int, tokens: int, threads: int) -> float:
    """llama-bench's tg tok/s at depth `context`, one repetition, flash attention on (quantized V needs it)."""
    cmd = [binary, "-m", model, "-t", str(threads), "-d", str(context), "-n", str(tokens), "-p", "0", "-r", "1",
           "-fa", "1", "-ctk", LLAMA_KV[kv], "-ctv", LLAMA_KV[kv], "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def run_decode(model: str | None, kv_dtypes: list[str], *, context: int, streams: int, tokens: int, repeats: int,
               dtype: str = "auto", quantization: str | None = None, llama_bench: str | None = None) -> dict[str, Any]:
    """Every KV dtype's decode tok/s per repeat (interleaved), its bytes per step, and the machine's bandwidth."""
    import torch

    from .. import ContinuousBatchingConfig, SamplingParams
    from .perplexity import load_llm
    from .throughput import environment

    if llama_bench and (streams != 1 or not str(model or "").endswith(".gguf")):
        raise ValueError("--llama-bench compares one stream (--streams 1) on a .gguf --model")
    page = ContinuousBatchingConfig().page_size
    pages = (context + tokens + 64) // page + 1
    config = dict(max_batch_tokens=512, allow_block_sharing=False, num_blocks=pages * streams + 64)
    llms = {kv: load_llm(model, dtype=dtype, quantization=quantization,
                         config=ContinuousBatchingConfig(kv_cache_dtype=kv, **config)) for kv in kv_dtypes}
    warmup = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernels and buffers
        llm.generate([[8 + i] * min(context, 256) for i in range(streams)], warmup, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in [*kv_dtypes, *(f"llama.cpp {LLAMA_KV[kv]}"
                                                                        for kv in kv_dtypes if llama_bench)]}
    probes: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}  # the bandwidth right after each run
    for r in range(repeats):
        for kv, llm in llms.items():
            rates[kv].append(decode_once(llm, context, streams, tokens, seed=100 + r))
            probes[kv].append(read_bandwidth(repeats=3)["gb_per_s"])
            if llama_bench:
                rates[f"llama.cpp {LLAMA_KV[kv]}"].append(
                    llama_bench_once(llama_bench, str(model), kv, context, tokens, torch.get_num_threads()))
    any_llm = next(iter(llms.values()))
    weights = weight_bytes(any_llm.engine.model)
    mean_context = context + tokens / 2
    systems = {}
    for name, values in rates.items():
        entry: dict[str, Any] = {"tok_per_s": values, "median_tok_per_s": statistics.median(values)}
        if name in llms:
            per_token, stats = kv_bytes_per_token(llms[name]), llms[name].stats()
            kv_bytes = streams * mean_context * per_token
            entry |= {"kv_bytes_per_token": per_token, "step_bytes": weights["total_bytes"] + kv_bytes,
                      "kv_step_bytes": kv_bytes, "blocks_back": stats.free_blocks == stats.total_blocks}
            entry["gb_per_s"] = entry["step_bytes"] * entry["median_tok_per_s"] / streams / 1e9
            # each run against the probe right after it: a shared machine's bandwidth swings within minutes
            entry["bandwidth_gb_per_s"] = probes[name]
            entry["fraction_of_bandwidth"] = statistics.median(
                entry["step_bytes"] * rate / streams / 1e9 / bw for rate, bw in zip(values, probes[name]))
        systems[name] = entry
    for llm in llms.values():
        llm.shutdown()
    bandwidth = read_bandwidth()
    return {"model": str(any_llm.model_path), "mode": resolved_mode(any_llm), "environment": environment(),
            "context": context, "streams": streams, "tokens": tokens, "repeats": repeats, "weights": weights,
            "bandwidth": bandwidth, "systems": systems}


def format_report(report: dict[str, Any]) -> str:
    """A table: each system's median tok/s with its spread, step bytes and their rate against the bandwidth."""
    base = report["systems"].get("auto", {}).get("median_tok_per_s")
    probed = [bw for s in report["systems"].values() for bw in s.get("bandwidth_gb_per_s", [])]
    lines = [f"Decode at depth: {Path(report['model']).name}, {report['streams']} stream(s) after "
             f"{report['context']} prompt tokens, {report['tokens']} tokens each, {report['repeats']} repeats "
             f"interleaved; {describe_mode(report['mode'], report['environment'])}, "
             f"{report['environment']['torch_threads']} threads",
             f"machine read bandwidth {report['bandwidth']['gb_per_s']:.1f} GB/s at the end, "
             f"{min(probed):.1f}-{max(probed):.1f} right after the runs (each run's share is against its own); weights "
             f"{report['weights']['total_bytes'] / 2**20:.0f} MiB a step",
             f"{'system':<16}{'tok/s':>8}{'min-max':>16}{'step MiB':>10}{'of it KV':>10}{'GB/s':>7}{'of bw':>7}"
             f"{'vs auto':>9}"]
    for name, s in report["systems"].items():
        values = s["tok_per_s"]
        row = f"{name:<16}{s['median_tok_per_s']:>8.2f}{f'{min(values):.2f}-{max(values):.2f}':>16}"
        row += (f"{s['step_bytes'] / 2**20:>10.0f}{s['kv_step_bytes'] / 2**20:>10.0f}{s['gb_per_s']:>7.1f}"
                f"{s['fraction_of_bandwidth']:>7.0%}" if "step_bytes" in s else " " * 34)
        row += f"{s['median_tok_per_s'] / base:>8.2f}x" if base else ""
        lines.append(row)
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    from .modes import add_mode_arguments

    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--kv-cache-dtype", default="auto,int8",
                        help="comma-separated KV cache dtypes to compare, interleaved (default: auto,int8)")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per stream (default 4096)")
    parser.add_argument("--streams", type=int, default=1, help="requests decoding together (default 1)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream decodes (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per system (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--llama-bench", default=None, metavar="PATH",
                        help="also run llama.cpp's llama-bench binary at the same depth on the same .gguf, in turn")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    add_mode_arguments(parser)


def run_from_args(args: Any) -> int:
    import torch

    for flag, value, low in (("--context", args.context, 1), ("--streams", args.streams, 1),
                             ("--tokens", args.tokens, 2), ("--repeats", args.repeats, 1)):
        if value < low:
            raise SystemExit(f"error: {flag} must be >= {low}, got {value}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kv_dtypes = [kv.strip() for kv in args.kv_cache_dtype.split(",") if kv.strip()]
    try:
        report = run_decode(args.model, kv_dtypes, context=args.context, streams=args.streams, tokens=args.tokens,
                            repeats=args.repeats, dtype=args.dtype, quantization=args.quantization,
                            llama_bench=args.llama_bench)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    return 0
