"""Whether the model is being run for a CUDA graph: inside its capture, or in the eager
warm-up runs just before it.

Some layers choose their kernels per call (the MoE hybrid picks an executor by batch size)
and must pick a capturable one for a graph. Inside the capture the stream says so
(``torch.cuda.is_current_stream_capturing``), but the warm-up runs before it, which compile
the Triton kernels the capture will record, look like any eager call: the engine marks them
with ``for_graph()`` so they take the same path as the capture (else a kernel first met
inside the capture would compile there).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_state = threading.local()


@contextlib.contextmanager
def for_graph() -> Iterator[None]:
    """Mark this thread's model calls as a CUDA graph's (its warm-up and its capture)."""
    before = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = before


def capturing_graph(device: torch.device) -> bool:
    """Whether a call on ``device`` is for a CUDA graph: inside ``for_graph()``, or while the
    current stream is being captured. Never raises."""
    if device.type != "cuda":
        return False
    if getattr(_state, "active", False):
        return True
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return False
