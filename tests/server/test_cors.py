"""CORS (vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`): off by
default; on, a preflight from a listed origin is allowed and one from another origin refused, and the
answers to the listed origin's requests carry the header."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.cors import CORSSettings

from tests.serving_helpers import serve_parser
from tests.utils import TinyModel, all_free

FRONT = "http://app.example"
KEY = "sk-cors"


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> Iterator[LLM]:
    llm = tiny_llama.llm(num_blocks=64)
    yield llm
    llm.shutdown()


def preflight(http: httpx.Client, origin: str) -> httpx.Response:
    return http.options("/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_flags_parse_as_vllms_json_lists() -> None:
    parser = serve_parser()
    cors = CORSSettings.from_args(parser.parse_args(["--allowed-origins", f'["{FRONT}", "http://b.example"]',
                                                     "--allowed-methods", '["POST"]', "--allow-credentials"]))
    assert cors == CORSSettings([FRONT, "http://b.example"], ["POST"], ["*"], True)
    assert CORSSettings.from_args(parser.parse_args(["--allowed-origins", FRONT])).allowed_origins == [FRONT]
    assert CORSSettings.from_args(parser.parse_args([])) is None  # off by default
    with pytest.raises(ValueError, match="--allowed-methods take effect only with --allowed-origins"):
        CORSSettings.from_args(parser.parse_args(["--allowed-methods", '["GET"]']))
    with pytest.raises(ValueError, match="--allowed-origins is not a valid JSON list"):
        CORSSettings.from_args(parser.parse_args(["--allowed-origins", '["http://a",']))
    with pytest.raises(ValueError, match="--allowed-headers must be a JSON list of non-empty strings"):
        CORSSettings.from_args(parser.parse_args(["--allowed-origins", FRONT, "--allowed-headers", "[1]"]))
    assert ServerSettings.from_args(parser.parse_args(["--allowed-origins", f'["{FRONT}"]'])).cors == \
        CORSSettings([FRONT])


def test_preflight_allowed_for_a_listed_origin_refused_for_another(llm: LLM) -> None:
    settings = ServerSettings(api_key=KEY, cors=CORSSettings([FRONT], ["POST", "GET"]))
    with BackgroundServer(llm, settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        allowed = preflight(http, FRONT)  # answered before the API key is checked: browsers send none here
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == FRONT
        assert set(allowed.headers["access-control-allow-methods"].replace(" ", "").split(",")) >= {"POST", "GET"}
        refused = preflight(http, "http://elsewhere.example")
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        answer = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3},
                           headers={"Origin": FRONT, "Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == FRONT
        unauthorized = http.post("/v1/completions", json={"prompt": "w5"}, headers={"Origin": FRONT})
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == FRONT
    assert all_free(llm)


def test_cors_is_off_by_default(llm: LLM) -> None:
    with BackgroundServer(llm) as url, httpx.Client(base_url=url, timeout=60) as http:
        answer = preflight(http, FRONT)
        assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
        plain = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2}, headers={"Origin": FRONT})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    assert all_free(llm)
