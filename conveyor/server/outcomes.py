"""How an engine request that ended badly is answered: the API error of each finish reason that is not an
answer ("error", "abort", "timeout"); "stop" and "length" are answers."""

from __future__ import annotations

from ..request import RequestOutput
from .protocol import APIError


def failure(out: RequestOutput) -> APIError | None:
    """The error a request that ended badly answers with (None for "stop"/"length"). A request past its
    `request_timeout` is a 504 naming the timeout, as a gateway's answer when what it waits for is late."""
    if out.finish_reason == "error":
        return APIError(500, f"the request failed in the engine: {out.error}", type="server_error",
                        code="engine_error")
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (server shutting down)", type="service_unavailable_error",
                        code="request_aborted")
    if out.finish_reason == "timeout":
        return APIError(504, f"{out.error}; raise request_timeout (or the server's --request-timeout) to wait "
                        "longer", type="server_error", code="request_timeout")
    return None
