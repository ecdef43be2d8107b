"""Model references to local paths: a directory or .gguf file as it is, or a Hugging Face Hub id
(`org/name`, `org/name:QUANT` for a GGUF repo's file of that quant type, as llama.cpp's `-hf` and
vLLM take) fetched through `huggingface_hub` into its cache (or `download_dir`), with its progress
bars, `HF_TOKEN`, `HF_HUB_OFFLINE` and `revision`.

A Hub repo is fetched in two steps: its small files first (config, tokenizer, safetensors index),
then only the weights the loader reads: the shards the index names (else every top-level
`*.safetensors`), or the one GGUF file chosen, never a repo's other formats or quants.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (CachedRepoTreeNotFoundError, GatedRepoError, IncompleteSnapshotError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

# `org/name` or `org/name:QUANT`: Hub ids have exactly one slash (a bare `name` is taken as a local path).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.+-]+))?")
# What a model needs besides its weights: config, generation config, tokenizer, chat template, index.
METADATA_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubError(ValueError):
    """A Hub id that cannot be resolved (not found, offline and not cached, ambiguous quant)."""


@dataclass(frozen=True)
class ModelLocation:
    """Where a model's files are: `path` (None: the built-in model), and the Hub id as given when they
    came from the Hub (the server's default model name then, as vLLM's)."""

    path: Path | None
    hub_id: str | None = None


def resolve_model_path(model: str | os.PathLike[str] | None, *, revision: str | None = None,
                       download_dir: str | os.PathLike[str] | None = None, gguf_file: str | None = None,
                       token: str | bool | None = None) -> ModelLocation:
    """Where `model` is: None stays None (the built-in model); an existing path is used as it is (with
    `gguf_file`, that file in the directory); an `org/name[:QUANT]` id is fetched from the Hub."""
    if model is None:
        if gguf_file or revision:
            raise ValueError("gguf_file and revision need a model (a Hub id, or a directory for gguf_file)")
        return ModelLocation(None)
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision applies to Hub ids, not to the local path {path}")
        if gguf_file is None:
            return ModelLocation(path)
        if not path.is_dir():
            raise ValueError(f"gguf_file names a file in a directory or Hub repo; {path} is a file")
        return ModelLocation(path / gguf_file)
    match = HUB_ID.fullmatch(str(model))
    if match is None:
        raise FileNotFoundError(f"Model path does not exist: {model} (nor is it a Hugging Face Hub id, org/name)")
    return ModelLocation(HubRepo(match["repo"], revision, download_dir, token).fetch(match["quant"], gguf_file),
                         str(model))


def resolve_tokenizer_path(tokenizer: str | os.PathLike[str], *, revision: str | None = None,
                           download_dir: str | os.PathLike[str] | None = None,
                           token: str | bool | None = None) -> Path:
    """Where vLLM's `tokenizer` (a tokenizer other than the model's) is: a directory as it is, or an `org/name`
    repo's small files (tokenizer and chat template, no weights) from the Hub."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    match = HUB_ID.fullmatch(str(tokenizer))
    if path.exists() or match is None or match["quant"]:
        raise FileNotFoundError(f"tokenizer {tokenizer}: not a directory (nor a Hugging Face Hub id, org/name)")
    return HubRepo(match["repo"], revision, download_dir, token).snapshot(METADATA_PATTERNS)


