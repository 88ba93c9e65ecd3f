"""Pick the fused elementwise ops of a decoder layer for a device.

``ops_for(device)`` returns a namespace with ``rms_norm``, ``fused_add_rms_norm``,
``apply_rotary`` and ``silu_and_mul``: the Triton kernels on CUDA, the torch references
everywhere else (the CPU engine, which is tested bit-for-bit against Hugging Face). The two
sets have identical signatures; read their packages' docstrings (kernels/norm, kernels/rope,
kernels/activation) for shapes and for ``apply_rotary``'s in-place contract.

The Triton modules are imported only when asked for: they need triton, and off CUDA they run
only in the interpreter (``TRITON_INTERPRET=1`` set before the import).
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

import torch


def _ops(norm: ModuleType, rope: ModuleType, activation: ModuleType) -> SimpleNamespace:
    return SimpleNamespace(
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        apply_rotary=rope.apply_rotary,
        silu_and_mul=activation.silu_and_mul,
    )


@functools.lru_cache(maxsize=None)
def reference_ops() -> SimpleNamespace:
    """The torch references: the CPU path and the tests' oracle."""
    from kernels.activation import reference as activation
    from kernels.norm import reference as norm
    from kernels.rope import reference as rope

    return _ops(norm, rope, activation)


@functools.lru_cache(maxsize=None)
def triton_ops() -> SimpleNamespace:
    """The Triton kernels: one launch per op, CUDA-graph capturable."""
    from kernels.activation import triton_activation as activation
    from kernels.norm import triton_norm as norm
    from kernels.rope import triton_rope as rope

    return _ops(norm, rope, activation)


def ops_for(device: torch.device | str) -> SimpleNamespace:
    """Triton on CUDA, the torch references elsewhere. Cheap to call every forward pass."""
    return triton_ops() if torch.device(device).type == "cuda" else reference_ops()


def bitmask_op(device: torch.device | str):
    """``apply_token_bitmask_`` for ``device``: the Triton kernel on CUDA, else the reference."""
    if torch.device(device).type == "cuda":
        from kernels.bitmask.triton_bitmask import apply_token_bitmask_
    else:
        from kernels.bitmask.reference import apply_token_bitmask_
    return apply_token_bitmask_
