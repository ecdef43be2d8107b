"""Host <-> device transfers that do not stall the GPU's queue.

On CUDA, `torch.tensor(list, device="cuda")` and indexing a CUDA tensor with a Python list copy
from pageable memory, and PyTorch synchronizes the stream after such a copy: every one of them
waits for all the work queued before it. The step path instead stages small host values in
pinned memory and copies them with `non_blocking=True` (PyTorch's pinned allocator keeps a staging
buffer alive until its copy has run), and reads results back with non-blocking copies followed by
one wait. On CPU both are plain tensors.
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


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of `tensors` after a single wait for the device (none on CPU): the step's one host sync."""
    if not any(t.device.type == "cuda" for t in tensors):
        return list(tensors)
    copies = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned destinations
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    return copies
