"""Benchmark workloads: JSON workload files and synthetic random-token workloads.

Two JSON layouts are read (both may carry "name", "description" and "temperature"):

* prompts layout (e.g. chat64): ``{"max_new_tokens": int, "prompts": [str, ...]}`` -- one
  `max_new_tokens` for every prompt;
* requests layout (e.g. docs32, prefix32): ``{"requests": [{"prompt": str, "max_new_tokens": int,
  ...}, ...]}`` -- a per-request limit (a top-level "max_new_tokens" is the default for requests
  without one). Unknown per-request keys are kept in `BenchRequest.meta`.

Every text prompt is sent as a single user turn through the model's chat template
(`render_prompts`). Synthetic workloads carry random token ids instead and ignore EOS.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class WorkloadError(ValueError):
    """A workload file is missing fields or has values of the wrong type."""


@dataclass
class BenchRequest:
    """One request of a workload: a text prompt (chat-templated later) or ready token ids."""

    max_new_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    ignore_eos: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise WorkloadError("a request needs exactly one of `prompt` (text) or `prompt_token_ids`")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise WorkloadError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    description: str = ""
    temperature: float = 0.0
    source: str | None = None  # the file it was read from, or "synthetic"

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_max_new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def limit(self, n: int | None) -> Workload:
        """The first `n` requests (all of them for None)."""
        if n is None:
            return self
        if n < 1:
            raise WorkloadError(f"limit must be >= 1, got {n}")
        return replace(self, requests=self.requests[:n])

    def with_max_new_tokens(self, max_new_tokens: int | None) -> Workload:
        """Every request with exactly `max_new_tokens` (None keeps the file's values)."""
        if max_new_tokens is None:
            return self
        return replace(self, requests=[replace(r, max_new_tokens=max_new_tokens) for r in self.requests])


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read a workload JSON file in either the prompts layout or the requests layout."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc}") from exc
    return workload_from_dict(data, source=str(path), default_name=path.stem)


