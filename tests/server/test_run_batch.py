"""`conveyor run-batch` (vLLM's): an OpenAI batch file through the server's routes in-process. The outputs, in
input order, are what the routes answer (the greedy replies equal `LLM.chat` / `LLM.generate`), failed requests
carry the route's error; a file that cannot run is refused before the model loads, naming the line; lines the
queue turns away go again; input over http GET and output PUT to a URL; a pooling model's embeddings."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.cli import main
from conveyor.server.run_batch import BatchFileError, parse_batch

from tests.serving_helpers import CHAT_TEMPLATE, random_words
from tests.utils import TinyModel

MESSAGES = [[{"role": "user", "content": random_words(seed, 6)}] for seed in range(3)]


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run(tmp_path: Path, model: Path, lines: list[str], *extra: str) -> list[dict]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), str(model), "--dtype", "float32",
                 "--num-blocks", "128", *extra]) == 0
    return [json.loads(text) for text in target.read_text().splitlines()]


def test_a_batch_file_runs_through_the_routes_in_order(tmp_path: Path, tiny_llama: TinyModel) -> None:
    name = tiny_llama.path.name
    lines = [line(f"chat-{i}", "/v1/chat/completions", {"model": name, "messages": m, "max_tokens": 5,
                                                         "temperature": 0}) for i, m in enumerate(MESSAGES)]
    lines.insert(1, line("bad", "/v1/chat/completions", {"model": name, "messages": MESSAGES[0], "max_tokens": -1}))
    lines.append(line("text", "/v1/completions", {"model": name, "prompt": "w5 w6 w7", "max_tokens": 4,
                                                  "temperature": 0, "logprobs": 1}))
    lines.append(line("who", "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": MESSAGES[0]}))
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    outputs = run(tmp_path, tiny_llama.path, lines, "--chat-template", str(template))

    assert [o["custom_id"] for o in outputs] == ["chat-0", "bad", "chat-1", "chat-2", "text", "who"]
    assert len({o["id"] for o in outputs}) == 6 and all(o["id"].startswith("batch_req_") for o in outputs)
    llm = LLM(tiny_llama.path, dtype="float32", chat_template=CHAT_TEMPLATE)
    replies = llm.chat(MESSAGES, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    for out, reply in zip([outputs[0], outputs[2], outputs[3]], replies):
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert out["response"]["request_id"] == body["id"] and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == reply.text
        assert body["usage"]["completion_tokens"] == reply.num_output_tokens
    [text] = llm.generate("w5 w6 w7", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    completion = outputs[4]["response"]["body"]["choices"][0]
    assert completion["text"] == text.text and len(completion["logprobs"]["tokens"]) == 4
    for out, status, words in ((outputs[1], 400, "max_tokens"), (outputs[5], 404, "gpt-4o-mini")):
        assert out["response"]["status_code"] == status and out["error"]["code"] == str(status)
        assert words in out["error"]["message"]
        assert out["response"]["body"]["error"]["message"] == out["error"]["message"]


def test_lines_the_queue_turns_away_go_again(tmp_path: Path, tiny_llama: TinyModel) -> None:
    """--max-queue 3 with n=2 a line: a second line in flight would make 4, so it waits for the first."""
    lines = [line(f"c{i}", "/v1/completions", {"prompt": random_words(i, 4), "max_tokens": 6, "n": 2,
                                               "temperature": 1, "seed": i}) for i in range(4)]
    outputs = run(tmp_path, tiny_llama.path, lines, "--max-queue", "3")
    assert [o["custom_id"] for o in outputs] == ["c0", "c1", "c2", "c3"]
    assert all(o["error"] is None and len(o["response"]["body"]["choices"]) == 2 for o in outputs)


@pytest.mark.parametrize("text, words", [
    ("{not json", "line 1: not JSON"),
    ("[1, 2]", "line 1: a batch request is a JSON object"),
    (line("a", "/v1/completions", {}) + "\n" + line("a", "/v1/completions", {}), "line 2: custom_id 'a' is used twice"),
    (line("a", "/v1/completions", {}, method="GET"), 'line 1: method must be "POST", got \'GET\''),
    ("\n" + line("a", "/v1/audio/transcriptions", {}), "line 2: url '/v1/audio/transcriptions' is not one"),
    (line("a", "/v1/completions", {"prompt": "w5", "stream": True}), "line 1: a batch request cannot stream"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "line 1: custom_id must be a non-empty"),
    (line("a", "/v1/completions", []), "line 1: body must be a JSON object"),  # type: ignore[arg-type]
])
def test_a_file_that_cannot_run_is_refused_naming_the_line(text: str, words: str) -> None:
    with pytest.raises(BatchFileError, match=words):
        parse_batch(text)


def test_the_cli_refuses_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "/v1/completions", {}, method="GET"))
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "no/such-model"]) == 2
    assert 'line 1: method must be "POST"' in capsys.readouterr().err
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o"), "m/m"]) == 2
    assert "cannot read the batch file" in capsys.readouterr().err
    source.write_text(line("a", "/v1/completions", {}))
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "no" / "out.jsonl"), "m/m"]) == 2
    assert "cannot write the batch output" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture()
def file_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A loopback HTTP server: GET answers what `files` holds, PUT stores the body there."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = files.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def do_PUT(self) -> None:  # noqa: N802
            files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", files
    server.shutdown()


def test_urls_in_and_out_and_a_pooling_model(tmp_path: Path, tiny_llama: TinyModel,
                                              file_server: tuple[str, dict[str, bytes]]) -> None:
    """The input read over http, the output PUT (through --output-tmp-dir); embeddings of a pooling model equal
    `LLM.embed`'s."""
    url, files = file_server
    files["/in.jsonl"] = (line("e", "/v1/embeddings", {"input": ["w5 w6", "w7"]}) + "\n").encode()
    assert main(["run-batch", "-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl", "--output-tmp-dir", str(tmp_path),
                 str(tiny_llama.path), "--dtype", "float32", "--runner", "pooling", "--num-blocks", "64"]) == 0
    [out] = [json.loads(text) for text in files["/out.jsonl"].decode().splitlines()]
    assert out["custom_id"] == "e" and out["error"] is None
    vectors = [d["embedding"] for d in out["response"]["body"]["data"]]
    expected = LLM(tiny_llama.path, dtype="float32", runner="pooling").embed(["w5 w6", "w7"], use_tqdm=False)
    np.testing.assert_allclose(vectors, [e.outputs.embedding for e in expected], atol=1e-6)
    assert list(tmp_path.iterdir()) == []  # the temporary copy removed once uploaded
