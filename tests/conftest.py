"""Shared test setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set
here, before pytest imports a test module, on every machine without CUDA.
"""

import os
from pathlib import Path

import pytest

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


_BUILD_TEST = "test_recorded_kernels_build_for_hopper"
_ROOT = Path(__file__).resolve().parents[1]
_build_wanted = False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sm90_prestart(module): the test runs `python -m module` through tests/sm90_compile.py's "
        "run_without_interpreter; the session starts it in the background (a CPU run, the test selected)",
    )


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` have deselected: only the tests that run
def pytest_collection_modifyitems(config, items):
    """The Hopper build check compiles what the other tests launched: it runs last. The
    sm_90 builds of tests marked ``sm90_prestart`` start now, in the background at the
    lowest CPU priority: a cold Triton cache (CI's) makes each take 10-20 s, mostly spent
    while the tests before them leave a core idle."""
    global _build_wanted
    last = [item for item in items if item.name == _BUILD_TEST]
    items[:] = [item for item in items if item not in last] + last
    _build_wanted = bool(last)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from tests import sm90_compile

    if not sm90_compile.tools_available():
        return
    for item in items:
        for mark in item.iter_markers("sm90_prestart"):
            sm90_compile.prestart(mark.args[0], _ROOT)


def pytest_runtest_logstart(nodeid, location):
    """Once the unit tests have run (the first integration test starts), the Hopper build
    of their launches starts in the background: the integration tests leave the cores partly
    idle, and the build test at the end only collects it (tests/triton_launches.py)."""
    if _build_wanted and nodeid.startswith("tests/integration/") and os.environ.get("TRITON_INTERPRET") == "1":
        from tests import sm90_compile

        if sm90_compile.tools_available():
            triton_launches.start_build(_ROOT)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests import sm90_compile

        triton_launches.cancel_build()
        sm90_compile.cancel_prestarted()