def workload_from_dict(data: Any, *, source: str | None = None, default_name: str = "workload") -> Workload:
    where = source or "workload"
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a JSON object at the top level")
    temperature = data.get("temperature", 0.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise WorkloadError(f"{where}: temperature must be a number >= 0, got {temperature!r}")
    default_max = data.get("max_new_tokens")
    has_prompts, has_requests = "prompts" in data, "requests" in data
    if has_prompts == has_requests:
        raise WorkloadError(f"{where}: expected exactly one of 'prompts' (list of strings) or "
                            "'requests' (list of {prompt, max_new_tokens})")
    requests: list[BenchRequest] = []
    try:
        if has_prompts:
            if default_max is None:
                raise WorkloadError(f"{where}: the 'prompts' layout needs a top-level 'max_new_tokens'")
            items = _list(data["prompts"], where, "prompts")
            for i, item in enumerate(items):
                if isinstance(item, dict):  # tolerate {"prompt": ...} entries in the prompts list too
                    requests.append(_request_from_dict(item, default_max, f"{where}: prompts[{i}]"))
                else:
                    requests.append(BenchRequest(max_new_tokens=default_max, prompt=_text(item, f"{where}: prompts[{i}]")))
        else:
            items = _list(data["requests"], where, "requests")
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise WorkloadError(f"{where}: requests[{i}] must be an object with 'prompt' and 'max_new_tokens'")
                requests.append(_request_from_dict(item, default_max, f"{where}: requests[{i}]"))
    except WorkloadError as exc:
        if str(exc).startswith(where):
            raise
        raise WorkloadError(f"{where}: {exc}") from exc
    if not requests:
        raise WorkloadError(f"{where}: the workload has no requests")
    return Workload(name=str(data.get("name") or default_name), requests=requests,
                    description=str(data.get("description", "")), temperature=float(temperature), source=source)


def _list(value: Any, where: str, key: str) -> list:
    if not isinstance(value, list):
        raise WorkloadError(f"{where}: '{key}' must be a list")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: a prompt must be a non-empty string, got {value!r:.60}")
    return value


def _request_from_dict(item: dict[str, Any], default_max: Any, where: str) -> BenchRequest:
    if "prompt" not in item:
        raise WorkloadError(f"{where}: missing 'prompt'")
    max_new = item.get("max_new_tokens", default_max)
    if max_new is None:
        raise WorkloadError(f"{where}: missing 'max_new_tokens' (and no top-level default)")
    meta = {k: v for k, v in item.items() if k not in ("prompt", "max_new_tokens")}
    try:
        return BenchRequest(max_new_tokens=max_new, prompt=_text(item["prompt"], where), meta=meta)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: {exc}") from None


def check_synthetic_sizes(input_len: int, output_len: int, num_prompts: int) -> None:
    """A synthetic workload needs positive integer sizes."""
    for name, value in (("input_len", input_len), ("output_len", output_len), ("num_prompts", num_prompts)):
        if not isinstance(value, int) or value < 1:
            raise WorkloadError(f"synthetic {name} must be an integer >= 1, got {value!r}")


def synthetic_workload(input_len: int, output_len: int, num_prompts: int, vocab_size: int, *,
                       seed: int = 0, exclude_token_ids: Iterable[int] = ()) -> Workload:
    """`num_prompts` prompts of `input_len` uniformly random token ids (special tokens excluded),
    each generating exactly `output_len` tokens (ignore_eos)."""
    check_synthetic_sizes(input_len, output_len, num_prompts)
    excluded = set(exclude_token_ids)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    rng = random.Random(seed)
    requests = [BenchRequest(max_new_tokens=output_len, prompt_token_ids=rng.choices(allowed, k=input_len),
                             ignore_eos=True)
                for _ in range(num_prompts)]
    return Workload(name=f"synthetic-in{input_len}-out{output_len}-n{num_prompts}", requests=requests,
                    description=f"{num_prompts} prompts of {input_len} random token ids (seed {seed}), "
                                f"exactly {output_len} new tokens each (EOS ignored)",
                    temperature=0.0, source="synthetic")


DEFAULT_PASSAGE = (
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers "
    "moved their animals to the high pasture, loaded what grain they could onto carts, and waited on the ridge "
    "for the rain to stop. Nobody spoke much. The old miller said he had seen a flood like this once before, "
    "when he was a boy, and that the water had gone down again within three days.")
COPY_TASKS = (
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Quote the passage below verbatim, inside quotation marks, and then say in one sentence what it is about."
    "\n\n{passage}",
    "Rewrite the passage below, replacing the word \"{old}\" with \"{new}\" everywhere and changing nothing "
    "else:\n\n{passage}",
)


def copy_workload(num_prompts: int, max_new_tokens: int, *, passage: str = DEFAULT_PASSAGE,
                  seed: int = 0) -> Workload:
    """Copy-heavy prompts (what prompt-lookup speculation is for): repeat, quote or lightly edit
    `passage`, the tasks in turn, the edit's word chosen at random (seeded)."""
    check_synthetic_sizes(1, max_new_tokens, num_prompts)
    rng = random.Random(seed)
    words = sorted({w.strip(".,") for w in passage.split() if len(w.strip(".,")) > 3})
    requests = []
    for i in range(num_prompts):
        old = rng.choice(words)
        prompt = COPY_TASKS[i % len(COPY_TASKS)].format(passage=passage, old=old, new=old.upper())
        requests.append(BenchRequest(max_new_tokens=max_new_tokens, prompt=prompt))
    return Workload(name=f"copy-n{num_prompts}-out{max_new_tokens}", requests=requests,
                    description=f"{num_prompts} copy-heavy prompts (repeat, quote, edit a {len(passage.split())}-word "
                                f"passage), up to {max_new_tokens} new tokens", source="synthetic")


def render_prompts(workload: Workload, render_chat: Callable[[list[dict[str, str]]], Sequence[int]]) -> list[list[int]]:
    """Prompt token ids of every request: text prompts as one user turn through the chat template."""
    return [list(r.prompt_token_ids) if r.prompt_token_ids is not None
            else list(render_chat([{"role": "user", "content": r.prompt}]))
            for r in workload.requests]


def chat_renderer(tokenizer: Any) -> Callable[[list[dict[str, str]]], list[int]]:
    """A `render_chat` equivalent for a bare tokenizer (same call as `LLM.render_chat`)."""
    def render(conversation: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return render
