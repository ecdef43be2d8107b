"""Host <-> device transfers that do not stall the GPU's queue.

On CUDA, `torch.tensor(list, device="cuda")` and indexing a CUDA tensor with a Python list copy
from pageable memory, and PyTorch synchronizes the stream after such a copy: every one of them
waits for all the work queued before it. The step path instead stages small host values in
pinned memory and copies them with `non_blocking=True` (PyTorch's pinned allocator keeps a staging
buffer alive until its copy has run), and reads results back with non-blocking copies on a copy
stream followed by one wait on an event, when the host needs them. On CPU both are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A 1-D (or nested) host list as a tensor on `device`, copied without a stream sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for results going to the host, so they overlap the next step's kernels."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


class HostCopy:
    """Device-to-host copies queued on the copy stream behind the work that produces them, with an event
    to wait on: the host reads them (`wait`) whenever it needs them, and nothing in between waits for
    the device (the compute stream goes on with the next step meanwhile)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.event = None
        if not any(t.device.type == "cuda" for t in tensors):
            self.copies = list(tensors)
            return
        stream = copy_stream(tensors[0].device)
        stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
        with torch.cuda.stream(stream):
            self.copies = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned destinations
            self.event = torch.cuda.Event()
            self.event.record(stream)
        for t in tensors:  # their memory must outlive the copy, whatever the compute stream frees meanwhile
            t.record_stream(stream)

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.copies
