"""Hub ids downloaded through huggingface_hub from a fake Hub on loopback (its model-info, tree and
resolve endpoints, answering as huggingface.co does): only the files the loader reads are fetched, the
token goes along, a progress bar is shown, the cache then serves offline; and the Hub's refusals become
errors that say what to do. Never the network."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub
import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.models.hub import HubError, resolve_model_path

from tests.utils import TinyModel

COMMIT = "c" * 40


@dataclass
class FakeHub:
    """Repos by id ({file name: content}); what was asked for: (method, path, Authorization header)."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def tokens(self) -> set[str | None]:
        """The Authorization headers of the requests for repos (huggingface_hub asks other things too)."""
        return {auth for _, path, auth in self.requests if path.startswith(("/api/models/", "/org/"))}

    def downloaded(self, repo_id: str) -> set[str]:
        prefix = f"/{repo_id}/resolve/{COMMIT}/"
        return {unquote(p[len(prefix):]) for m, p, _ in self.requests if m == "GET" and p.startswith(prefix)}


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's, as the Hub's oid and ETag


def handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            api = parts[0] == "api" and len(parts) >= 6 and parts[1] == "models"
            repo_id = "/".join(parts[2:4] if api else parts[0:2])
            if repo_id not in hub.repos:  # the Hub's answer for a repo it does not have (or hides)
                self.answer(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            elif api and parts[4] == "revision":
                siblings = [{"rfilename": name} for name in hub.repos[repo_id]]
                self.answer(200, json.dumps({"id": repo_id, "sha": COMMIT, "siblings": siblings}).encode())
            elif api and parts[4] == "tree":
                tree = [{"type": "file", "path": name, "size": len(data), "oid": blob_id(data)}
                        for name, data in hub.repos[repo_id].items()]
                self.answer(200, json.dumps(tree).encode())
            elif len(parts) >= 5 and parts[2] == "resolve":
                data = hub.repos[repo_id][unquote("/".join(parts[4:]))]
                self.answer(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{blob_id(data)}"'})
            else:
                self.answer(404, b"{}")

        do_HEAD = do_GET

    return Handler


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake Hub on a free loopback port, where huggingface_hub looks for huggingface.co (HF_ENDPOINT,
    read at import: its constants), online."""
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", "/nonexistent/token")  # no saved login
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_safetensors_repo_downloads_only_what_the_loader_reads(
        hub: FakeHub, tiny_llama: TinyModel, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.path.iterdir() if p.is_file()}
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
    hub.repos["org/tiny"] = files | {"model.safetensors.index.json": json.dumps(index).encode(),
                                     "consolidated.safetensors": b"other names", "pytorch_model.bin": b"pickle",
                                     "README.md": b"# tiny"}
    config = ContinuousBatchingConfig(num_blocks=64)
    llm = LLM("org/tiny", download_dir=tmp_path, hf_token="hf_given", dtype="float32", config=config)
    assert hub.downloaded("org/tiny") == set(files) | {"model.safetensors.index.json"}  # no decoys, no README
    assert hub.tokens() == {"Bearer hf_given"}
    progress = capfd.readouterr().err  # huggingface_hub's bars (of bytes too, on a terminal)
    assert "Fetching 5 files: 100%" in progress and "Fetching 1 files: 100%" in progress
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    local = LLM(tiny_llama.path, dtype="float32", config=config)
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], params, use_tqdm=False)] == \
        [o.token_ids for o in local.generate([[5, 6, 7]], params, use_tqdm=False)]

    hub.requests.clear()  # from the cache, online again: no file fetched twice; HF_TOKEN is the token
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    again = resolve_model_path("org/tiny", download_dir=tmp_path)
    assert again.path == llm.model_path and hub.downloaded("org/tiny") == set()
    assert hub.tokens() == {"Bearer hf_from_env"}
    hub.requests.clear()  # and offline: no request at all
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("org/tiny", download_dir=tmp_path).path == llm.model_path and hub.requests == []


def test_a_gguf_repo_downloads_the_one_file_chosen(hub: FakeHub, tmp_path: Path) -> None:
    names = ["m.Q4_K_M.gguf", "m.Q8_0.gguf", "mmproj-m-f16.gguf"]
    hub.repos["org/m-GGUF"] = {name: name.encode() for name in names} | {"config.json": b"{}"}
    location = resolve_model_path("org/m-GGUF:q8_0", download_dir=tmp_path)
    assert location.path.name == "m.Q8_0.gguf" and location.path.read_bytes() == b"m.Q8_0.gguf"
    assert hub.downloaded("org/m-GGUF") == {"config.json", "m.Q8_0.gguf"}
    path = resolve_model_path("org/m-GGUF", gguf_file="m.Q4_K_M.gguf", download_dir=tmp_path).path
    assert path.read_bytes() == b"m.Q4_K_M.gguf" and "mmproj-m-f16.gguf" not in hub.downloaded("org/m-GGUF")


def test_what_the_hub_refuses_says_what_to_do(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HubError, match="org/nope: no such local path, and no such model on the Hugging Face Hub "
                                       r"\(a private repo needs HF_TOKEN or --hf-token\)"):
        resolve_model_path("org/nope", download_dir=tmp_path)
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", closed)
    with pytest.raises(HubError, match=rf"cannot download org/nope: the Hugging Face Hub did not answer \(.+\) and "
                                       rf"it is not in the cache {tmp_path}: check the network .*hf download org/nope"):
        resolve_model_path("org/nope", download_dir=tmp_path)


def test_offline_a_file_never_downloaded_is_named(hub: FakeHub, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One quant downloaded online, another asked for offline: the cached snapshot is incomplete."""
    hub.repos["org/m-GGUF"] = {"m.Q4_K_M.gguf": b"4", "m.Q8_0.gguf": b"8", "config.json": b"{}"}
    resolve_model_path("org/m-GGUF:Q8_0", download_dir=tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("org/m-GGUF:Q8_0", download_dir=tmp_path).path.read_bytes() == b"8"
    with pytest.raises(HubError, match=r"^org/m-GGUF: .*missing \(m.Q4_K_M.gguf\)"):
        resolve_model_path("org/m-GGUF:Q4_K_M", download_dir=tmp_path)
