"""Record the Triton kernel variants the CPU tests launch in the interpreter, so that
tests/unit/test_kernels_build_for_hopper.py can compile them for the H100 afterwards.

``install()`` wraps the interpreter's launch (``InterpretedFunction.run``): each launch of a
kernel defined under ``kernels/`` is reduced to what selects a compiled variant, namely the
argument types (Triton's own ``mangle_type``: ``*bf16``, ``i32``, ...), the ``tl.constexpr``
values and ``num_warps``, and kept once per distinct variant. Nothing else changes: the
launch then runs as before.
"""

from __future__ import annotations

import inspect
from typing import Any

LAUNCHES: dict[tuple, dict] = {}  # variant key -> job (tests/sm90_compile.py's format)


def _constexpr_names(fn) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


def _constant(value: Any) -> Any:
    """A constexpr value as JSON (a ``tl.dtype`` by name), or None where it has no JSON form."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    return None


def _record(fn, args: tuple, kwargs: dict) -> None:
    from triton.runtime.jit import mangle_type

    if not fn.__module__.startswith("kernels."):
        return
    names = list(inspect.signature(fn).parameters)
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    constexpr_names = _constexpr_names(fn)
    constexprs, types = {}, {}
    for name, value in bound.items():
        if name in constexpr_names:
            constexprs[name] = _constant(value)
        else:
            try:
                types[name] = mangle_type(value)
            except Exception:  # noqa: BLE001 - an argument Triton cannot type: skip the launch
                return
            if types[name] == "constexpr":  # None
                constexprs[name] = None
                del types[name]
    job = dict(module=fn.__module__, kernel=fn.__name__, constexprs=constexprs, types=types,
               num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages"))
    key = (job["module"], job["kernel"], tuple(sorted(types.items())), tuple(sorted((k, repr(v)) for k, v in constexprs.items())), job["num_warps"])
    LAUNCHES.setdefault(key, job)


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
        if not warmup:
            _record(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._records = True
    InterpretedFunction.run = recording_run
