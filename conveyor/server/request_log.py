"""The request log (`--enable-log-requests`, vLLM's flag): one line per engine request when it ends, on
the event loop: its id, prompt length, the sampling parameters it set, its outcome (finish reason,
tokens out, error) and its timings (queue, time to first token, end to end). The prompt itself is
logged only with `--log-prompts`, the output text only with `--enable-log-outputs` (vLLM's), each cut
to `--max-log-len` characters or token ids (vLLM's). The line is text, or with `--log-format json` a
JSON object whose fields are these values (`log_format`)."""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import Any

from ..request import Request, RequestOutput
from ..sampling_params import SamplingParams

logger = logging.getLogger("conveyor.server.requests")
DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}  # MISSING for lists and dicts (empty by default)


def set_params(params: SamplingParams) -> dict[str, Any]:
    """The parameters `params` sets away from their defaults, short: a constraint by its kind, a logit
    bias by its number of entries."""
    values: dict[str, Any] = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if value == DEFAULTS.get(f.name) or value in ([], {}, None):
            continue
        if f.name == "structured_outputs":
            value = value.kind
        elif f.name == "logit_bias":
            value = len(value)
        values[f.name] = value
    return values


def seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class RequestLog:
    """Logs each finished request; `log_prompts` adds its prompt (text, else token ids decoded by
    `decode`), `log_outputs` its output text, each at most `max_log_len` characters or ids (None: all)."""

    def __init__(self, log_prompts: bool = False, max_log_len: int | None = None, decode: Any = None,
                 log_outputs: bool = False) -> None:
        self.log_prompts, self.max_log_len, self.decode = log_prompts, max_log_len, decode
        self.log_outputs = log_outputs

    def fields(self, request: Request, out: RequestOutput) -> dict[str, Any]:
        m = out.metrics
        values: dict[str, Any] = {
            "request_id": out.request_id, "prompt_tokens": out.num_prompt_tokens,
            "params": set_params(request.params), "finish_reason": out.finish_reason,
            "output_tokens": out.num_output_tokens,
            "queue_time_s": seconds(m.queue_time) if m else None,
            "ttft_s": seconds(m.time_to_first_token) if m else None,
            "e2e_s": seconds(m.finished_time - m.arrival_time) if m and m.finished_time else None}
        if out.error:
            values["error"] = out.error
        if self.log_prompts:
            values["prompt"] = self.prompt(out)
        if self.log_outputs:
            values["output"] = out.text[:self.max_log_len]
        return values

    def prompt(self, out: RequestOutput) -> str:
        limit = self.max_log_len
        if out.prompt is not None:
            return out.prompt[:limit]
        ids = out.prompt_token_ids[:limit]
        return self.decode(ids) if self.decode is not None else " ".join(map(str, ids))

    def submitted(self, requests: list[Request]) -> None:
        pass

    def close(self) -> None:
        pass

    def finished(self, request: Request, out: RequestOutput) -> None:
        values = self.fields(request, out)
        text = (f"request {values['request_id']} ended: {values['finish_reason']}, {values['output_tokens']} tokens "
                f"out; prompt {values['prompt_tokens']} tokens; params {json.dumps(values['params'])}; queue "
                f"{values['queue_time_s']} s, ttft {values['ttft_s']} s, e2e {values['e2e_s']} s")
        if "error" in values:
            text += f"; error: {values['error']}"
        if "prompt" in values:
            text += f"; prompt: {values['prompt']!r}"
        if "output" in values:
            text += f"; output: {values['output']!r}"
        logger.info("%s", text, extra={"fields": {"event": "request"} | values})
