"""HTTPS: vLLM's `--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs` and `--ssl-cert-reqs`, handed to
uvicorn, which terminates TLS itself. Off unless a key and a certificate are given; the files are checked
when the options are read, so a wrong path fails before the model loads. With replicas
(`--data-parallel-size`) only the front speaks TLS: the replicas behind it listen on loopback."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TLSSettings:
    """The server's private key and certificate (PEM files); `ca_certs` and `cert_reqs`
    (`ssl.CERT_NONE`, `CERT_OPTIONAL`, `CERT_REQUIRED`: 0, 1, 2) to ask clients for certificates."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE

    @classmethod
    def from_args(cls, args: Any) -> TLSSettings | None:
        """The TLS options of `conveyor serve` (`cli_args.add_serve_args`); None when off."""
        key, cert, ca, reqs = args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs
        if key is None and cert is None:
            if ca is not None or reqs != ssl.CERT_NONE:
                raise ValueError("--ssl-ca-certs and --ssl-cert-reqs take effect only with --ssl-keyfile and "
                                 "--ssl-certfile (HTTPS is off without them)")
            return None
        if key is None or cert is None:
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {reqs}")
        return cls(key, cert, ca, reqs)

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}


def uvicorn_tls(tls: TLSSettings | None) -> dict[str, Any]:
    """uvicorn.Config's TLS keywords (none when off)."""
    return {} if tls is None else tls.uvicorn_options()


def scheme(tls: TLSSettings | None) -> str:
    return "http" if tls is None else "https"
