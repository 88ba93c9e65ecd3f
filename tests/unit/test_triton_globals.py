"""Every Triton kernel in kernels/ reads module globals only as constexprs.

Compiled Triton (the GPU) refuses a kernel that reads a plain module-level int or float
("Cannot access global variable ... from within @jit'ed function"), but the interpreter
the CPU tests run in accepts it, so such a kernel passes every CPU test and fails on the
first GPU. This finds them without a GPU: the names a kernel's code loads as globals,
resolved in its module, must be constexprs, modules, functions or Triton objects.
"""

from __future__ import annotations

import dis
import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl

import kernels


def _jit_functions():
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # JITFunction, or the interpreter's InterpretedFunction
            if isinstance(obj, triton.runtime.jit.KernelInterface) and isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def _global_loads(code: types.CodeType):
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_loads(const)


KERNELS = dict(_jit_functions())


def test_the_walk_finds_the_kernels():
    assert "kernels.rejection.triton_rejection._rejection_kernel" in KERNELS
    assert len(KERNELS) >= 10


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_reads_globals_only_as_constexprs(name):
    fn = KERNELS[name].fn
    bad = []
    for g in set(_global_loads(fn.__code__)):
        value = fn.__globals__.get(g)
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, tl.constexpr):
            bad.append(f"{g}={value!r}")
    assert not bad, f"{name} reads plain module globals {bad}: wrap them in tl.constexpr(...)"
