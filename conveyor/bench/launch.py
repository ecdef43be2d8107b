"""`bench serve --launch`: start Conveyor's own server for the run, in the mode asked for.

`conveyor bench serve` is a client of any OpenAI-compatible server; an external server runs in
whatever dtype and weight format it was started with, which the client cannot see. With
`--launch` the benchmark starts `conveyor serve` itself, as a subprocess on a free loopback port
(`python -m conveyor.bench.launch`: `conveyor serve`'s options, plus `--info FILE`, where it
writes the dtype, quantization and CPU flags `LLM` resolved before it starts serving), waits for
`GET /health`, and stops it with SIGINT (the server's graceful drain) when the run ends. A
subprocess, not a thread: the server's engine and the client's event loop must not share a GIL.
The server's log goes to our stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

POLL_S = 0.5
STOP_GRACE_S = 30.0  # after SIGINT: the server's drain (--shutdown-timeout, 10 s by default) and exit


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch_command(info_path: Path, port: int, *, model: str | None, dtype: str, quantization: str | None,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The child's command line: `conveyor serve`'s options as this module takes them, `extra_args` more
    of them (engine options)."""
    command = [sys.executable, "-m", "conveyor.bench.launch", "--info", str(info_path), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--log-level", "warning"]
    if model is not None:
        command += ["--model", model]
    if quantization is not None:
        command += ["--quantization", quantization]
    return command + list(extra_args)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def add_launch_arguments(parser: Any) -> None:
    """`--launch` and the launched server's options, as the checkout's tools/fuzz.py and tools/soak.py take them."""
    parser.add_argument("--launch", action="store_true", help="start Conveyor's server for the run")
    parser.add_argument("--launch-model", default=None, help="its model (default: the built-in one)")
    parser.add_argument("--launch-args", default="", metavar="ARGS", help="more `conveyor serve` options")
    parser.add_argument("--launch-timeout", type=float, default=600.0)
    parser.add_argument("--dtype", default="auto", help="the launched server's dtype")
    parser.add_argument("--quantization", default=None, help="the launched server's weight format")


def launch_options(args: Any) -> dict[str, Any] | None:
    """`launched_server` arguments from `bench serve`'s options (None without --launch); the precision
    options apply only there. Argument errors exit before anything starts."""
    ours = {"--launch-model": args.launch_model, "--quantization": args.quantization,
            "--dtype": None if args.dtype == "auto" else args.dtype, "--launch-args": args.launch_args or None,
            "--speculative-config": getattr(args, "speculative_config", None)}  # bench serve's only
    if not args.launch:
        given = [name for name, value in ours.items() if value is not None]
        if given:
            raise SystemExit(f"error: {', '.join(given)} apply only with --launch (an external server runs in the "
                             "mode it was started with)")
        if args.base_url is None:
            raise SystemExit("error: give --base-url of a running server, or --launch to start Conveyor's")
        return None
    if args.base_url is not None:
        raise SystemExit("error: give --base-url or --launch, not both")
    extra = shlex.split(args.launch_args)
    if ours["--speculative-config"]:
        extra += ["--speculative-config", ours["--speculative-config"]]
    taken = [a for a in extra if a.split("=", 1)[0] in ("--host", "--port")]
    if taken:
        raise SystemExit(f"error: --launch-args: the benchmark chooses the server's address; drop {taken}")
    return {"model": args.launch_model, "dtype": args.dtype, "quantization": args.quantization,
            "extra_args": extra, "timeout_s": args.launch_timeout}


@contextlib.contextmanager
def launched_server(*, model: str | None, dtype: str = "auto", quantization: str | None = None,
                    extra_args: Sequence[str] = (), timeout_s: float = 600.0,
                    log: Callable[[str], None] = lambda _msg: None) -> Iterator[dict[str, Any]]:
    """Run Conveyor's server while the block runs; yields its info (`base_url`, `model_path`, `dtype`,
    `quantization`, `cpu_flags`, `command`). RuntimeError if it exits or is not healthy within `timeout_s`."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="conveyor-launch-") as tmp:
        info_path = Path(tmp, "info.json")
        command = launch_command(info_path, port, model=model, dtype=dtype, quantization=quantization,
                                 extra_args=extra_args)
        url = f"http://127.0.0.1:{port}"
        log(f"Launching Conveyor's server: {' '.join(command[1:])}")
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=2)
        try:
            deadline = time.monotonic() + timeout_s
            while not (info_path.exists() and _healthy(url)):
                if proc.poll() is not None:
                    raise RuntimeError(f"the launched server exited with status {proc.returncode} before it was "
                                       "ready; its log is above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the launched server was not healthy after {timeout_s:g} s")
                time.sleep(POLL_S)
            info = json.loads(info_path.read_text())
            yield {"base_url": url, **info, "command": command}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """`conveyor serve` that first writes what it resolved to `--info` (the launched side)."""
    from ..cli_args import add_serve_args, llm_kwargs_from_args
    from ..kernels import vector_flags
    from ..llm import LLM
    from ..server import ServerSettings, run_server
    from .modes import resolved_mode

    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.launch")
    parser.add_argument("--info", required=True, help="write the resolved dtype, quantization and CPU flags here")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(**llm_kwargs_from_args(args))
    partial = Path(f"{args.info}.partial")
    partial.write_text(json.dumps({"model_path": str(llm.model_path), **resolved_mode(llm),
                                   "cpu_flags": vector_flags(), "pid": os.getpid()}))
    partial.replace(args.info)
    settings = ServerSettings.from_args(args)
    run_server(llm, settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
