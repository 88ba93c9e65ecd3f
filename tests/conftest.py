"""Shared test setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set
here, before pytest imports a test module, on every machine without CUDA.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
