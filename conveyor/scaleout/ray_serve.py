"""Conveyor as a Ray Serve application, for users who run a Ray cluster (`pip install "conveyor[ray]"`).

    from ray import serve
    from conveyor.scaleout.ray_serve import conveyor_app

    serve.run(conveyor_app("path/to/model", num_replicas=2), route_prefix="/")
    # POST http://127.0.0.1:8000/v1/completions {"prompt": "...", "max_tokens": 32}

Two deployments, as Ray Serve's own LLM apps are built: `ConveyorIngress` takes the HTTP requests (a
FastAPI app, OpenAI's completion shape) and calls `ConveyorReplica` through a deployment handle with a
`CompletionCall`, whose `prompt` field is what Ray Serve's prefix-aware request router
(`PrefixCacheAffinityRouter`, on by default here) matches against the prompts each replica has seen, so
requests that share a prefix land where it is cached. Each replica is one engine (its own KV and prefix
cache) with `threads` CPUs reserved from Ray (`num_cpus`), or a GPU with `num_gpus=1`. Ray places and
restarts the replicas (its health checks, its retries); Ray itself is not a dependency of Conveyor.
Every answer names the replica that served it and that replica's prefix-cache counters, so what the
routing achieved can be read from the answers.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from ..config import ContinuousBatchingConfig
from ..errors import require
from ..llm import LLM
from ..request import RequestOutput
from ..sampling_params import SamplingParams

PREFIX_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
# The same class where it is defined: its public name above imports Ray's vLLM integration (ray[llm],
# which needs vLLM), the class itself only ray[serve].
PREFIX_ROUTER_DEFINED = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


def prefix_router() -> str:
    """The import path of Ray Serve's prefix-aware request router that imports here."""
    try:
        import ray.serve.llm.request_router  # noqa: F401
    except ImportError:
        return PREFIX_ROUTER_DEFINED
    return PREFIX_ROUTER


@dataclass
class CompletionCall:
    """One completion, as the ingress hands it to a replica (the router reads `prompt`)."""

    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


class ConveyorReplica:
    """One engine: requests submitted to its batching loop, answered as they finish."""

    def __init__(self, model: str | None = None, dtype: str = "auto", quantization: str | None = None,
                 config: dict[str, Any] | None = None, threads: int | None = None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.llm = LLM(model, dtype=dtype, quantization=quantization,
                       config=ContinuousBatchingConfig(**(config or {})))
        self.llm.manager.start()

    async def __call__(self, call: CompletionCall) -> dict[str, Any]:
        params = SamplingParams(max_new_tokens=call.max_tokens, temperature=call.temperature, top_p=call.top_p,
                                seed=call.seed, stop=call.stop, ignore_eos=call.ignore_eos)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()

        def on_output(out: RequestOutput) -> None:  # on the engine thread
            if out.finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        request = self.llm.make_request(self.llm.manager.new_request_id(), call.prompt, params)
        self.llm.manager.submit(request, on_output=on_output)
        try:
            out = await done
        finally:
            self.llm.manager.cancel_request(request.request_id)  # the caller gave up: free its blocks
        stats = self.llm.stats()
        return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                "error": out.error, "prompt_tokens": out.num_prompt_tokens, "replica": os.getpid(),
                "prefix_cache_query_tokens": stats.prefix_cache_query_tokens,
                "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        if not self.llm.manager.is_running():
            raise RuntimeError(f"the engine loop is not running: {self.llm.manager.dead_error}")


def conveyor_app(model: str | None = None, *, num_replicas: int = 2, threads: int = 1, num_gpus: float = 0,
                 prefix_aware: bool = True, dtype: str = "auto", quantization: str | None = None,
                 config: dict[str, Any] | None = None) -> Any:
    """The Ray Serve application: `num_replicas` engines behind an OpenAI-style ingress, routed by
    prefix (or by Ray's default power-of-two choices with `prefix_aware=False`)."""
    from fastapi import FastAPI

    serve = require("ray.serve", "ray", "conveyor_app (Conveyor on Ray Serve)")
    api = FastAPI(title="Conveyor on Ray Serve")

    @serve.deployment(ray_actor_options={"num_cpus": 0})  # it only forwards: the CPUs are the engines'
    @serve.ingress(api)
    class ConveyorIngress:
        def __init__(self, replica: Any) -> None:
            self.replica = replica

        # Builtin annotations only: Ray ships this class to the replica by value, without the names its
        # string annotations would need.
        @api.post("/v1/completions")
        async def completions(self, body: dict) -> dict:
            call = CompletionCall(**{k: body[k] for k in CompletionCall.__dataclass_fields__ if k in body})
            result = await self.replica.remote(call)
            return {"object": "text_completion", "model": body.get("model"), "conveyor": result,
                    "choices": [{"index": 0, "text": result["text"], "finish_reason": result["finish_reason"]}],
                    "usage": {"prompt_tokens": result["prompt_tokens"],
                              "completion_tokens": len(result["token_ids"])}}

    router = {"request_router_config": {"request_router_class": prefix_router()}} if prefix_aware else {}
    replica = serve.deployment(ConveyorReplica, num_replicas=num_replicas,
                               ray_actor_options={"num_cpus": threads, "num_gpus": num_gpus}, **router)
    return ConveyorIngress.bind(replica.bind(model, dtype, quantization, config, threads))
