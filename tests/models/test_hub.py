"""Hub ids through huggingface_hub, from a Hugging Face cache built here in the real layout
(models--org--name/blobs, snapshots/<commit>/ links, refs/<branch>) with HF_HUB_OFFLINE on: safetensors
and GGUF repos, `repo:QUANT` and `--gguf-file`, revisions, and the errors that list what is there."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub
import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.cli import main
from conveyor.models.hub import HubError, resolve_model_path
from conveyor.models.loader import load_checkpoint

from tests.gguf_writer import write_tiny_gguf
from tests.utils import TinyModel

COMMIT, OTHER = "a" * 40, "b" * 40


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT, ref: str = "main") -> Path:
    """`files` in `cache` as huggingface_hub stores a download: content-addressed blobs, the snapshot's
    relative links to them, and the branch's ref; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here may reach the Hub: huggingface_hub reads HF_HUB_OFFLINE at import, so set its constant."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def model_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def test_a_safetensors_repo_loads_from_the_cache(tiny_llama: TinyModel, tmp_path: Path) -> None:
    snapshot = cache_repo(tmp_path, "org/tiny", model_files(tiny_llama.path))
    location = resolve_model_path("org/tiny", download_dir=tmp_path)
    assert location.path == snapshot and location.hub_id == "org/tiny"
    config = ContinuousBatchingConfig(num_blocks=64)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    hub = LLM("org/tiny", download_dir=tmp_path, dtype="float32", config=config)
    local = LLM(tiny_llama.path, dtype="float32", config=config)
    assert hub.model_name == "org/tiny" and local.model_name == tiny_llama.path.name  # the server's default name
    assert [o.token_ids for o in hub.generate([[5, 6, 7]], params, use_tqdm=False)] == \
        [o.token_ids for o in local.generate([[5, 6, 7]], params, use_tqdm=False)]


def test_a_revision_picks_its_snapshot(tmp_path: Path) -> None:
    cache_repo(tmp_path, "org/tiny", {"config.json": b"{}", "model.safetensors": b"main"})
    other = cache_repo(tmp_path, "org/tiny", {"config.json": b"{}", "model.safetensors": b"v1"}, OTHER, "v1")
    assert resolve_model_path("org/tiny", revision="v1", download_dir=tmp_path).path == other
    assert resolve_model_path("org/tiny", revision=OTHER, download_dir=tmp_path).path == other
    with pytest.raises(HubError, match="org/tiny \\(revision v2\\) is not in the Hugging Face cache"):
        resolve_model_path("org/tiny", revision="v2", download_dir=tmp_path)


GGUFS = ["tiny.Q4_1.gguf", "tiny.Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "mmproj-tiny-Q8_0.gguf"]


def gguf_repo(cache: Path) -> Path:
    return cache_repo(cache, "org/tiny-GGUF", {name: name.encode() for name in GGUFS} | {"README.md": b"#"})


@pytest.mark.parametrize(("quant", "chosen"), [("Q4_1", "tiny.Q4_1.gguf"), ("q8_0", "tiny.Q8_0.gguf"),
                                                ("Q4_K_M", "tiny-Q4_K_M.gguf")])
def test_repo_colon_quant_picks_the_gguf_file(tmp_path: Path, quant: str, chosen: str) -> None:
    snapshot = gguf_repo(tmp_path)
    location = resolve_model_path(f"org/tiny-GGUF:{quant}", download_dir=tmp_path)
    assert location.path == snapshot / chosen and location.hub_id == f"org/tiny-GGUF:{quant}"
    assert resolve_model_path("org/tiny-GGUF", gguf_file=chosen, download_dir=tmp_path).path == snapshot / chosen


@pytest.mark.parametrize(("model", "gguf_file", "message"), [
    ("org/tiny-GGUF:Q4_K", None, "org/tiny-GGUF has no GGUF file of quant type Q4_K; its GGUF files: "
                                 "tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny.Q4_1.gguf, tiny.Q8_0.gguf"),
    ("org/tiny-GGUF:Q5_0", None, "no GGUF file of quant type Q5_0; its GGUF files: tiny-Q4_K_M.gguf"),
    ("org/tiny-GGUF", None, "org/tiny-GGUF holds several GGUF files: choose one as org/tiny-GGUF:QUANT or with "
                            "--gguf-file NAME; its GGUF files: tiny-Q4_K_M.gguf"),
    ("org/tiny-GGUF", "tiny.Q2_K.gguf", "org/tiny-GGUF has no file 'tiny.Q2_K.gguf'; its GGUF files: "),
    ("org/tiny-GGUF:Q4_1", "tiny.Q4_1.gguf", "either as org/tiny-GGUF:Q4_1 or as gguf_file='tiny.Q4_1.gguf'"),
])
def test_a_missing_or_ambiguous_quant_lists_the_files(tmp_path: Path, model: str, gguf_file: str | None,
                                                      message: str) -> None:
    gguf_repo(tmp_path)
    with pytest.raises(ValueError) as error:
        resolve_model_path(model, gguf_file=gguf_file, download_dir=tmp_path)
    assert message in str(error.value)


def test_several_files_of_one_quant_are_ambiguous(tmp_path: Path) -> None:
    cache_repo(tmp_path, "org/x", {"a-Q4_1.gguf": b"a", "b-Q4_1.gguf": b"b"})
    with pytest.raises(HubError, match=r"several GGUF files match quant type Q4_1 \(a-Q4_1.gguf, b-Q4_1.gguf\)"):
        resolve_model_path("org/x:Q4_1", download_dir=tmp_path)
    cache_repo(tmp_path, "org/split", {"m-Q8_0-00001-of-00002.gguf": b"1", "m-Q8_0-00002-of-00002.gguf": b"2"})
    with pytest.raises(HubError, match="split into 2 files .*`llama-gguf-split --merge`"):
        resolve_model_path("org/split:Q8_0", download_dir=tmp_path)


def test_a_gguf_from_the_cache_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "w.gguf", "llama")
    cache = tmp_path / "cache"
    cache_repo(cache, "org/only-GGUF", {"model-F32.gguf": (tmp_path / "w.gguf").read_bytes()})
    location = resolve_model_path("org/only-GGUF", download_dir=cache)  # its one GGUF file, no quant needed
    assert location.path.name == "model-F32.gguf" and location.path.is_symlink()
    monkeypatch.setattr("conveyor.models.loader._gguf_tokenizer", lambda path: "tokenizer")  # a toy vocabulary
    checkpoint = load_checkpoint(location.path)
    assert checkpoint.config.num_hidden_layers == 2 and "lm_head.weight" in checkpoint.state_dict


def test_offline_and_not_cached_names_the_id_the_cache_and_hf_hub_offline(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    message = (f"org/missing is not in the Hugging Face cache {tmp_path} and HF_HUB_OFFLINE=1 forbids downloading "
               "it: unset HF_HUB_OFFLINE to download it, or point --download-dir (HF_HUB_CACHE) at a cache that has it")
    with pytest.raises(HubError) as error:
        resolve_model_path("org/missing", download_dir=tmp_path)
    assert str(error.value) == message
    assert main(["serve", "org/missing", "--download-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_local_paths_are_not_hub_ids(tmp_path: Path) -> None:
    assert resolve_model_path(tmp_path).path == tmp_path
    assert resolve_model_path(tmp_path, gguf_file="m.gguf").path == tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="revision applies to Hub ids, not to the local path"):
        resolve_model_path(tmp_path, revision="main")
    with pytest.raises(FileNotFoundError, match="Model path does not exist: nope.gguf"):
        resolve_model_path("nope.gguf")
