"""`python -m tools.soak --minutes N`: a long mixed load on Conveyor's server, with disconnects.

Workers send, until the time is up, a random mix of plain and streamed completions and chat
completions, `n` > 1, stop strings, token-id prompts near (and a few just past) the context limit,
and requests that the client abandons at a random moment (a streamed one dropped mid-stream, a
plain one cancelled while it waits). Meanwhile `/health` is polled and the server process' resident
memory is sampled (`/proc/PID/status`; the launched server's pid, or `--pid`) with the KV pool's
resident bytes (`/dashboard/data`). On CPU the pool is allocated uncommitted and its pages become
resident as requests first write them, so the process' RSS climbs towards the pool's size under
any traffic that reaches new chunks: that is reported apart, and the memory limit applies to the
RSS outside the pool (RSS minus the pool's resident bytes). Passes when every request that was
not abandoned got its whole answer (a final chunk or `[DONE]`, or a documented 4xx for the prompts
past the limit), no 5xx, `/health` always 200, the server idle afterwards (nothing in flight,
every KV block free or cached) and the RSS outside the pool grew less than `--max-rss-growth` (5%)
after warm-up. Exit code 1 otherwise.

Prompts "near the limit" are `--near-limit-tokens` long with their `max_tokens` (default the
context, or 2048 when the context is longer: an 8192-token prefill takes many seconds on a CPU);
the prompts just past the limit always use the real context, which the server rejects up front.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench.launch import add_launch_arguments, launch_options, launched_server
from tools import has_requirements

WARMUP_FRACTION = 0.25  # RSS growth is measured from the first sample after this share of the run (default)
RSS_EVERY_S = 1.0
NEAR_LIMIT_TOKENS = 2048  # the default bound on prompt + max_tokens of the "long" requests
MIB = 2**20
HEALTH_EVERY_S = 0.5
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars glow".split()
STOPS = [" the", " a", "\n", "."]


@dataclass
class SoakReport:
    seconds: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)  # requests sent by kind
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "400", "abandoned", "transport error"
    incomplete: int = 0  # answered 200 without a final chunk / finish_reason
    unexpected: list[str] = field(default_factory=list)  # first few wrong answers
    health_checks: int = 0
    health_failures: int = 0
    # (seconds into the run, process RSS MiB, KV pool resident MiB)
    memory: list[tuple[float, float, float]] = field(default_factory=list)
    pool_mib: float = 0.0  # the KV pool's size
    near_limit_tokens: int = 0  # prompt + max_tokens of the "long" requests
    context: int = 0
    idle_after: dict[str, Any] = field(default_factory=dict)
    max_rss_growth: float = 0.05
    warmup_fraction: float = WARMUP_FRACTION

    @property
    def requests(self) -> int:
        return sum(self.kinds.values())

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.isdigit() and int(s) >= 500)

    def window(self) -> dict[str, tuple[float, float]] | None:
        """MiB at the first sample after warm-up and at the end: the process' RSS, the KV pool's
        resident part and the rest (`outside_pool`)."""
        if not self.memory:
            return None
        warm = next((m for m in self.memory if m[0] >= self.seconds * self.warmup_fraction), self.memory[-1])
        end = self.memory[-1]
        return {"rss": (warm[1], end[1]), "pool": (warm[2], end[2]),
                "outside_pool": (warm[1] - warm[2], end[1] - end[2])}

    def growth(self, part: str) -> float | None:
        window = self.window()
        return None if window is None else window[part][1] / window[part][0] - 1.0

    @property
    def rss_growth(self) -> float | None:
        """Growth of the RSS outside the KV pool after warm-up: the figure the limit applies to."""
        return self.growth("outside_pool")

    @property
    def idle(self) -> bool:
        d = self.idle_after
        return bool(d) and d["in_flight"] == d["running"] == d["waiting"] == 0 and d["kv_used"] == 0

    @property
    def ok(self) -> bool:
        growth = self.rss_growth
        return (self.server_errors == 0 and self.incomplete == 0 and not self.unexpected and self.idle
                and self.health_failures == 0 and self.statuses["transport error"] == 0
                and (growth is None or growth < self.max_rss_growth))

    def as_dict(self) -> dict[str, Any]:
        window = self.window() or {}
        memory = {f"{part}_mib": [round(m, 1) for m in window[part]] for part in window}
        growth = {f"{part}_growth": self.growth(part) for part in window}
        return {"seconds": round(self.seconds, 1), "requests": self.requests, "kinds": dict(self.kinds),
                "statuses": dict(self.statuses), "incomplete": self.incomplete, "unexpected": self.unexpected,
                "health_checks": self.health_checks, "health_failures": self.health_failures,
                "context": self.context, "near_limit_tokens": self.near_limit_tokens,
                "pool_mib": round(self.pool_mib, 1),
                "memory_after_warmup_and_end": memory, **growth, "idle_after": self.idle_after, "ok": self.ok,
                "memory_samples": {"columns": ["seconds", "rss_mib", "pool_resident_mib"],
                                   "rows": [[round(x, 1) for x in sample] for sample in self.memory]}}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Soak:
    def __init__(self, base_url: str, seconds: float, concurrency: int, pid: int | None, seed: int,
                 max_tokens: int, api_key: str | None, near_limit_tokens: int | None = None) -> None:
        self.base_url, self.seconds, self.concurrency, self.pid = base_url, seconds, concurrency, pid
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.near_limit_tokens = near_limit_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.report = SoakReport()
        self.context = 0
        self.model = ""

    def _client(self, **kwargs: Any) -> Any:
        import httpx

        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=300, trust_env=False, **kwargs)

    async def run(self) -> SoakReport:
        import httpx

        async with self._client(limits=httpx.Limits(max_connections=self.concurrency + 4)) as http:
            model = (await http.get("/v1/models")).json()["data"][0]
            self.model, self.context = model["id"], model["max_model_len"]
            near = self.near_limit_tokens or min(self.context, NEAR_LIMIT_TOKENS)
            self.report.context, self.report.near_limit_tokens = self.context, min(near, self.context)
            started = time.monotonic()
            deadline = started + self.seconds
            async with self._client() as watch:  # the monitors' own connections: never queued behind the load
                monitors = [asyncio.create_task(self._health(watch, deadline)),
                            asyncio.create_task(self._memory(watch, started, deadline))]
                await asyncio.gather(*(self._worker(http, deadline) for _ in range(self.concurrency)))
                await asyncio.gather(*monitors)
            self.report.seconds = time.monotonic() - started
            self.report.idle_after = await self._wait_idle(http)
            if self.pid is not None:
                await self._sample_memory(http, self.report.seconds)
        return self.report

    async def _health(self, http: Any, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.report.health_checks += 1
            try:
                ok = (await http.get("/health", timeout=10)).status_code == 200
            except Exception:  # noqa: BLE001  (any transport error is a failed check)
                ok = False
            self.report.health_failures += not ok
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _memory(self, http: Any, started: float, deadline: float) -> None:
        import httpx

        while self.pid is not None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):  # a slow answer skips a sample; /health counts failures
                await self._sample_memory(http, time.monotonic() - started)
            await asyncio.sleep(RSS_EVERY_S)

    async def _sample_memory(self, http: Any, at: float) -> None:
        """The pool's resident bytes, then the RSS (pool pages are never given back, so the
        difference never undercounts the memory outside the pool)."""
        kv = (await http.get("/dashboard/data", timeout=30)).json()["kv"]
        self.report.pool_mib = kv["bytes"] / MIB
        self.report.memory.append((at, rss_mib(self.pid), kv["resident_bytes"] / MIB))

    async def _wait_idle(self, http: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        """The server's counts once nothing is in flight (or at the timeout)."""
        end = time.monotonic() + timeout_s
        while True:
            d = (await http.get("/dashboard/data")).json()
            idle = {"in_flight": d["requests"]["in_flight"], "running": d["requests"]["running"],
                    "waiting": d["requests"]["waiting"], "kv_used": d["kv"]["used"], "kv_total": d["kv"]["total"]}
            if (idle["in_flight"] == idle["running"] == idle["waiting"] == idle["kv_used"] == 0
                    or time.monotonic() > end):
                return idle
            await asyncio.sleep(0.2)

    def _request(self) -> tuple[str, str, dict[str, Any], bool]:
        """(kind, path, body, expect_400) of a random request."""
        rng, kind = self.rng, self.rng.choice(["plain", "stream", "chat", "chat-stream", "n", "stop", "long",
                                                "over-limit", "disconnect", "cancel"])
        max_tokens = rng.randint(1, self.max_tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        if kind in ("chat", "chat-stream"):
            body["messages"] = [{"role": "user", "content": text}]
            body["stream"] = kind == "chat-stream"
            return kind, "/v1/chat/completions", body, False
        body["prompt"] = text
        body["stream"] = kind in ("stream", "disconnect") or rng.random() < 0.3
        if kind == "n":
            body["n"] = rng.randint(2, 4)
        elif kind == "stop":
            body["stop"] = rng.sample(STOPS, 2)
        elif kind in ("long", "over-limit"):
            over = rng.randint(1, 3) if kind == "over-limit" else -rng.randint(0, 3)
            length = (self.context if kind == "over-limit" else self.report.near_limit_tokens) - max_tokens + over
            body["prompt"] = [rng.randint(3, 99) for _ in range(length)]
        elif kind in ("disconnect", "cancel"):
            body["max_tokens"] = self.max_tokens
        return kind, "/v1/completions", body, kind == "over-limit"

    async def _worker(self, http: Any, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind, path, body, expect_400 = self._request()
            self.report.kinds[kind] += 1
            abandoned = kind in ("disconnect", "cancel")
            task = asyncio.create_task(self._send_alone(path, body) if abandoned else
                                       self._send(http, path, body, expect_400))
            if abandoned:
                await asyncio.sleep(self.rng.uniform(0.0, 0.5))
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled():
                self.report.statuses["abandoned"] += 1

    async def _send_alone(self, path: str, body: dict[str, Any]) -> None:
        """A request the client will abandon, on its own connection, closed when it is cancelled (as a
        client that goes away closes its socket; a cancelled request would not return a pooled one)."""
        async with self._client() as own:
            await self._send(own, path, body, False)

    async def _send(self, http: Any, path: str, body: dict[str, Any], expect_400: bool) -> None:
        import httpx

        try:
            if body["stream"]:
                async with http.stream("POST", path, json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    status, complete = r.status_code, bool(lines) and lines[-1] == "data: [DONE]"
                    text = "\n".join(lines[-2:])
            else:
                r = await http.post(path, json=body)
                status, text = r.status_code, r.text
                complete = status != 200 or all(c.get("finish_reason") for c in r.json()["choices"])
        except httpx.HTTPError as exc:
            self.report.statuses["transport error"] += 1
            self._unexpected(f"{path}: {type(exc).__name__}: {exc}")
            return
        self.report.statuses[str(status)] += 1
        if status == 200 and not complete:
            self.report.incomplete += 1
            self._unexpected(f"{path}: incomplete answer: {text[-200:]}")
        if status != (400 if expect_400 else 200):
            self._unexpected(f"{path} -> {status}: {text[:200]}")

    def _unexpected(self, message: str) -> None:
        if len(self.report.unexpected) < 10:
            self.report.unexpected.append(message)


def print_report(report: SoakReport, out: Any = sys.stdout) -> None:
    d = report.as_dict()
    print(f"soak: {d['requests']} requests in {d['seconds']:.0f} s; by kind {d['kinds']}", file=out)
    print(f"statuses: {d['statuses']}; incomplete answers: {d['incomplete']}", file=out)
    print(f"/health: {d['health_failures']} failures in {d['health_checks']} checks", file=out)
    print(f"prompts near the limit: {d['near_limit_tokens']} tokens with max_tokens (context {d['context']})",
          file=out)
    window = report.window()
    if window is not None:
        def line(part: str) -> str:
            start, end = window[part]
            return f"{start:.1f} MiB after warm-up -> {end:.1f} MiB at the end ({100 * report.growth(part):+.1f}%)"

        print(f"server RSS outside the KV pool: {line('outside_pool')}, limit {100 * report.max_rss_growth:.0f}%",
              file=out)
        print(f"  KV pool resident (its pages first touched, not a leak): {line('pool')}, "
              f"of {report.pool_mib:.1f} MiB", file=out)
        print(f"  whole process RSS: {line('rss')}", file=out)
    print(f"after: {d['idle_after']}", file=out)
    for message in report.unexpected:
        print(f"  unexpected: {message}", file=out)
    print("OK" if report.ok else "FAILED", file=out)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="most tokens a request generates (default 48)")
    parser.add_argument("--max-rss-growth", type=float, default=0.05,
                        help="allowed growth after warm-up of the server's RSS outside the KV pool (default 0.05)")
    parser.add_argument("--near-limit-tokens", type=int, default=None,
                        help="prompt + max_tokens of the prompts near the limit (default: the context, at most "
                             f"{NEAR_LIMIT_TOKENS}); prompts past the limit use the real context")
    parser.add_argument("--warmup-fraction", type=float, default=WARMUP_FRACTION,
                        help="RSS growth is measured from this share of the run on (default 0.25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", default=None, help="a running Conveyor server; or --launch")
    parser.add_argument("--pid", type=int, default=None, help="the --base-url server's pid (for its RSS)")
    parser.add_argument("--api-key", default=None)
    add_launch_arguments(parser)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")


def run_from_args(args: Any) -> int:
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        raise SystemExit("error: --minutes, --concurrency and --max-tokens must be positive")
    if not 0 <= args.warmup_fraction < 1:
        raise SystemExit("error: --warmup-fraction must be in [0, 1)")
    if args.near_limit_tokens is not None and args.near_limit_tokens <= args.max_tokens + 3:
        raise SystemExit("error: --near-limit-tokens must be more than --max-tokens + 3")
    launch = launch_options(args)
    with launched_server(**launch, log=lambda m: print(m, file=sys.stderr)) if launch else \
            contextlib.nullcontext() as server:
        base_url = server["base_url"] if server else args.base_url.rstrip("/").removesuffix("/v1")
        pid = server["pid"] if server else args.pid
        soak = Soak(base_url, args.minutes * 60, args.concurrency, pid, args.seed, args.max_tokens, args.api_key,
                    args.near_limit_tokens)
        soak.report.max_rss_growth, soak.report.warmup_fraction = args.max_rss_growth, args.warmup_fraction
        report = asyncio.run(soak.run())
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.soak`; returns the exit code (1 on any failure)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.soak",
        description="For --minutes, --concurrency workers send plain and streamed (chat) completions, n > 1, stop "
                    "strings, prompts near and just past the context limit, and abandon some mid-stream or while "
                    "waiting; /health is polled and the server's RSS sampled. Exit code 1 unless every kept request "
                    "got its whole answer, no 5xx, /health always answered, the server idle after and RSS after "
                    "warm-up grew < --max-rss-growth.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not has_requirements(parser.prog, (("httpx", "bench"),)):
        return 2
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
