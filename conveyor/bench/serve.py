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

A "token chunk" is a streamed choice carrying text (`text` for /v1/completions; `delta.content`,
`delta.reasoning_content` or `delta.reasoning` for chat), even an empty string (special tokens,
held-back partial characters), except an empty one that only announces the role (llama-server
sends it before prefill, so vllm's rule, any chunk with choices, would start its TTFT early) or
closes the stream (finish_reason set; unless no token came before it: an EOS generated at once),
and chunks without text (the usage chunk). A finish_reason "error" or "abort" fails the request.

Only HTTP: the server is any OpenAI-compatible one (Conveyor's `conveyor serve`, vLLM,
llama.cpp's llama-server). The client talks only to `--base-url` (no redirects followed, proxy
environment variables ignored) and every request ends by `--request-timeout`. `--launch` starts
Conveyor's own server for the run instead, in the `--dtype`/`--quantization` asked for (`launch.py`).

Statistics are over the successful requests: mean, median, std, p90, p99 (numpy's default linear
interpolation), in milliseconds; throughputs divide by the whole run's duration (first request
scheduled to last response finished). JSON keys follow vllm's result files (`completed`,
`request_throughput`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .modes import add_mode_arguments
from .workloads import BenchRequest, Workload, WorkloadError, check_synthetic_sizes, load_workload

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
DEFAULT_REQUEST_TIMEOUT_S = 600.0
PERCENTILES = (90, 99)
METRICS = (("ttft", "Time to First Token", "TTFT"),
           ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"),
           ("e2el", "End-to-end Latency", "E2EL"))
_ERROR_BODY_CHARS = 500
_DRAIN_AFTER_DONE_S = 1.0
_FAILED_FINISH_REASONS = ("error", "abort")  # Conveyor's and vLLM's ends of a failed or cancelled request

