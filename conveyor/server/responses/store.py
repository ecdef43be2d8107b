"""The server's memory of responses (`store: true`), for `GET`, `DELETE`, `.../cancel` and
`previous_response_id`: in this process only, bounded by `--max-stored-responses`.

Past the bound the least recently used finished response goes; one still running stays until it
ends (so the store can exceed the bound by the responses in flight, at most `--max-queue`), as it
must stay cancellable. Each entry keeps the response object and the conversation behind it (shared
turns: a chain of N responses holds N lists of references, not N copies of the text).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocol import ChatMessage

DEFAULT_CAPACITY = 1024


@dataclass
class StoredResponse:
    """response: the response object, as GET answers it (updated while it runs). history: the turns a
    next response continues from: the conversation before it and its output, instructions aside (as
    OpenAI, they are not carried over). cancel: set while it runs."""

    response: dict[str, Any]
    history: list[ChatMessage] = field(default_factory=list)
    cancel: Callable[[], None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return not self.done.is_set()


class ResponseStore:
    """Stored responses by id, in order of use; `capacity` 0 keeps none."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity < 1:
            return
        self.entries[response_id] = entry
        excess = len(self.entries) - self.capacity
        if excess > 0:
            for old in [k for k, e in self.entries.items() if not e.running][:excess]:
                del self.entries[old]

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        return self.entries.pop(response_id, None)
