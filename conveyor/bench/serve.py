"""`conveyor bench serve`: online serving benchmark against any OpenAI-compatible HTTP server.

Modelled on `vllm bench serve` so that its figures compare directly: requests arrive as a Poisson
process (gamma intervals with `burstiness` != 1) at `--request-rate` requests/s, or all at once
(`inf`, the default); an optional `--max-concurrency` caps the requests in flight; every request
streams (`stream: true`, `stream_options.include_usage`) and is timed on the client:

* TTFT: from sending the request to the first chunk that carries a generated token;
* ITL: the gaps between successive token chunks (one sample per gap, all requests pooled);
* E2E latency: from sending to the last token chunk (as vllm; the stream's end is kept too);
* TPOT: (E2E - TTFT) / (output_tokens - 1) per request with more than one output token;
* output tokens: the usage chunk's `completion_tokens`, else the number of token chunks;
  prompt tokens: the usage chunk's `prompt_tokens`.

Only HTTP: the server is any OpenAI-compatible one (Conveyor's `conveyor serve`, vLLM,
llama.cpp's llama-server). The client talks only to `--base-url` (no redirects followed, proxy
environment variables ignored) and every request ends by `--request-timeout`. `--launch` starts
Conveyor's own server for the run instead, in the `--dtype`/`--quantization` asked for (`launch.py`).

Against Conveyor (one server, or `conveyor serve --data-parallel-size N` behind its router) each run
also reports the server's prefix-cache hits and the requests each replica served, read from its
`/metrics` before and after the run.

Modules: `serve_load` (arrival times, synthetic prompts), `serve_client` (one streamed request,
timed; what counts as a token chunk), `serve_stats` (percentiles, the run's metrics),
`serve_cache` (the server's prefix-cache counters per replica), `serve_report` (tables, plots); this
one runs the benchmark and its command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import serve_cache, serve_faults
from .modes import add_mode_arguments
from .progress import TokenRate, add_progress_argument, progress_wanted
from .serve_client import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    RequestResult,
    api_urls,
    auth_headers,
    build_payload,
    first_model,
    is_chat_endpoint,
    make_client,
    send_request,
)
from .serve_faults import add_fault_arguments
from .serve_load import arrival_times, prefix_repetition_workload, synthetic_text_workload
from .serve_report import format_report, plot_report
from .serve_stats import compute_metrics
from .workloads import Workload, WorkloadError, load_workload

DEFAULT_REQUEST_TIMEOUT_S = 600.0


# -- the run --------------------------------------------------------------------------------------
async def run_once(client: Any, url: str, workload: Workload, *, model: str, chat: bool,
                   request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, api_key: str | None = None,
                   progress: bool = True, desc: str | None = None, metrics: str | None = None,
                   kill: tuple[str, int, float] | None = None) -> dict[str, Any]:
    """One benchmark run of every request of `workload` at `request_rate`; returns its metrics, with the
    server's prefix-cache counters per replica over the run when `metrics` (its /metrics URL) has them.
    `kill` = (base URL, replica, seconds): that replica is killed with SIGKILL so many seconds in."""
    payloads = [build_payload(r, model=model, chat=chat, temperature=workload.temperature)
                for r in workload.requests]
    headers = auth_headers(api_key)
    arrivals = arrival_times(len(payloads), request_rate, seed=seed, burstiness=burstiness)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(payloads), desc=desc, unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    rate = TokenRate()

    async def one(i: int, t0: float) -> RequestResult:
        async with semaphore:
            result = await send_request(client, url, payloads[i], headers, index=i, chat=chat,
                                        timeout_s=timeout_s, t0=t0, arrival_s=arrivals[i])
        rate.add(result.output_tokens if result.success else 0, bar)
        bar.update(1)
        return result

    before = await serve_cache.scrape(client, metrics) if metrics else None
    tasks = []
    t0 = time.perf_counter()
    killer = asyncio.create_task(serve_faults.kill_later(kill[0], kill[1], kill[2], t0)) if kill else None
    try:
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, t0)))
        results = await asyncio.gather(*tasks)
        fault = await killer if killer is not None else None
    finally:
        for task in [*tasks, *([killer] if killer else [])]:
            task.cancel()
        bar.close()
    duration = time.perf_counter() - t0
    run = compute_metrics(results, duration, request_rate=request_rate, burstiness=burstiness,
                          max_concurrency=max_concurrency)
    run["prefix_cache"] = serve_cache.run_delta(before, await serve_cache.scrape(client, metrics)) \
        if before is not None else None
    if fault is not None:
        fault = await serve_faults.wait_recovery(kill[0], fault)
        run["fault"] = {k: v for k, v in fault.items() if k != "killed_monotonic"} | {
            "requests": serve_faults.classify(results)}
    return run


async def benchmark(base_url: str, workload: Workload, *, endpoint: str = CHAT_ENDPOINT, model: str | None = None,
                    request_rates: Sequence[float] = (math.inf,), burstiness: float = 1.0,
                    max_concurrency: int | None = None, seed: int = 0,
                    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, api_key: str | None = None,
                    test_request: bool = True, progress: bool = True, kill_replica: int | None = None,
                    kill_after_s: float = 5.0, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark: model discovery, one untimed test request (as vllm), then one run per
    request rate. Returns the report (JSON-able). Raises RuntimeError when the server is not
    usable (no model listed, or the test request failed)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if not timeout_s > 0:
        raise ValueError(f"the request timeout must be > 0, got {timeout_s}")
    for rate in request_rates:
        if not rate > 0:
            raise ValueError(f"request rates must be > 0 (or inf), got {rate}")
    log = log or (lambda _msg: None)
    url, models_url = api_urls(base_url, endpoint)
    chat = is_chat_endpoint(endpoint)
    async with make_client(max_concurrency=max_concurrency, timeout_s=timeout_s) as client:
        if model is None:
            model = await first_model(client, models_url, auth_headers(api_key))
            log(f"Model: {model} (first of GET {models_url})")
        if test_request:
            log("Starting initial single prompt test run...")
            first = build_payload(workload.requests[0], model=model, chat=chat, temperature=workload.temperature)
            res = await send_request(client, url, first, auth_headers(api_key), chat=chat, timeout_s=timeout_s)
            if not res.success:
                raise RuntimeError(f"the initial test request to {url} failed: {res.error}")
            log("Initial test run completed.")
        if kill_replica is not None:  # a replica of ours to kill: fail now, not after the run
            await serve_faults.replica(serve_faults.dashboard_url(base_url), kill_replica)
        runs = []
        for rate in request_rates:
            log(f"Traffic request rate: {rate:g} req/s, burstiness {burstiness:g}"
                f"{' (Poisson process)' if burstiness == 1 and not math.isinf(rate) else ''}, "
                f"max concurrency {max_concurrency or 'unlimited'}")
            runs.append(await run_once(client, url, workload, model=model, chat=chat, request_rate=rate,
                                       burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                                       timeout_s=timeout_s, api_key=api_key, progress=progress,
                                       desc=f"rate {rate:g}", metrics=serve_cache.metrics_url(base_url),
                                       kill=None if kill_replica is None else (base_url, kill_replica, kill_after_s)))
    return {
        "benchmark": "serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_url": base_url,
        "endpoint": endpoint,
        "api_url": url,
        "model_id": model,
        "workload": {"name": workload.name, "source": workload.source, "description": workload.description,
                     "num_requests": len(workload), "max_new_tokens_total": workload.total_max_new_tokens,
                     "temperature": workload.temperature,
                     "ignore_eos": any(r.ignore_eos for r in workload.requests)},
        "config": {"request_rates": ["inf" if math.isinf(r) else r for r in request_rates],
                   "burstiness": burstiness, "max_concurrency": max_concurrency, "seed": seed,
                   "request_timeout_s": timeout_s},
        "results": runs,
    }


# -- command line ---------------------------------------------------------------------------------
def _rates(text: str) -> list[float]:
    import argparse

    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (numbers or inf), got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected request rates > 0 (or inf), got {text!r}")
    return values


def add_arguments(parser: Any) -> None:
    parser.add_argument("--base-url", default=None,
                        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted); or --launch")
    ours = parser.add_argument_group("Conveyor's server, started for the run (--launch; see launch.py)")
    ours.add_argument("--launch", action="store_true",
                      help="start `conveyor serve` on a free loopback port for the run and stop it after")
    ours.add_argument("--launch-model", default=None, help="its model (default: the built-in one)")
    add_mode_arguments(ours)
    ours.add_argument("--launch-args", default="", metavar="ARGS",
                      help="more `conveyor serve` options, one string, e.g. '--max-batch-tokens 256 --num-blocks 4096'")
    ours.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="the launched server's speculative decoding (vLLM's JSON, as "
                           "`conveyor serve --speculative-config` takes it)")
    ours.add_argument("--launch-timeout", type=float, default=600.0,
                      help="seconds to wait for it to become healthy (default 600: a first start builds kernels)")
    parser.add_argument("--endpoint", default=CHAT_ENDPOINT,
                        help=f"{CHAT_ENDPOINT} (default; each prompt as one user message) or "
                             f"{COMPLETIONS_ENDPOINT} (the raw prompt text; vllm bench serve's default)")
    parser.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    parser.add_argument("--workload", default=None, metavar="FILE.json",
                        help="workload JSON file (prompts or requests layout, e.g. chat64, docs32, prefix32)")
    syn = parser.add_argument_group("synthetic workload (instead of --workload; random words, EOS ignored)")
    syn.add_argument("--synthetic-input-len", type=int, default=None, help="words per prompt (about one token each)")
    syn.add_argument("--synthetic-output-len", type=int, default=None, help="tokens to generate per request")
    syn.add_argument("--num-prompts", type=int, default=None,
                     help="number of synthetic requests (with --workload: use only the first N)")
    syn.add_argument("--prefix-repetition-prefix-len", type=int, default=None, metavar="WORDS",
                     help="vLLM's prefix_repetition: each prompt starts with one of a few shared prefixes of this "
                     "many words, then --synthetic-input-len words of its own")
    syn.add_argument("--prefix-repetition-num-prefixes", type=int, default=8,
                     help="how many shared prefixes (default 8)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=None,
                      help="requests per second, Poisson arrivals (inf = all at once, the default)")
    load.add_argument("--request-rates", type=_rates, default=None, metavar="R1,R2,...",
                      help="a sweep: one run per rate, e.g. 1,2,4,inf")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson (default), < 1 burstier, > 1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once (default: no cap)")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the synthetic prompts (default 0)")
    load.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                      help=f"seconds before one request counts as failed (default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    parser.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--no-test-request", action="store_true",
                        help="skip the initial untimed test request (it checks the setup and warms the server)")
    parser.add_argument("--label", default=None, help="name of the system in plots (default: the model name)")
    parser.add_argument("--out", default=None, help="write the report (every run, every request's timings) as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="with --request-rates: throughput and p99 TTFT vs rate; else latency bars "
                             "(needs matplotlib)")
    add_fault_arguments(parser)
    add_progress_argument(parser)


def workload_from_args(args: Any) -> Workload:
    synthetic = (args.synthetic_input_len, args.synthetic_output_len)
    try:
        if args.workload is not None:
            if any(v is not None for v in synthetic):
                raise SystemExit("error: give either --workload or --synthetic-* options, not both")
            workload = load_workload(args.workload)
            if args.num_prompts is not None:
                if args.num_prompts > len(workload):
                    print(f"note: --num-prompts {args.num_prompts} but the workload has {len(workload)} requests; "
                          "using all", file=sys.stderr)
                workload = workload.limit(args.num_prompts)
            if any(r.prompt is None for r in workload.requests):
                raise SystemExit("error: the serve benchmark sends text prompts; this workload has token ids")
            return workload
        if not all(v is not None for v in (*synthetic, args.num_prompts)):
            raise SystemExit("error: give --workload FILE.json, or all of --synthetic-input-len, "
                             "--synthetic-output-len and --num-prompts")
        if args.prefix_repetition_prefix_len is not None:
            return prefix_repetition_workload(args.prefix_repetition_prefix_len, args.prefix_repetition_num_prefixes,
                                              args.synthetic_input_len, args.synthetic_output_len, args.num_prompts,
                                              seed=args.seed)
        return synthetic_text_workload(args.synthetic_input_len, args.synthetic_output_len, args.num_prompts,
                                       seed=args.seed)
    except (OSError, WorkloadError) as exc:
        raise SystemExit(f"error: {exc}") from None


def run_from_args(args: Any) -> int:
    if args.request_rate is not None and args.request_rates is not None:
        raise SystemExit("error: give --request-rate or --request-rates, not both")
    rates = args.request_rates or [math.inf if args.request_rate is None else args.request_rate]
    if any(not r > 0 for r in rates):
        raise SystemExit(f"error: request rates must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"error: --max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_timeout > 0:
        raise SystemExit(f"error: --request-timeout must be > 0, got {args.request_timeout}")
    if not args.burstiness > 0:
        raise SystemExit(f"error: --burstiness must be > 0, got {args.burstiness}")
    from ..kernels import vector_flags
    from .launch import launch_options, launched_server

    launch = launch_options(args)
    if args.base_url is not None:
        try:
            api_urls(args.base_url, args.endpoint)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    if args.plot:  # fail before the run, not after it
        from .plot import PlotDependencyError, require_matplotlib

        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            raise SystemExit(f"error: {exc}") from None
    workload = workload_from_args(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    in_flight = args.max_concurrency or len(workload)
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and in_flight > soft - 64:
            log(f"warning: up to {in_flight} connections at once but the open-file limit is {soft}: requests "
                "beyond it fail; raise it (ulimit -n) or pass --max-concurrency")
    except ImportError:  # not on POSIX
        pass
    try:
        with launched_server(**launch, log=log) if launch else contextlib.nullcontext() as server:
            base_url = server["base_url"] if server else args.base_url
            log(f"Workload {workload.name}: {len(workload)} requests, {workload.total_max_new_tokens} max new "
                f"tokens in all, temperature {workload.temperature:g} -> {api_urls(base_url, args.endpoint)[0]}")
            report = asyncio.run(benchmark(base_url, workload, endpoint=args.endpoint, model=args.model,
                                           request_rates=rates, burstiness=args.burstiness,
                                           max_concurrency=args.max_concurrency, seed=args.seed,
                                           timeout_s=args.request_timeout, api_key=api_key,
                                           test_request=not args.no_test_request, progress=progress_wanted(args.no_progress),
                                           kill_replica=args.kill_replica, kill_after_s=args.kill_after, log=log))
    except RuntimeError as exc:
        raise SystemExit(f"error: {exc}") from None
    report["server"] = {"launched": True, **server} if server else {"launched": False}
    report["environment"] = {"cpu_flags": vector_flags()}
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    if args.plot:
        plot_report(report, args.plot, label=args.label)
        print(f"Wrote {args.plot}")
    return 1 if any(run["failed"] for run in report["results"]) else 0
