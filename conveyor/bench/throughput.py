"""Offline throughput: Conveyor's `LLM.generate` on a whole workload, optionally against transformers.

Conveyor runs every prompt in one `LLM.generate` call; only that call is timed, after one small
warm-up generate. With `compare=("hf",)` the same chat-templated prompt token ids and the same
`max_new_tokens` run greedily through transformers' continuous batching (`generate_batch`) and
static `generate` (batches of 16, left-padded) on the same weights, and every request's greedy
token ids are compared with Conveyor's: exact matches are counted and, for each mismatch, the
index of the first differing token is reported (mismatches are listed, never dropped; see
`throughput_report.py`). With `compare=("vllm",)` vLLM's offline `LLM` runs the same prompts in its
own interpreter (`vllm_compare.py`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .modes import add_mode_arguments, resolved_mode
from .progress import add_progress_argument, progress_wanted
from .structured import add_structured_arguments, structured_from_args
from .throughput_report import CONVEYOR, HF_CB, HF_STATIC, VLLM, compare_outputs, count_values, format_report
from .vllm_compare import add_vllm_arguments
from .workloads import Workload, WorkloadError, render_prompts

logger = logging.getLogger("conveyor.bench")

# --compare values -> systems they run
COMPARE_CHOICES = {"hf": (HF_CB, HF_STATIC), "hf-cb": (HF_CB,), "hf-generate": (HF_STATIC,), "vllm": (VLLM,)}
CONVEYOR_STRUCTURED = "conveyor (structured)"
WARMUP_PROMPT_LEN = 32
WARMUP_NEW_TOKENS = 4


def _summary(token_ids: list[list[int]], prompt_lens: list[int], wall_s: float,
             errors: Sequence[str | None]) -> dict[str, Any]:
    n = len(token_ids)
    out = sum(len(t) for t in token_ids)
    prompt = sum(prompt_lens)
    wall = max(wall_s, 1e-9)
    return {"wall_s": wall_s, "num_requests": n, "prompt_tokens": prompt, "output_tokens": out,
            "requests_per_s": n / wall, "output_tok_per_s": out / wall, "total_tok_per_s": (prompt + out) / wall,
            "num_errors": sum(1 for e in errors if e), "errors": [e for e in errors if e][:10],
            "output_lens": [len(t) for t in token_ids]}


def warmup_prompt(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Fixed random tokens: they share no prefix with the workload, so the warm-up leaves no useful cache."""
    special = set(special_ids)
    rng = random.Random(1234)
    return [t for t in rng.sample(range(vocab_size), WARMUP_PROMPT_LEN * 2) if t not in special][:WARMUP_PROMPT_LEN]


def environment() -> dict[str, Any]:
    """The software and machine a figure was measured on; `cpu_flags` decide the kernels "auto" picks."""
    import torch
    import transformers

    from ..kernels import vector_flags

    try:
        version = importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"conveyor": version, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_flags": vector_flags(),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


# Engine counters reported for the timed run (differences of `LLM.stats()`; the warm-up excluded).
ENGINE_COUNTERS = ("prefill_tokens", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "offloads", "swap_outs",
                   "swap_ins", "soft_resets")


def run_conveyor(llm: Any, prompts: list[list[int]], workload: Workload, *, progress: bool = True,
                 warmup_prompt: Sequence[int] | None = None, structured: Any = None):
    """One timed `LLM.generate` over all prompts, after a small untimed warm-up generate; `structured`:
    a `StructuredOutputsParams` every request is constrained by."""
    import torch

    from .. import SamplingParams
    from .hf_baselines import RunResult

    if warmup_prompt is not None:
        llm.generate([list(warmup_prompt)], SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, temperature=0.0),
                     use_tqdm=False)
    params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=r.ignore_eos,
                             structured_outputs=structured) for r in workload.requests]
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(llm.device)
    before = llm.stats()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    if cuda:
        torch.cuda.synchronize(llm.device)
    wall = time.perf_counter() - started
    after = llm.stats()
    engine = {k: getattr(after, k) - getattr(before, k) for k in ENGINE_COUNTERS}
    engine["total_blocks"] = after.total_blocks
    engine["prefix_caching"] = bool(getattr(getattr(llm, "engine", None), "block_sharing", False))
    return RunResult(token_ids=[list(o.token_ids) for o in outputs], wall_s=wall,
                     errors=[o.error or (f"finish_reason={o.finish_reason}" if o.finish_reason in ("error", "abort")
                                         else None) for o in outputs],
                     extra={"finish_reasons": count_values(o.finish_reason for o in outputs), "engine": engine})


