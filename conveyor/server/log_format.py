"""How the server's log lines look: text (default), or with `--log-format json` one JSON object per line
for log shippers (Loki, Elasticsearch, Cloud Logging): `time` (ISO 8601, UTC), `level`, `logger`,
`message`, plus the structured fields a line carries (a request log line's `request_id`, timings, ...;
an access log line's `client`, `method`, `path`, `status`). uvicorn's own loggers get the same format,
`--disable-uvicorn-access-log` drops its line per HTTP request, and `--disable-access-log-for-endpoints
/health,/metrics` those of the paths named (a load balancer's probes; both vLLM's flags)."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

from uvicorn.config import LOGGING_CONFIG

ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")  # uvicorn.access's arguments, in order


class JSONFormatter(logging.Formatter):
    """One JSON object per record; the record's `fields` (`logger.info(..., extra={"fields": {...}})`)
    are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry: dict[str, Any] = {"time": stamp.isoformat(timespec="milliseconds"), "level": record.levelname,
                                 "logger": record.name, "message": record.getMessage()}
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            entry |= dict(zip(ACCESS_FIELDS, record.args))
        entry |= getattr(record, "fields", {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def use_json_logs() -> None:
    """Every handler of the root logger writes JSON (`conveyor serve --log-format json`, at start, so that
    the model's loading is logged so too)."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(JSONFormatter())


def endpoint_list(text: str | None) -> tuple[str, ...]:
    """`--disable-access-log-for-endpoints`' comma-separated paths."""
    return tuple(path.strip() for path in (text or "").split(",") if path.strip())


class SkipPaths(logging.Filter):
    """Drops uvicorn's access lines of the `paths` named (their query strings aside)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) == 5 and str(args[2]).split("?", 1)[0] in self.paths)


def uvicorn_logging(log_format: str, access_log: bool, skip_paths: tuple[str, ...] = ()) -> dict[str, Any]:
    """uvicorn.Config's logging arguments: its own configuration, with JSON formatters for "json", and no
    access lines for `skip_paths`."""
    config: dict[str, Any] = json.loads(json.dumps(LOGGING_CONFIG))  # a copy: uvicorn's stays as it is
    if log_format == "json":
        config["formatters"] = {name: {"()": f"{__name__}.JSONFormatter"} for name in config["formatters"]}
    if skip_paths:
        config["filters"] = {"skip_paths": {"()": f"{__name__}.SkipPaths", "paths": tuple(skip_paths)}}
        config["handlers"]["access"]["filters"] = ["skip_paths"]
    return {"log_config": config, "access_log": access_log}
