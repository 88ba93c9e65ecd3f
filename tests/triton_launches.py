"""Record Triton kernel launches made in the interpreter as compile jobs for the H100
(tests/sm90_compile.py), so that CPU tests can check kernels build for the GPU.

A launch of a kernel defined under ``kernels/`` is reduced to what selects a compiled
variant, exactly as ``@triton.jit`` specializes it on a GPU: each argument's type and
specialization (Triton's own ``native_specialize_impl``: ``*bf16`` aligned to 16 bytes, an
int divisible by 16, an int equal to 1 made a constant), the ``tl.constexpr`` values and
the compile options given (``num_warps``, ``num_stages``, ``enable_fp_fusion``). Without those facts the compiler cannot vectorize loads, and a register or
spill figure would describe another kernel than the one that runs.

- ``install()`` (tests/conftest.py, CPU runs) keeps one job per distinct variant in
  ``LAUNCHES`` for the whole session, and the launches still run;
- ``capture()`` collects the jobs of the launches inside a ``with`` block without running
  them (a test can ask for the variants a wrapper would launch at full model sizes).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Iterator

LAUNCHES: dict[tuple, dict] = {}  # variant key -> job
_capturing: list[list[dict]] = []


def _constant(value: Any) -> Any:
    """A constexpr value as JSON (a ``tl.dtype`` by name), or None where it has no JSON form."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    return None


def job_for(fn, args: tuple, kwargs: dict) -> dict | None:
    """The compile job of launching ``fn`` (the kernel's Python function) with these
    arguments, or None (a kernel outside ``kernels/``, an argument Triton cannot type)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    if not fn.__module__.startswith("kernels."):
        return None
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    constexprs, types, divisible = {}, {}, []
    for name, value in bound.items():
        if "constexpr" in str(params[name].annotation):
            constexprs[name] = _constant(value)
            continue
        try:
            kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        except Exception:  # noqa: BLE001 - not a kernel argument Triton types
            return None
        if kind == "constexpr":  # None, or an int equal to 1: Triton makes it a constant
            constexprs[name] = spec
        else:
            types[name] = kind
            if isinstance(spec, str) and "D" in spec:
                divisible.append(name)
    return dict(module=fn.__module__, kernel=fn.__name__, constexprs=constexprs, types=types, divisible=divisible,
                num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages"), enable_fp_fusion=kwargs.get("enable_fp_fusion"))


def recording() -> bool:
    """Launches are recorded only in Triton's interpreter (the CPU runs); on a GPU the
    kernels are compiled ``JITFunction``s and nothing passes through here."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _key(job: dict) -> tuple:
    return (job["module"], job["kernel"], tuple(sorted(job["types"].items())), tuple(job["divisible"]),
            tuple(sorted((k, repr(v)) for k, v in job["constexprs"].items())), job["num_warps"], job["num_stages"], job["enable_fp_fusion"])


def install() -> None:
    """Wrap the interpreter's launch (idempotent; a no-op without Triton)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    if getattr(InterpretedFunction.run, "_records", False):
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        job = job_for(self.fn, args, kwargs)
        if _capturing:
            if job is not None:
                _capturing[-1].append(job)
            return None
        if job is not None:
            LAUNCHES.setdefault(_key(job), job)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._records = True
    InterpretedFunction.run = recording_run


@contextlib.contextmanager
def capture() -> Iterator[list[dict]]:
    """The jobs of the kernel launches inside the block, which do not run (outputs stay
    as allocated)."""
    install()
    jobs: list[dict] = []
    _capturing.append(jobs)
    try:
        yield jobs
    finally:
        _capturing.pop()