def run_throughput(workload: Workload, *, llm: Any = None, model: str | os.PathLike[str] | None = None,
                   compare: Sequence[str] = (), device: str = "auto", dtype: str = "auto",
                   quantization: str | None = None, config: Any = None, hf_batch_size: int = 16,
                   hf_max_batch_tokens: int | None = -1, hf_max_requests_per_batch: int | None = -1,
                   vllm: Any = None, progress: bool = True, include_token_ids: bool = True,
                   structured: Any = None) -> dict[str, Any]:
    """Run the workload on Conveyor (and the chosen baselines); return the report as a JSON-able dict.

    `compare` holds keys of COMPARE_CHOICES ("hf" = both transformers baselines; "vllm" needs `vllm`,
    a `vllm_compare.VllmOptions`).
    `hf_max_batch_tokens` / `hf_max_requests_per_batch`: -1 (default) = the same as Conveyor's
    config, None = transformers' own defaults, or a number. `structured`: a `StructuredOutputsParams`;
    Conveyor then runs once more with it on every request (`bench/structured.py`).
    """
    from .. import LLM

    if workload.temperature != 0:
        raise WorkloadError(f"workload {workload.name!r} has temperature {workload.temperature}: the throughput "
                            "benchmark decodes greedily (temperature 0) only")
    systems: list[str] = [CONVEYOR]
    for key in compare:
        if key not in COMPARE_CHOICES:
            raise ValueError(f"unknown --compare value {key!r}; choose from {sorted(COMPARE_CHOICES)}")
        systems += [s for s in COMPARE_CHOICES[key] if s not in systems]
    if VLLM in systems and vllm is None:
        raise ValueError("--compare vllm needs --vllm-python: an interpreter with vLLM installed")

    if llm is None:
        started = time.perf_counter()
        llm = LLM(model, device=device, dtype=dtype, quantization=quantization, config=config)
        logger.info("conveyor: loaded in %.1f s", time.perf_counter() - started)
    tokenizer = llm.get_tokenizer()
    prompts = render_prompts(workload, llm.render_chat)
    prompt_lens = [len(p) for p in prompts]
    max_new = [r.max_new_tokens for r in workload.requests]
    ignore_eos = [r.ignore_eos for r in workload.requests]
    eos_ids = list(llm.eos_token_ids)
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    warm = warmup_prompt(llm.vocab_size, special)
    cb_cfg = llm.engine.config

    report: dict[str, Any] = {
        "benchmark": "throughput",
        "workload": {"name": workload.name, "source": workload.source, "description": workload.description,
                     "num_requests": len(workload), "prompt_tokens": sum(prompt_lens),
                     "max_prompt_len": max(prompt_lens), "max_new_tokens_total": sum(max_new),
                     "max_new_tokens": sorted(set(max_new)), "ignore_eos": any(ignore_eos),
                     "temperature": 0.0},
        "model": {"path": str(llm.model_path), "device": str(llm.device), **resolved_mode(llm),
                  "eos_token_ids": eos_ids},
        "environment": environment(),
        "conveyor_config": {k: v.to_dict() if k == "speculative_config" and v else v for k, v in vars(cb_cfg).items()},
        "systems": {},
        "ratios": {},
        "total_ratios": {},
        "greedy_match": {},
    }

    def record(name: str, result: Any) -> None:
        entry = _summary(result.token_ids, prompt_lens, result.wall_s, result.errors)
        entry.update(result.extra)
        if include_token_ids:
            entry["token_ids"] = result.token_ids
        report["systems"][name] = entry
        logger.info("%s: %.2f s, %.1f output tok/s", name, result.wall_s, entry["output_tok_per_s"])

    def baseline(name: str, result: Any) -> None:
        record(name, result)
        ours, theirs = report["systems"][CONVEYOR], report["systems"][name]
        for key, ratios in (("output_tok_per_s", report["ratios"]), ("total_tok_per_s", report["total_ratios"])):
            ratios[name] = ours[key] / theirs[key] if theirs[key] else None
        report["greedy_match"][name] = compare_outputs(conveyor.token_ids, result.token_ids, result.errors)

    conveyor = run_conveyor(llm, prompts, workload, progress=progress, warmup_prompt=warm)
    record(CONVEYOR, conveyor)
    if structured is not None:
        record(CONVEYOR_STRUCTURED, run_conveyor(llm, prompts, workload, progress=progress, warmup_prompt=warm,
                                                 structured=structured))
        plain, constrained = (report["systems"][k]["output_tok_per_s"] for k in (CONVEYOR, CONVEYOR_STRUCTURED))
        report["structured"] = {"constraint": structured.key(), "output_tok_per_s_ratio": constrained / plain}

    hf_systems = [s for s in systems if s in (HF_CB, HF_STATIC)]
    if hf_systems:
        from .hf_baselines import load_hf_model, run_generate_batch, run_static_generate

        started = time.perf_counter()
        hf, how = load_hf_model(llm.model_path, llm.dtype, llm.device)  # a Hub id: its cached files
        report["model"]["hf_loaded_via"] = how
        report["model"]["hf_load_s"] = time.perf_counter() - started
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

        def same(value: int | None, ours: int) -> int | None:
            return ours if value == -1 else value

        try:
            for name in hf_systems:
                if name == HF_CB:
                    result = run_generate_batch(
                        hf, prompts, max_new, eos_ids, pad, ignore_eos,
                        max_batch_tokens=same(hf_max_batch_tokens, cb_cfg.max_batch_tokens),
                        max_requests_per_batch=same(hf_max_requests_per_batch, cb_cfg.max_requests_per_batch),
                        progress=progress, warmup_prompt=warm)
                else:
                    result = run_static_generate(hf, prompts, max_new, eos_ids, pad, ignore_eos,
                                                 batch_size=hf_batch_size, progress=progress, warmup_prompt=warm)
                baseline(name, result)
        finally:
            del hf
    if VLLM in systems:
        from .vllm_compare import build_request, run_vllm

        request = build_request(vllm, model=str(llm.model_path), dtype=llm.dtype, prompts=prompts, max_new=max_new,
                                ignore_eos=ignore_eos, eos_ids=eos_ids, warmup_prompt=warm,
                                warmup_new_tokens=WARMUP_NEW_TOKENS)
        baseline(VLLM, run_vllm(vllm, request))
    return report


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    from ..sched.scheduler import SCHEDULERS

    parser.add_argument("workload", nargs="?", help="workload JSON file (prompts or requests layout)")
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--compare", action="append", choices=sorted(COMPARE_CHOICES), default=[],
                        help="also run transformers baselines on the same weights: hf = generate_batch and "
                             "static generate; hf-cb / hf-generate = just one (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="override every request's max_new_tokens")
    parser.add_argument("--out", default=None, help="write the full report (all figures) as JSON here")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw output and total tok/s per system as a bar chart (needs matplotlib)")
    syn = parser.add_argument_group("synthetic workload (instead of a file; random token ids, EOS ignored)")
    syn.add_argument("--synthetic-input-len", type=int, default=None)
    syn.add_argument("--synthetic-output-len", type=int, default=None)
    syn.add_argument("--num-prompts", type=int, default=None)
    syn.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    syn.add_argument("--copy-heavy", type=int, default=None, metavar="N",
                     help="instead: N copy-heavy prompts (repeat, quote or edit a passage; --max-new-tokens, "
                          "default 256)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--threads", type=int, default=None,
                     help="torch intra-op threads for every system (default: torch's). On a machine shared with "
                          "other busy processes, fewer threads than cores avoids a many-fold slowdown")
    eng.add_argument("--device", default="auto")
    add_mode_arguments(eng)
    eng.add_argument("--max-batch-tokens", type=int, default=None,
                     help="Conveyor's per-pass token budget (default: LLM's, 512, or 2048 where prompts go to "
                          "oneDNN's AMX matmul)")
    eng.add_argument("--max-requests-per-batch", type=int, default=None)
    eng.add_argument("--num-blocks", type=int, default=None, help="Conveyor's KV pool size in blocks")
    eng.add_argument("--kv-cache-dtype", default=None, help="auto (default) or int8: how Conveyor's KV cache is stored")
    eng.add_argument("--tensor-parallel-size", type=int, default=None,
                     help="split Conveyor's model over N ranks (docs/scale-out.md); threads are per "
                          "rank (cores / N unless OMP_NUM_THREADS is set), --threads applies to N = 1")
    eng.add_argument("--page-size", type=int, default=None)
    eng.add_argument("--scheduler-type", choices=list(SCHEDULERS), default=None)
    eng.add_argument("--cpu-offload-space", type=float, default=None, metavar="GIB",
                     help="host swap space for offloaded requests' KV blocks (default 0: soft resets)")
    eng.add_argument("--no-block-sharing", action="store_true", help="allow_block_sharing=False: no prefix caching")
    eng.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                     help="batch_invariant: outputs independent of batching and chunking (default: "
                          "VLLM_BATCH_INVARIANT=1 turns it on)")
    eng.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="speculative decoding, vLLM's JSON, e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    add_vllm_arguments(parser)
    hf = parser.add_argument_group("transformers baselines")
    hf.add_argument("--hf-batch-size", type=int, default=16, help="batch size of static generate (default 16)")
    hf.add_argument("--hf-max-batch-tokens", type=int, default=-1,
                    help="generate_batch's max_batch_tokens: -1 = same as Conveyor (default), "
                         "0 = transformers' default")
    hf.add_argument("--hf-max-requests-per-batch", type=int, default=-1,
                    help="generate_batch's max_requests_per_batch: -1 = same as Conveyor (default), "
                         "0 = transformers' default")
    add_progress_argument(parser)
    parser.add_argument("--no-token-ids", action="store_true", help="leave per-request token ids out of --out")
    add_structured_arguments(parser)