# Common short English words: nearly all are a single token (with their leading space) in the
# usual BPE vocabularies, so N words are roughly N prompt tokens. The server's usage chunk reports
# the exact count.
_WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his her he she it they we you this be are
have had not but or an which one all were when there can more if out so said what up its about
into than them time only new some could these two may then first any like now my such over man
also make did made after well back most way even many before must through years where much your
way down should because long each just people those too how little state good very world still
own see men work last never us day same another know year while last might great old off come
since against go came right used take three small house part hand high place old case point
""".split()))


# -- statistics -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics: numpy's
    default (`np.percentile(values, q)`), which vllm's figures use."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(float(v) for v in values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(samples_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """mean, median, std (population, as numpy) and the given percentiles of samples in seconds,
    reported in milliseconds. Every value is None when there are no samples."""
    keys = ["mean", "median", "std"] + [f"p{q:g}" for q in percentiles]
    if not samples_s:
        return dict.fromkeys(keys)
    values = [float(v) * 1000.0 for v in samples_s]
    mean = sum(values) / len(values)
    out: dict[str, float | None] = {
        "mean": mean, "median": percentile(values, 50),
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


# -- arrivals -------------------------------------------------------------------------------------
def arrival_times(num_requests: int, request_rate: float, *, seed: int = 0, burstiness: float = 1.0,
                  normalize: bool = True) -> list[float]:
    """Send times (seconds from the start) of `num_requests` requests.

    `request_rate` inf: all at 0. Otherwise the gaps are gamma(shape=burstiness,
    scale=1/(rate*burstiness)) -- exponential, i.e. a Poisson process, for burstiness 1 -- drawn
    from `random.Random(seed)`, and the first request waits one gap, as in vllm. With `normalize`
    (vllm's behaviour) the times are rescaled so that the last one is exactly num_requests / rate:
    the run's offered load is then the requested rate whatever the seed.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        t += theta if math.isinf(burstiness) else rng.gammavariate(burstiness, theta)
        times.append(t)
    if normalize and times[-1] > 0:
        scale = (num_requests / request_rate) / times[-1]
        times = [x * scale for x in times]
    return times


# -- workloads ------------------------------------------------------------------------------------
def synthetic_text_workload(input_len: int, output_len: int, num_prompts: int, *, seed: int = 0) -> Workload:
    """`num_prompts` prompts of `input_len` random common English words (about one token each; the
    server's usage reports the exact count), each asking for exactly `output_len` tokens (EOS
    ignored). Text, not token ids, so that it works on every endpoint of every server."""
    check_synthetic_sizes(input_len, output_len, num_prompts)
    rng = random.Random(seed)
    requests = [BenchRequest(max_new_tokens=output_len, prompt=" ".join(rng.choices(_WORDS, k=input_len)),
                             ignore_eos=True)
                for _ in range(num_prompts)]
    return Workload(name=f"random-in{input_len}-out{output_len}-n{num_prompts}", requests=requests,
                    description=f"{num_prompts} prompts of {input_len} random words (seed {seed}), exactly "
                                f"{output_len} new tokens each (ignore_eos)",
                    temperature=0.0, source="synthetic")


# -- one request ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """Client-side record of one streamed request. Times in seconds; `arrival_s`, `start_s` and
    `end_s` from the start of the run, the others from `start_s` (the moment it was sent, after any
    wait for a concurrency slot)."""

    index: int
    arrival_s: float = 0.0
    start_s: float = 0.0
    success: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None       # to the last token chunk (vllm's E2E latency)
    end_s: float | None = None           # the stream's end ([DONE] or EOF), from the run's start
    output_tokens: int = 0
    output_tokens_source: str = "none"   # "usage", "chunks" or "none"
    prompt_tokens: int | None = None
    token_chunks: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(request: BenchRequest, *, model: str, chat: bool, temperature: float = 0.0) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    if request.prompt is None:
        raise WorkloadError("the serve benchmark sends text prompts; this request has only token ids")
    payload: dict[str, Any] = {"model": model}
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update({"max_tokens": request.max_new_tokens, "temperature": temperature, "stream": True,
                    "stream_options": {"include_usage": True}})
    if request.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _token_text(choice: dict[str, Any], chat: bool) -> str | None:
    """The text a streamed choice carries, or None when it carries no token: no text field, or an
    empty one on a role announcement or on a closing chunk (finish_reason set)."""
    if not chat and "text" not in choice and isinstance(choice.get("delta"), dict):
        chat = True  # a completions endpoint answering in chat shape
    if chat:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        pieces = [p for p in (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
                  if isinstance(p, str)]
        if not pieces:
            return None
        text = "".join(pieces)
        if not text and "role" in delta:
            return None
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            return None
    if not text and choice.get("finish_reason"):
        return None
    return text


async def _read_capped(response: Any, limit: int = _ERROR_BODY_CHARS) -> str:
    data = b""
    async for part in response.aiter_bytes():
        data += part
        if len(data) >= limit:
            break
    return data[:limit].decode("utf-8", "replace").strip()


async def _drain(lines: Any) -> None:
    async for _ in lines:
        pass


async def _stream_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str],
                          result: RequestResult, chat: bool, t0: float) -> None:
    start = time.perf_counter()
    result.start_s = start - t0
    last_token = None
    done = False
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        result.status = response.status_code
        if response.status_code != 200:
            body = await _read_capped(response)
            result.error = f"HTTP {response.status_code}" + (f": {body}" if body else "")
            return
        lines = response.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments (":"), "event:" lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                result.end_s = time.perf_counter() - t0
                # Read the body's end so that the connection is reused, as a client would; a server
                # that keeps the stream open after [DONE] costs at most a second, not a failure.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_drain(lines), _DRAIN_AFTER_DONE_S)
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                result.error = f"invalid JSON in the stream: {data[:200]!r}"
                return
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                result.error = f"error in the stream: {json.dumps(chunk['error'])[:_ERROR_BODY_CHARS]}"
                return
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    result.output_tokens = usage["completion_tokens"]
                    result.output_tokens_source = "usage"
                if isinstance(usage.get("prompt_tokens"), int):
                    result.prompt_tokens = usage["prompt_tokens"]
            choices = chunk.get("choices")
            if not choices or not isinstance(choices[0], dict):
                continue
            choice = choices[0]
            finish = choice.get("finish_reason")
            if finish:
                result.finish_reason = finish
                if finish in _FAILED_FINISH_REASONS:
                    result.error = f"finish_reason {finish!r}"
                    return
            # A closing chunk is no token, unless nothing came before it: then it carries the
            # (invisible) first token, e.g. an EOS generated at once, and dates it.
            if _token_text(choice, chat) is None and not (finish and last_token is None):
                continue
            if last_token is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last_token)
            last_token = now
            result.token_chunks += 1
    if result.end_s is None:
        result.end_s = time.perf_counter() - t0
    if last_token is None:
        result.error = "the stream carried no tokens" + ("" if done else " and no [DONE]")
        return
    if not done and result.finish_reason is None:
        result.error = "the stream ended before [DONE] or a finish_reason"
        return
    result.latency_s = last_token - start
    if result.output_tokens_source != "usage":
        result.output_tokens = result.token_chunks
        result.output_tokens_source = "chunks"
    result.success = True


async def send_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], *,
                       index: int = 0, chat: bool, timeout_s: float, t0: float | None = None,
                       arrival_s: float = 0.0) -> RequestResult:
    """Send one streamed request and time it; never raises (except on cancellation): an HTTP
    error, a dropped connection, a malformed stream or the timeout make a failed result."""
    result = RequestResult(index=index, arrival_s=arrival_s)
    t0 = time.perf_counter() if t0 is None else t0
    try:
        await asyncio.wait_for(_stream_request(client, url, payload, headers, result, chat, t0), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:g} s (--request-timeout)"
    except Exception as exc:  # noqa: BLE001 -- any failure of one request is that request's result
        result.error = f"{type(exc).__name__}: {exc}".strip().rstrip(":") or type(exc).__name__
    if result.error is not None:
        result.success = False
        if result.end_s is None:
            result.end_s = time.perf_counter() - t0
    return result


# -- the run --------------------------------------------------------------------------------------
def api_urls(base_url: str, endpoint: str) -> tuple[str, str]:
    """(request URL, models URL). A base URL ending in /v1 is accepted (the /v1 is not doubled)."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-3]
    return base + endpoint, base + "/v1/models"


def is_chat_endpoint(endpoint: str) -> bool:
    """Chat format (messages, deltas) for a chat endpoint, completions format (prompt, text) else."""
    return "chat" in endpoint.lower()


def make_client(*, max_concurrency: int | None, timeout_s: float) -> Any:
    import httpx

    limit = max_concurrency if max_concurrency else None  # unlimited, as vllm's connector without a cap
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                             follow_redirects=False, trust_env=False)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(client: Any, models_url: str, headers: dict[str, str]) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        response = await client.get(models_url, headers=headers)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"cannot reach {models_url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise RuntimeError(f"GET {models_url}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"GET {models_url} listed no model ({response.text[:200]!r}); pass --model") from exc


