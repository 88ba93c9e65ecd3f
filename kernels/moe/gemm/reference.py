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

**FP8** (``grouped_gemm_contiguous_fp8``, ``grouped_gemm_masked_fp8``): the same products
with e4m3 operands in the block-scaled format of kernels/fp8/layout.py, per expert:
``w_q [E, N_pad, K_pad]`` with ``w_s [E, N_pad/128, K_pad/128]``, and activations quantized
per token and group of 128 (``kernels.fp8`` ``per_token_group_quant``) to ``a_q [.., K_pad]``
with ``a_s [.., K_pad/128]``. ``n`` is the output width (per half when fused: gate rows
``[0, n)``, up rows ``[N_pad/2, N_pad/2 + n)``, each half padded to 128 on its own). The
reference dequantizes both to fp32 and multiplies (the definition the Triton kernel is
tested against, and the path off FP8 tensor cores); the product is rounded to
``out_dtype`` before SwiGLU, as in the dense GEMMs. ``a_s=None``: ``a_q`` holds the
unquantized activations ``[.., K]`` and the GEMM quantizes them itself, per token group,
with the same arithmetic (the Triton kernel in registers, for the rows it reads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation.reference import silu_and_mul
from kernels.fp8.layout import check_grouped_operands
from kernels.fp8.reference import dequantize_activation, dequantize_weight, per_token_group_quant


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


def _expert(rows: torch.Tensor, w: torch.Tensor, fuse_silu_and_mul: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out = F.linear(rows, w)
    out = out if out_dtype is None else out.to(out_dtype)
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


# -- FP8 -------------------------------------------------------------------------------------


def check_contiguous_fp8(a_q, a_s: torch.Tensor | None, w_q, w_s, m_indices: torch.Tensor, block_m: int, n: int, fuse_silu_and_mul: bool) -> None:
    check_grouped_operands(a_q, a_s, w_q, w_s, n, fuse_silu_and_mul)
    check_contiguous(a_q, m_indices, block_m)


def check_masked_fp8(a_q, a_s: torch.Tensor | None, w_q, w_s, counts: torch.Tensor, n: int, fuse_silu_and_mul: bool) -> tuple[int, int, int]:
    """``a_q``'s ``(E, max_m, K)``."""
    check_grouped_operands(a_q, a_s, w_q, w_s, n, fuse_silu_and_mul)
    check_masked(a_q, w_q, counts)
    return a_q.shape


def _dequantized_expert(w_q: torch.Tensor, w_s: torch.Tensor, e: int, n: int, fuse_silu_and_mul: bool) -> torch.Tensor:
    """Expert ``e``'s fp32 ``[n, K_pad]`` weight (``[2n, K_pad]``: gate rows, then up rows)."""
    w = dequantize_weight(w_q[e], w_s[e])
    if not fuse_silu_and_mul:
        return w[:n]
    half = w.shape[0] // 2
    return torch.cat([w[:n], w[half:half + n]])


def grouped_gemm_contiguous_fp8(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, m_indices: torch.Tensor, block_m: int,
    *, n: int, fuse_silu_and_mul: bool = False, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``c [M, n]``: row ``r`` times expert ``m_indices[r]``'s dequantized weight."""
    check_contiguous_fp8(a_q, a_s, w_q, w_s, m_indices, block_m, n, fuse_silu_and_mul)
    if a_s is None:
        a_q, a_s = per_token_group_quant(a_q)
    a = dequantize_activation(a_q, a_s)
    c = torch.zeros((a.shape[0], n), dtype=out_dtype, device=a.device)
    for e in torch.unique(m_indices[m_indices >= 0]).tolist():
        rows = torch.nonzero(m_indices == e).squeeze(1)
        c[rows] = _expert(a[rows], _dequantized_expert(w_q, w_s, e, n, fuse_silu_and_mul), fuse_silu_and_mul, out_dtype)
    return c


def grouped_gemm_masked_fp8(
    a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, counts: torch.Tensor,
    *, n: int, fuse_silu_and_mul: bool = False, out_dtype: torch.dtype = torch.float32, block_m: int | None = None,
) -> torch.Tensor:
    """``c [E, max_m, n]``: the first ``counts[e]`` rows of ``a_q[e]`` times expert ``e``
    (the contiguous reference on the flattened rows, those past a count marked padding)."""
    num_experts, max_m, k = check_masked_fp8(a_q, a_s, w_q, w_s, counts, n, fuse_silu_and_mul)
    if a_s is None:
        a_q, a_s = per_token_group_quant(a_q.reshape(num_experts * max_m, k))
    rows = torch.arange(max_m, device=a_q.device)
    owner = torch.arange(num_experts, device=a_q.device)[:, None].expand(num_experts, max_m)
    m_indices = torch.where(rows[None, :] < counts[:, None], owner, -1).reshape(-1)
    c = grouped_gemm_contiguous_fp8(
        a_q.reshape(num_experts * max_m, a_q.shape[-1]), a_s.reshape(num_experts * max_m, a_s.shape[-1]), w_q, w_s, m_indices, 1,
        n=n, fuse_silu_and_mul=fuse_silu_and_mul, out_dtype=out_dtype,
    )
    return c.view(num_experts, max_m, n)