def vllm_options_from_args(args: Any) -> Any:
    """`VllmOptions` for `--compare vllm` (None without it); argument errors exit before anything loads."""
    if "vllm" not in args.compare:
        given = [f"--{k.replace('_', '-')}" for k in ("vllm_python", "vllm_model", "vllm_tokenizer", "vllm_kwargs",
                                                      "vllm_timeout") if getattr(args, k) is not None]
        if given:
            raise SystemExit(f"error: {', '.join(given)} only apply with --compare vllm")
        return None
    if args.vllm_python is None:
        raise SystemExit("error: --compare vllm needs --vllm-python PATH (an interpreter with vLLM installed)")
    from .vllm_compare import VllmOptions, parse_kwargs

    try:
        return VllmOptions(args.vllm_python, model=args.vllm_model, tokenizer=args.vllm_tokenizer,
                           llm_kwargs=parse_kwargs(args.vllm_kwargs), timeout_s=args.vllm_timeout)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def run_from_args(args: Any) -> int:
    from .workloads import copy_workload, load_workload, synthetic_workload

    synthetic = (args.synthetic_input_len, args.synthetic_output_len, args.num_prompts)
    if args.copy_heavy is not None:
        if args.workload is not None or any(v is not None for v in synthetic):
            raise SystemExit("error: --copy-heavy is a workload of its own: no workload file or --synthetic-*")
        args.workload = copy_workload(args.copy_heavy, args.max_new_tokens or 256, seed=args.seed)
    if args.workload is not None and any(v is not None for v in synthetic):
        raise SystemExit("error: give either a workload file or --synthetic-* options, not both")
    if args.workload is None and not all(v is not None for v in synthetic):
        raise SystemExit("error: give a workload file, or all of --synthetic-input-len, --synthetic-output-len "
                         "and --num-prompts")
    plot = getattr(args, "plot", None)
    if plot:  # fail before the (long) run, not after it
        from .plot import PlotDependencyError, require_matplotlib

        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            raise SystemExit(f"error: {exc}") from None
    vllm = vllm_options_from_args(args)
    structured = structured_from_args(args)
    workload = None
    if args.workload is not None:
        try:
            loaded = args.workload if args.copy_heavy is not None else load_workload(args.workload)
            workload = loaded.limit(args.limit).with_max_new_tokens(args.max_new_tokens)
        except (OSError, WorkloadError) as exc:
            raise SystemExit(f"error: {exc}") from None

    import torch  # after argument errors, which should not wait for torch

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    from .. import LLM, ContinuousBatchingConfig

    overrides = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens),
                                   ("max_requests_per_batch", args.max_requests_per_batch),
                                   ("num_blocks", args.num_blocks), ("page_size", args.page_size),
                                   ("scheduler_type", args.scheduler_type),
                                   ("cpu_offload_space", args.cpu_offload_space),
                                   ("speculative_config", args.speculative_config),
                                   ("tensor_parallel_size", args.tensor_parallel_size),
                                   ("batch_invariant", args.batch_invariant),
                                   ("kv_cache_dtype", args.kv_cache_dtype)) if v is not None}
    if args.no_block_sharing:
        overrides["allow_block_sharing"] = False
    started = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              config=ContinuousBatchingConfig(**overrides) if overrides else None)  # None: LLM's defaults
    print(f"Loaded {llm.model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if workload is None:
        tokenizer = llm.get_tokenizer()
        workload = synthetic_workload(args.synthetic_input_len, args.synthetic_output_len, args.num_prompts,
                                      llm.vocab_size, seed=args.seed,
                                      exclude_token_ids=getattr(tokenizer, "all_special_ids", []) or [])
        workload = workload.limit(args.limit).with_max_new_tokens(args.max_new_tokens)

    def hf_value(v: int) -> int | None:
        return None if v == 0 else v

    from .vllm_compare import VllmError

    try:
        report = run_throughput(workload, llm=llm, model=args.model, compare=args.compare,
                                hf_batch_size=args.hf_batch_size,
                                hf_max_batch_tokens=hf_value(args.hf_max_batch_tokens),
                                hf_max_requests_per_batch=hf_value(args.hf_max_requests_per_batch), vllm=vllm,
                                progress=progress_wanted(args.no_progress), include_token_ids=not args.no_token_ids,
                                structured=structured)
    except VllmError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    if plot:
        from .plot import plot_throughput

        plot_throughput(report, plot)
        print(f"Wrote {plot}")
    failed = any(s["num_errors"] for s in report["systems"].values())
    return 1 if failed else 0
