"""Cross-origin requests for browser front ends: vLLM's `--allowed-origins`, `--allowed-methods`,
`--allowed-headers` (JSON lists) and `--allow-credentials`, answered by Starlette's `CORSMiddleware`.

Off unless `--allowed-origins` is given: vLLM allows every origin by default, but a server that
answers any web page's scripts is something to ask for (`'["*"]'` asks for it). The middleware is the
outermost layer, so a preflight `OPTIONS` is answered before the API key is checked (browsers send
no credentials on a preflight) and error answers carry the CORS headers too."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CORSSettings:
    """The origins, methods and headers a browser may use (`"*"`: any), and whether it may send
    cookies and authorization headers (`allow_credentials`)."""

    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    @classmethod
    def from_args(cls, args: Any) -> CORSSettings | None:
        """The CORS options of `conveyor serve` (`cli_args.add_operations_args`); None when off. The
        other flags without `--allowed-origins` are an error rather than silently nothing."""
        if args.allowed_origins is None:
            given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                              ("--allowed-headers", args.allowed_headers),
                                              ("--allow-credentials", args.allow_credentials or None))
                     if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} take effect only with --allowed-origins (CORS is off without "
                                 "it), e.g. --allowed-origins '[\"http://localhost:3000\"]'")
            return None
        return cls(json_list("--allowed-origins", args.allowed_origins),
                   json_list("--allowed-methods", args.allowed_methods or '["*"]'),
                   json_list("--allowed-headers", args.allowed_headers or '["*"]'), bool(args.allow_credentials))


def json_list(flag: str, text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM takes it (`'["http://a.example", "http://b.example"]'`);
    a single value that is not JSON (`http://a.example`) is a list of one."""
    text = text.strip()
    try:
        value = json.loads(text)
    except ValueError:
        if text.startswith("["):
            raise ValueError(f"{flag} is not a valid JSON list: {text!r}") from None
        value = [text]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{flag} must be a JSON list of non-empty strings, e.g. '[\"http://localhost:3000\"]'; "
                         f"got {text!r}")
    return value


def add_cors(app: FastAPI, cors: CORSSettings | None) -> None:
    """Answer cross-origin requests as `cors` says (nothing when None). Call it after the other
    middleware: the last added is the outermost."""
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