async def run_once(client: Any, url: str, workload: Workload, *, model: str, chat: bool,
                   request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, api_key: str | None = None,
                   progress: bool = True, desc: str | None = None) -> dict[str, Any]:
    """One benchmark run of every request of `workload` at `request_rate`; returns its metrics."""
    payloads = [build_payload(r, model=model, chat=chat, temperature=workload.temperature)
                for r in workload.requests]
    headers = _headers(api_key)
    arrivals = arrival_times(len(payloads), request_rate, seed=seed, burstiness=burstiness)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(payloads), desc=desc, unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)

    async def one(i: int, t0: float) -> RequestResult:
        async with semaphore:
            result = await send_request(client, url, payloads[i], headers, index=i, chat=chat,
                                        timeout_s=timeout_s, t0=t0, arrival_s=arrivals[i])
        bar.update(1)
        return result

    tasks = []
    t0 = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, t0)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    duration = time.perf_counter() - t0
    return compute_metrics(results, duration, request_rate=request_rate, burstiness=burstiness,
                           max_concurrency=max_concurrency)


def compute_metrics(results: Sequence[RequestResult], duration_s: float, *, request_rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None) -> dict[str, Any]:
    """vllm's serving metrics from the request results (statistics over the successful ones)."""
    ok = [r for r in results if r.success]
    samples = {"ttft": [r.ttft_s for r in ok],
               "tpot": [t for t in (r.tpot_s for r in ok) if t is not None],
               "itl": [x for r in ok for x in r.itl_s],
               "e2el": [r.latency_s for r in ok]}
    total_output = sum(r.output_tokens for r in ok)
    known_input = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    total_input = sum(known_input)
    out: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "input_tokens_reported": len(known_input),
        "output_tokens_from_usage": sum(r.output_tokens_source == "usage" for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name, _, _ in METRICS:
        for stat, value in summarize_ms(samples[name]).items():
            out[f"{stat}_{name}_ms"] = value
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out["errors"] = errors
    out["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in results]
    return out


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (send to last token, half-open intervals), as vllm."""
    events = sorted([(r.start_s, 1) for r in results if r.latency_s is not None]
                    + [(r.start_s + r.latency_s, -1) for r in results if r.latency_s is not None])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


async def benchmark(base_url: str, workload: Workload, *, endpoint: str = CHAT_ENDPOINT, model: str | None = None,
                    request_rates: Sequence[float] = (math.inf,), burstiness: float = 1.0,
                    max_concurrency: int | None = None, seed: int = 0,
                    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, api_key: str | None = None,
                    test_request: bool = True, progress: bool = True,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
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
            model = await first_model(client, models_url, _headers(api_key))
            log(f"Model: {model} (first of GET {models_url})")
        if test_request:
            log("Starting initial single prompt test run...")
            first = build_payload(workload.requests[0], model=model, chat=chat, temperature=workload.temperature)
            res = await send_request(client, url, first, _headers(api_key), chat=chat, timeout_s=timeout_s)
            if not res.success:
                raise RuntimeError(f"the initial test request to {url} failed: {res.error}")
            log("Initial test run completed.")
        runs = []
        for rate in request_rates:
            log(f"Traffic request rate: {rate:g} req/s, burstiness {burstiness:g}"
                f"{' (Poisson process)' if burstiness == 1 and not math.isinf(rate) else ''}, "
                f"max concurrency {max_concurrency or 'unlimited'}")
            runs.append(await run_once(client, url, workload, model=model, chat=chat, request_rate=rate,
                                       burstiness=burstiness, max_concurrency=max_concurrency, seed=seed,
                                       timeout_s=timeout_s, api_key=api_key, progress=progress,
                                       desc=f"rate {rate:g}"))
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


# -- text report ----------------------------------------------------------------------------------
def _num(value: Any, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def format_run(run: dict[str, Any]) -> str:
    """vllm's result table for one run."""
    rows: list[str] = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        rows.append(f"{label:<40} {value:<10}".rstrip())

    row("Successful requests:", run["completed"])
    row("Failed requests:", run["failed"])
    if run.get("max_concurrency"):
        row("Maximum request concurrency:", run["max_concurrency"])
    rate = run["request_rate"]
    row("Request rate configured (RPS):", "inf" if rate == "inf" else f"{rate:.2f}")
    row("Benchmark duration (s):", f"{run['duration']:.2f}")
    input_note = "" if run["input_tokens_reported"] == run["completed"] else \
        f" (usage of {run['input_tokens_reported']}/{run['completed']})"
    row("Total input tokens:", f"{run['total_input_tokens']}{input_note}")
    output_note = "" if run["output_tokens_from_usage"] == run["completed"] else \
        f" (usage of {run['output_tokens_from_usage']}/{run['completed']}, chunks counted)"
    row("Total generated tokens:", f"{run['total_output_tokens']}{output_note}")
    row("Request throughput (req/s):", f"{run['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{run['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{run['total_token_throughput']:.2f}")
    row("Peak concurrent requests:", run["max_concurrent_requests"])
    for name, title, short in METRICS:
        rows.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", _num(run[f"{stat}_{name}_ms"]))
    if run["errors"]:
        rows.append("{s:{c}^{n}}".format(s="Errors", n=50, c="-"))
        for err, count in sorted(run["errors"].items(), key=lambda kv: -kv[1])[:10]:
            rows.append(f"{count:>5} x {err[:200]}")
    rows.append("=" * 50)
    return "\n".join(rows)


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One line per request rate."""
    head = (f"{'rate':>8} {'ok':>5} {'fail':>5} {'dur s':>8} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} {'E2E p99':>9}   (latencies in ms)")
    lines = ["Request-rate sweep", head]
    for r in runs:
        rate = r["request_rate"]
        lines.append(f"{rate if rate == 'inf' else format(rate, 'g'):>8} {r['completed']:>5} {r['failed']:>5} "
                     f"{r['duration']:>8.2f} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
                     f"{_num(r['median_ttft_ms'], '.1f'):>9} {_num(r['p99_ttft_ms'], '.1f'):>9} "
                     f"{_num(r['median_tpot_ms'], '.1f'):>9} {_num(r['p99_itl_ms'], '.1f'):>8} "
                     f"{_num(r['p99_e2el_ms'], '.1f'):>9}")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    wl, server = report["workload"], report.get("server")
    parts = [f"Serve benchmark: {report['api_url']}, model {report['model_id']}, workload {wl['name']} "
             f"({wl['num_requests']} requests)"]
    if server:  # set by run_from_args: what served, as far as the client can know
        flags = " ".join(report["environment"]["cpu_flags"]) or "unknown"
        parts[0] += ("\n" + (f"Server: Conveyor launched for the run ({server['dtype']}, weights "
                              f"{server['quantization']}); CPU flags {flags}" if server["launched"] else
                              f"Server: external, in its own dtype and weights; this machine's CPU flags {flags}"))
    for run in report["results"]:
        parts.append(format_run(run))
    if len(report["results"]) > 1:
        parts.append(format_sweep(report["results"]))
    return "\n\n".join(parts)


# -- plots ----------------------------------------------------------------------------------------
def plot_report(report: dict[str, Any], path: str | os.PathLike[str], label: str | None = None) -> Path:
    """A sweep: output tok/s and p99 TTFT against request rate. One run: latency bars (ms)."""
    from . import plot

    runs = report["results"]
    if len(runs) > 1:
        points = [{"request_rate": math.inf if r["request_rate"] == "inf" else r["request_rate"],
                   "output_tok_per_s": r["output_throughput"],
                   "ttft_p99_s": (r["p99_ttft_ms"] or 0.0) / 1000.0,
                   "system": label or report["model_id"]} for r in runs]
        return plot.plot_rate_sweep(points, path, title=f"{label or report['model_id']} via {report['api_url']}: "
                                                        f"throughput and p99 TTFT vs request rate")
    run = runs[0]
    metrics = {short: {stat: run[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99")
                       if run[f"{stat}_{name}_ms"] is not None}
               for name, _, short in METRICS}
    metrics = {k: v for k, v in metrics.items() if v}
    if not metrics:
        raise ValueError("no successful requests: nothing to plot")
    rate = run["request_rate"]
    return plot.plot_latency_percentiles(
        metrics, path, unit="ms",
        title=f"{label or report['model_id']}: latency at {rate} req/s ({run['completed']} requests)")


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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("error: the serve benchmark needs httpx: pip install httpx") from None
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
                                           test_request=not args.no_test_request, progress=not args.no_progress,
                                           log=log))
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
