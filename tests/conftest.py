"""Fixtures every folder shares: the tiny random models saved as directories (built once a session), one
intra-op thread, the word-level tokenizer for toy GGUF files, the openai client; and the `cuda` marker's
skip. The models and helpers themselves are in tests/utils.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

# Without CUDA, Triton kernels run under its interpreter, which must be on before anything imports
# triton (llguidance's torch helpers do, through conveyor.structured), so for the whole session.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if TYPE_CHECKING:
    import openai

from tests.utils import MOE_CONFIGS, TINY_CONFIGS, TinyModel, tiny_tokenizer  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are skipped where no CUDA device is visible (they are not CPU coverage)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {kind: TinyModel(kind, tmp_path_factory.mktemp(kind)) for kind in TINY_CONFIGS}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {kind: TinyModel(kind, tmp_path_factory.mktemp(kind), make()) for kind, make in MOE_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Engines stepped on the test's thread (and Triton's interpreter) are much faster with one intra-op
    thread on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def gguf_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The word-level test tokenizer in place of converting a toy GGUF vocabulary, which is no real
    tokenizer (conversion has tests of its own)."""
    monkeypatch.setattr("conveyor.models.loader._gguf_tokenizer", lambda path: tiny_tokenizer())


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    """The official openai client against the server of the module's own `url` fixture (imported here:
    the GPU check's image has no openai, and its CUDA tests need none)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
