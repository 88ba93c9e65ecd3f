"""Errors raised by the swap kernels and the staging pool.

Every check on the caller's input raises a subclass of ``SwapValidationError`` (itself a
``ValueError``), so a service can turn any of them into "this request's blocks could not
be moved" without catching unrelated bugs. Misuse of the staging pool's lifetime (a
closed swapper, a released buffer, an exhausted pool) is a ``StagingStateError``: that is
a programming error in the caller, not bad data.
"""

from __future__ import annotations


class SwapValidationError(ValueError):
    """Base class: the tensors or block ids handed to a swap cannot be used as given."""


class SwapShapeError(SwapValidationError):
    """A cache or staging tensor has the wrong rank, shape, dtype, device or capacity."""


class SwapAlignmentError(SwapValidationError):
    """A tensor is not contiguous, or not aligned as the Triton path needs (16 bytes)."""


class BlockIdError(SwapValidationError):
    """Block ids are not a 1-D host integer list, are out of range, or repeat in a scatter."""


class StagingStateError(RuntimeError):
    """A closed swapper or a released staging buffer was used, or every buffer is lent out."""