class HubRepo:
    """One repo at one revision in one cache; `fetch` brings what the loader needs into the cache."""

    def __init__(self, repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None,
                 token: str | bool | None) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.cache_dir = Path(download_dir).expanduser() if download_dir is not None else Path(constants.HF_HUB_CACHE)
        self.token = token
        self.offline = constants.HF_HUB_OFFLINE
        self.commit: str | None = None  # once the small files are in: the weights come from the same commit

    def fetch(self, quant: str | None, gguf_file: str | None) -> Path:
        if quant and gguf_file:
            raise ValueError(f"give the GGUF file either as {self.repo_id}:{quant} or as gguf_file={gguf_file!r}, "
                             "not both")
        folder = self.snapshot(METADATA_PATTERNS)
        self.commit = folder.name
        files = self.files(folder)
        ggufs = sorted(f for f in files  # a vision projector (mmproj-*.gguf) is no language model
                       if f.lower().endswith(".gguf") and not PurePosixPath(f).name.startswith("mmproj"))
        if gguf_file is not None:
            if gguf_file not in files:
                raise HubError(f"{self.repo_id} has no file {gguf_file!r}; {self.gguf_list(ggufs)}")
            return self.fetch_gguf(gguf_file)
        if quant is not None:
            return self.fetch_gguf(choose_gguf(self.repo_id, ggufs, quant))
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            self.snapshot(self.safetensors_files(folder, files))
            return folder
        if len(ggufs) == 1:
            return self.fetch_gguf(ggufs[0])
        if ggufs:
            raise HubError(f"{self.repo_id} holds several GGUF files: choose one as {self.repo_id}:QUANT or with "
                           f"--gguf-file NAME; {self.gguf_list(ggufs)}")
        raise HubError(f"{self.repo_id} has neither config.json with *.safetensors weights nor a .gguf file (files: "
                       f"{', '.join(sorted(files)[:20]) or 'none'})")

    def fetch_gguf(self, name: str) -> Path:
        path = self.snapshot([name]) / name
        if not path.is_file():
            raise HubError(f"{self.repo_id}: {name} is not in the cache {self.cache_dir} and HF_HUB_OFFLINE=1 "
                           "forbids downloading it")
        return path

    @staticmethod
    def gguf_list(ggufs: list[str]) -> str:
        return f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it has no .gguf file"

    def safetensors_files(self, folder: Path, files: list[str]) -> list[str]:
        """The shards the index names (repos may hold a `consolidated.safetensors` with other names beside
        them), else every top-level *.safetensors."""
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                return sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise HubError(f"invalid safetensors index {index}: {exc}") from exc
        return [f for f in files if f.endswith(".safetensors") and "/" not in f]

    def files(self, folder: Path) -> list[str]:
        """The repo's files: the listing snapshot_download cached when it reached the Hub (so no second
        request), else those in the cached snapshot (offline, nothing else can be had)."""
        try:
            tree = huggingface_hub.get_cached_repo_tree(self.repo_id, revision=folder.name, cache_dir=self.cache_dir)
            return sorted(f.path for f in tree)
        except CachedRepoTreeNotFoundError:
            return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def snapshot(self, patterns: list[str]) -> Path:
        """The snapshot folder with the files matching `patterns` downloaded (huggingface_hub's progress
        bars); offline, the cached folder as it is."""
        try:
            return Path(huggingface_hub.snapshot_download(
                self.repo_id, revision=self.commit or self.revision, cache_dir=self.cache_dir, allow_patterns=patterns,
                token=self.token, local_files_only=self.offline))
        except GatedRepoError as exc:
            raise HubError(f"{self.repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                           f"(or --hf-token) to a token of that account ({exc})") from exc
        except RepositoryNotFoundError as exc:
            raise HubError(f"{self.repo_id}: no such local path, and no such model on the Hugging Face Hub (a "
                           "private repo needs HF_TOKEN or --hf-token)") from exc
        except RevisionNotFoundError as exc:
            raise HubError(f"{self.repo_id} has no revision {self.revision!r}") from exc
        except IncompleteSnapshotError as exc:  # some of the files asked for were never downloaded
            raise HubError(f"{self.repo_id}: {exc}") from exc
        except LocalEntryNotFoundError as exc:
            where = f"{self.repo_id}" + (f" (revision {self.revision})" if self.revision else "")
            if self.offline:
                raise HubError(f"{where} is not in the Hugging Face cache {self.cache_dir} and HF_HUB_OFFLINE=1 "
                               "forbids downloading it: unset HF_HUB_OFFLINE to download it, or point "
                               "--download-dir (HF_HUB_CACHE) at a cache that has it") from exc
            cause = exc.__cause__ or exc  # huggingface_hub's message is three lines around the connection error
            raise HubError(f"cannot download {where}: the Hugging Face Hub did not answer ({type(cause).__name__}: "
                           f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}) and it is not in the cache "
                           f"{self.cache_dir}: check the network (behind a proxy: HTTPS_PROXY), or download it "
                           f"where the Hub answers (hf download {self.repo_id}) and point --download-dir "
                           "(HF_HUB_CACHE) at that cache, or give a local model directory or .gguf file") from exc


def choose_gguf(repo_id: str, ggufs: list[str], quant: str) -> str:
    """The one GGUF file of quant type `quant` (case-insensitive, a whole name part: Q4_K does not match
    Q4_K_M, nor Q4_0 match Q4_0_4_4)."""
    part = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9_])")
    matches = [f for f in ggufs if part.search(f.lower().removesuffix(".gguf"))]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise HubError(f"{repo_id} has no GGUF file of quant type {quant}; {HubRepo.gguf_list(ggufs)}")
    if all(re.search(r"-\d{5}-of-\d{5}$", f.removesuffix(".gguf")) for f in matches):
        raise HubError(f"{repo_id}:{quant} is split into {len(matches)} files ({', '.join(matches)}); split GGUF "
                       "files are not supported: merge them with llama.cpp's `llama-gguf-split --merge`")
    raise HubError(f"{repo_id}: several GGUF files match quant type {quant} ({', '.join(matches)}); name one with "
                   "--gguf-file NAME (gguf_file=)")
