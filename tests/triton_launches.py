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
import json
import math
import os
from pathlib import Path
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


# -- the Hopper build of what was launched (tests/unit/test_kernels_build_for_hopper.py) -------

PER_KERNEL = 8
_build = None  # (jobs, the tests.sm90_compile.BackgroundRun building them), once started


def _tiles(job: dict) -> int:
    blocks = [v for k, v in job["constexprs"].items() if k.startswith("BLOCK") and isinstance(v, int) and not isinstance(v, bool)]
    return math.prod(blocks) if blocks else 0


def _flags(job: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in job["constexprs"].items() if isinstance(v, bool)))


def sample(jobs: list[dict]) -> list[dict]:
    """Per kernel: the first variant of each combination of flags, the last variant and the
    one with the largest tiles (at most ``PER_KERNEL``)."""
    by_kernel: dict[tuple[str, str], list[dict]] = {}
    for job in jobs:
        by_kernel.setdefault((job["module"], job["kernel"]), []).append(job)
    out = []
    for variants in by_kernel.values():
        first_of_flags: dict[tuple, dict] = {}
        for job in variants:
            first_of_flags.setdefault(_flags(job), job)
        picked = [*first_of_flags.values(), variants[-1], max(variants, key=_tiles)]
        out += list({id(j): j for j in picked}.values())[:PER_KERNEL]
    return out


def start_build(cwd: Path) -> None:
    """Start building the sample of the launches so far for sm_90, in the background, once.
    The conftest calls it when the first integration test starts: every unit test has
    launched its kernels by then, and the integration tests leave CPU time idle."""
    global _build
    if _build is None and LAUNCHES:
        from tests import sm90_compile

        jobs = sample(list(LAUNCHES.values()))
        _build = (jobs, sm90_compile.compile_in_background(jobs, cwd))


def build(cwd: Path, timeout: float = 1200) -> list[tuple[dict, dict]]:
    """(job, result) for the sample of every launch recorded: the background build's, if
    one was started, plus any variant it did not have (launched after it started), compiled
    now with a process per core."""
    from tests import sm90_compile

    picked = sample(list(LAUNCHES.values()))
    done = {}
    if _build is not None:
        jobs, run = _build
        done = dict(zip(map(_key, jobs), json.loads(run.stdout(timeout))))
    missing = [j for j in picked if _key(j) not in done]
    if missing:
        done.update(zip((_key(j) for j in missing), sm90_compile.compile_in_subprocess(missing, cwd, timeout)))
    return [(j, done[_key(j)]) for j in picked]


def cancel_build() -> None:
    if _build is not None:
        _build[1].cancel()
