"""Torch reference of the grouped GEMMs: the CPU path and the Triton kernels' oracle.

Expert weights are stacked ``nn.Linear`` weights, ``w [E, N, K]``: expert ``e`` maps a row
``a`` to ``a @ w[e].T``. Inputs come in the two layouts of ``kernels/moe/scatter``:

- ``grouped_gemm_contiguous(a [M, K], w, m_indices [M], block_m) -> c [M, N]``: row ``r``
  uses expert ``m_indices[r]``; rows marked ``-1`` (padding) are not computed and their
  output is undefined (zero here).
- ``grouped_gemm_masked(a [E, max_m, K], w, counts [E], block_m=None) -> c [E, max_m, N]``:
  the first ``counts[e]`` rows of each expert; the rest undefined (zero here). ``block_m``
  is the kernel's M tile (a hint: the rows an expert typically has; no effect here).

``fuse_silu_and_mul=True`` applies SwiGLU to the product: ``w`` is ``[E, 2N, K]`` (gate
rows, then up rows, as the fused ``gate_up`` projection) and the result is
``silu(gate) * up``, ``[.., N]``, with exactly the roundings of the product in ``a``'s dtype
followed by ``kernels/activation``'s ``silu_and_mul``. Products accumulate in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul


def check_gemm_inputs(a: torch.Tensor, w: torch.Tensor, fuse_silu_and_mul: bool) -> int:
    """The output width; raises on shapes that do not fit."""
    if w.dim() != 3:
        raise ValueError(f"w must be [experts, N, K], got shape {tuple(w.shape)}")
    if a.shape[-1] != w.shape[2]:
        raise ValueError(f"a's last dimension {a.shape[-1]} != w's K {w.shape[2]}")
    if a.dtype != w.dtype or a.device != w.device:
        raise ValueError(f"a ({a.dtype}, {a.device}) and w ({w.dtype}, {w.device}) must share dtype and device")
    if fuse_silu_and_mul and w.shape[1] % 2:
        raise ValueError(f"fuse_silu_and_mul needs w with 2N rows (gate, then up), got {w.shape[1]}")
    return w.shape[1] // 2 if fuse_silu_and_mul else w.shape[1]


def check_contiguous(a: torch.Tensor, m_indices: torch.Tensor, block_m: int) -> None:
    if a.dim() != 2 or m_indices.shape != (a.shape[0],):
        raise ValueError(f"a must be [M, K] with m_indices [M], got {tuple(a.shape)} and {tuple(m_indices.shape)}")
    if a.shape[0] % block_m:
        raise ValueError(f"rows of a ({a.shape[0]}) must be a multiple of block_m={block_m}")


def check_masked(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if a.dim() != 3 or a.shape[0] != w.shape[0] or counts.shape != (w.shape[0],):
        raise ValueError(f"a must be [E, max_m, K] with counts [E], got {tuple(a.shape)} and {tuple(counts.shape)}")


def _expert(rows: torch.Tensor, w: torch.Tensor, fuse_silu_and_mul: bool) -> torch.Tensor:
    out = F.linear(rows, w)
    return silu_and_mul(out) if fuse_silu_and_mul else out


def grouped_gemm_contiguous(
    a: torch.Tensor, w: torch.Tensor, m_indices: torch.Tensor, block_m: int, fuse_silu_and_mul: bool = False
) -> torch.Tensor:
    n = check_gemm_inputs(a, w, fuse_silu_and_mul)
    check_contiguous(a, m_indices, block_m)
    c = torch.zeros((a.shape[0], n), dtype=a.dtype, device=a.device)
    for e in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = torch.nonzero(m_indices == e).squeeze(1)
        c[rows] = _expert(a[rows], w[e], fuse_silu_and_mul)
    return c


def grouped_gemm_masked(
    a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, fuse_silu_and_mul: bool = False, block_m: int | None = None
) -> torch.Tensor:
    n = check_gemm_inputs(a, w, fuse_silu_and_mul)
    check_masked(a, w, counts)
    c = torch.zeros((a.shape[0], a.shape[1], n), dtype=a.dtype, device=a.device)
    for e, count in enumerate(counts.clamp(max=a.shape[1]).tolist()):
        if count:
            c[e, :count] = _expert(a[e, :count], w[e], fuse_silu_and_mul)
    return c
