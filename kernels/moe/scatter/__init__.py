"""ep_scatter and combine: routed tokens into expert-major layouts and back.

- ``layout``: the contiguous (tile-aligned segments, ``-1`` padding in ``m_indices``) and
  masked (``[experts, max_m, hidden]`` + counts) layouts, their capacities and checks.
- ``reference``: torch ``scatter_contiguous``, ``scatter_masked`` and ``combine``, the CPU
  path and the test oracle.
- ``triton_scatter``: the same three functions as Triton kernels (imported on demand: it
  needs triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.moe.scatter.layout import (
    CapacityError,
    ContiguousLayout,
    MaskedLayout,
    contiguous_capacity,
    masked_capacity,
)
from kernels.moe.scatter.reference import combine, scatter_contiguous, scatter_masked

__all__ = [
    "CapacityError",
    "ContiguousLayout",
    "MaskedLayout",
    "combine",
    "contiguous_capacity",
    "masked_capacity",
    "scatter_contiguous",
    "scatter_masked",
]
