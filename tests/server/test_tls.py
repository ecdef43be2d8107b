"""HTTPS (`--ssl-keyfile`, `--ssl-certfile`, vLLM's): the server answers over TLS with the given certificate,
and wrong or partial options fail when they are read, before any model loads."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.tls import TLSSettings
from conveyor.vllm_flags import check_vllm_flags

from tests.serving_helpers import serve_parser
from tests.utils import TinyModel


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def test_the_server_speaks_https_with_the_given_certificate(tiny_llama: TinyModel,
                                                             certificate: tuple[Path, Path]) -> None:
    key, cert = certificate
    args = serve_parser().parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    settings = ServerSettings.from_args(args)
    assert settings.tls == TLSSettings(str(key), str(cert))
    llm = tiny_llama.llm(num_blocks=64)
    try:
        with BackgroundServer(llm, settings) as url:
            assert url.startswith("https://")
            trusted = ssl.create_default_context(cafile=str(cert))
            with httpx.Client(base_url=url, verify=trusted, timeout=60) as client:
                assert client.get("/health").status_code == 200
                answer = client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True})
                assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
            with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
                httpx.get(f"{url}/health", timeout=10)
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not answered
                httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    finally:
        llm.shutdown()


def test_partial_or_wrong_options_fail_when_read(certificate: tuple[Path, Path], tmp_path: Path) -> None:
    key, cert = certificate

    def settings(*argv: str) -> ServerSettings:
        return ServerSettings.from_args(serve_parser().parse_args(list(argv)))

    assert settings().tls is None
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        settings("--ssl-certfile", str(cert))
    with pytest.raises(ValueError, match="--ssl-keyfile .*missing.pem: no such file"):
        settings("--ssl-keyfile", str(tmp_path / "missing.pem"), "--ssl-certfile", str(cert))
    with pytest.raises(ValueError, match="only with --ssl-keyfile"):
        settings("--ssl-cert-reqs", "2")
    with pytest.raises(ValueError, match="--ssl-cert-reqs must be"):
        settings("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-cert-reqs", "5")
    assert check_vllm_flags(["--ssl-keyfile", "k.pem"]) == (["--ssl-keyfile", "k.pem"], [])  # no longer refused
