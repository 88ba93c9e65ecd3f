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

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_launches

    triton_launches.install()  # for tests/unit/test_kernels_build_for_hopper.py


def pytest_collection_modifyitems(config, items):
    """The Hopper build check compiles what the other tests launched: it runs last."""
    last = [item for item in items if item.name == "test_recorded_kernels_build_for_hopper"]
    items[:] = [item for item in items if item not in last] + last
