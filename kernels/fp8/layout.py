"""The block-scaled FP8 format and the GEMM's operand contract: shapes, padding, alignment.

The format is DeepSeek-V3's, which vLLM reads as ``weight_block_size: [128, 128]``:

- a weight ``W [N, K]`` is stored as e4m3 (``torch.float8_e4m3fn``) with one fp32 scale per
  128 x 128 block: ``W[n, k] ~= q[n, k] * s[n // 128, k // 128]``;
- an activation ``X [M, K]`` is quantized on the fly, per token and per group of 128 along
  K: ``X[m, k] ~= q[m, k] * s[m, k // 128]``;
- a scale is ``amax / 448`` (448 is e4m3's largest finite value), so the largest magnitude
  of a block lands on 448 and nothing saturates. ``amax`` is floored at ``SCALE_EPS`` and
  capped at fp32's largest finite value, so a scale is never 0 (an all-zero block: 0 / 0
  would make NaN) and never inf (a block holding inf).

Padding instead of partial blocks. K and N need not be multiples of 128 (SmolLM2's hidden
size is 576 = 4.5 x 128). vLLM masks partial blocks inside its kernel; here the operands
are padded once with zeros instead, so the GEMM's inner loop reads whole tiles without a
mask and every row starts 128-byte aligned (TMA needs 16):

- weights are padded to ``[N_pad, K_pad]`` (multiples of 128) when they are loaded or
  quantized; a partial block's scale is the amax of its real values, exactly vLLM's;
- activations are padded to ``[M_pad, K_pad]`` by the quantization kernel itself (the
  padding is fused into it): K to the weight's ``K_pad``, and M to the *token tile* of the
  GEMM variant that will read them (``GemmPlan.row_multiple``). Padded rows and columns
  are zeros with a finite positive scale, so they add exactly 0.

Alignment is checked before any launch by :func:`check_gemm_operands` (shared by the
reference and the Triton path, so CPU tests enforce the GPU's contract) and fails with an
``Fp8AlignmentError`` that names the operand, its shape and what it must be.

The swap-AB variant reads the same padded operands as the normal one; only the token
tile differs, and the plan says which. Seed 000's reviewers flagged a swap-AB change that
silently altered the alignment the kernel assumed: here the plan is chosen first, the
activations are padded to it, and a mismatch is an error, never a silent re-layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.fp8.plan import GemmPlan

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Unit roundoff of e4m3 (3 mantissa bits): a normal value is rounded with relative error
# at most 2**-4; below 2**-6 (subnormals) the absolute error is at most 2**-10.
E4M3_UNIT_ROUNDOFF = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10
BLOCK = 128  # weight block edge, activation group length, and the GEMM's K tile
SCALE_EPS = 1e-10  # amax floor (vLLM's): all-zero blocks get a tiny positive scale
FP32_MAX = torch.finfo(torch.float32).max

class Fp8AlignmentError(ValueError):
    """An FP8 GEMM operand has the wrong dtype, shape, padding or alignment."""


def padded(n: int, multiple: int = BLOCK) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def scales_tensor(m_pad: int, k_pad: int, device: torch.device | str, column_major: bool = False) -> torch.Tensor:
    """An empty ``[m_pad, k_pad / 128]`` fp32 tensor for per-token-group activation scales:
    row-major, or (``column_major``) a view of a ``[k_pad / 128, m_pad]`` tensor, the
    layout cuBLAS's block-scaled GEMM reads."""
    if column_major:
        return torch.empty((k_pad // BLOCK, m_pad), dtype=torch.float32, device=device).t()
    return torch.empty((m_pad, k_pad // BLOCK), dtype=torch.float32, device=device)


def _fail(what: str) -> None:
    raise Fp8AlignmentError(what)


def check_weight(q: torch.Tensor, scale: torch.Tensor) -> None:
    """A padded block-quantized weight: ``q [N_pad, K_pad]`` e4m3, ``scale`` fp32 per block."""
    if q.dtype != FP8_DTYPE or q.dim() != 2:
        _fail(f"weight must be a 2-D {FP8_DTYPE} tensor, got {q.dtype} of shape {tuple(q.shape)}")
    _check_blocks(q, scale, "weight")


def check_expert_weight(q: torch.Tensor, scale: torch.Tensor) -> None:
    """Stacked experts' padded weights: ``q [E, N_pad, K_pad]`` e4m3, each expert with its
    own fp32 block scales ``scale [E, N_pad/128, K_pad/128]`` (the dense format, per expert)."""
    if q.dtype != FP8_DTYPE or q.dim() != 3:
        _fail(f"expert weights must be a 3-D {FP8_DTYPE} tensor [E, N_pad, K_pad], got {q.dtype} of shape {tuple(q.shape)}")
    _check_blocks(q, scale, "expert weight")


def _check_blocks(q: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    *lead, n_pad, k_pad = q.shape
    if n_pad % BLOCK or k_pad % BLOCK or n_pad == 0 or k_pad == 0:
        _fail(f"{name} shape {tuple(q.shape)} is not padded to multiples of {BLOCK} (pad with zeros when loading)")
    grid = (*lead, n_pad // BLOCK, k_pad // BLOCK)
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid or scale.stride(-1) != 1:
        _fail(f"{name} scale must be float32 {list(grid)} with unit column stride, got {scale.dtype} {tuple(scale.shape)} strides {scale.stride()}")
    _check_rows(q, name)


def check_activation(x: torch.Tensor, row_multiple: int) -> None:
    """What the activation quantizer takes: a 2-D float ``[M, K]``, any strides."""
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"activation must be a 2-D float tensor [M, K], got {x.dtype} of shape {tuple(x.shape)}")
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")


def check_gemm_operands(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, m: int, n: int, plan: "GemmPlan"
) -> None:
    """Everything the GEMM assumes about its operands, checked on host metadata only. (A
    plan's ``fuse_quant`` means nothing here: these activations are quantized already.)"""
    check_weight(w_q, w_s)
    _check_plan_fits_weight(w_q, n, plan)
    if x_q.dtype != FP8_DTYPE or x_q.dim() != 2:
        _fail(f"activation must be a 2-D {FP8_DTYPE} tensor, got {x_q.dtype} of shape {tuple(x_q.shape)}")
    m_pad, k_pad = x_q.shape
    if k_pad != w_q.shape[1]:
        _fail(f"activation K ({k_pad}) != weight K_pad ({w_q.shape[1]}): quantize it with the weight's padded K")
    if m_pad % plan.row_multiple:
        variant = "swap-AB" if plan.swap_ab else "normal"
        _fail(
            f"activation rows ({m_pad}) are not a multiple of the {variant} variant's token tile "
            f"({plan.row_multiple}): quantize with per_token_group_quant(x, row_multiple=plan.row_multiple)"
        )
    if x_s.dtype != torch.float32 or tuple(x_s.shape) != (m_pad, k_pad // BLOCK) or x_s.stride(1) != 1:
        _fail(f"activation scale must be float32 [{m_pad}, {k_pad // BLOCK}] with unit column stride, got {x_s.dtype} {tuple(x_s.shape)} strides {x_s.stride()}")
    if not 1 <= m <= m_pad:
        _fail(f"m ({m}) must be in 1..{m_pad} (the activation's padded rows)")
    _check_rows(x_q, "activation")
    if x_q.device != w_q.device or x_s.device != w_q.device or w_s.device != w_q.device:
        _fail("activation, weight and their scales must be on one device")


def check_fused_operands(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, n: int, plan: "GemmPlan") -> None:
    """What a GEMM that quantizes its own activations assumes: ``x [m, K]`` unquantized,
    any strides, with ``K`` padding to the weight's ``K_pad``; no padded rows."""
    check_weight(w_q, w_s)
    _check_plan_fits_weight(w_q, n, plan)
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        _fail(f"activation must be a 2-D unquantized float tensor [M, K], got {x.dtype} of shape {tuple(x.shape)}")
    if x.shape[0] < 1:
        _fail("activation has no rows")
    if padded(x.shape[1]) != w_q.shape[1]:
        _fail(f"activation K ({x.shape[1]}) does not pad to the weight's K_pad ({w_q.shape[1]})")
    if x.device != w_q.device or w_s.device != w_q.device:
        _fail("activation, weight and its scales must be on one device")


def check_grouped_operands(
    a_q: torch.Tensor, a_s: torch.Tensor | None, w_q: torch.Tensor, w_s: torch.Tensor, n: int, halves: bool
) -> None:
    """What the grouped expert GEMM (kernels/moe/gemm) assumes, on host metadata only:
    ``w_q [E, N_pad, K_pad]`` as ``check_expert_weight``; with ``halves`` (gate/up fused for
    SwiGLU) its rows are two halves, each padded to 128 on its own, so the up rows start
    at ``N_pad / 2``, on a block edge; ``n`` output columns (per half) fit in them; the
    activations ``a_q [..., K_pad]`` e4m3 (any leading layout: ``[M, K_pad]`` contiguous,
    ``[E, max_m, K_pad]`` masked) with their per-token-group scales ``[..., K_pad/128]``,
    or (``a_s`` None: the GEMM quantizes them itself) unquantized ``[..., K]`` floats whose
    K pads to ``K_pad``."""
    check_expert_weight(w_q, w_s)
    rows = w_q.shape[1]
    if halves:
        if rows % (2 * BLOCK):
            _fail(f"fused gate/up expert weights need two halves each padded to {BLOCK} rows, got {rows} rows")
        rows //= 2
    if not 1 <= n <= rows:
        _fail(f"n ({n}) must be in 1..{rows} (the expert weight's padded rows{' per half' if halves else ''})")
    raw = a_s is None
    if a_q.dim() < 2 or (a_q.dtype == FP8_DTYPE) == raw or not a_q.is_floating_point():
        what = "an unquantized float tensor [..., K] (no scales given)" if raw else f"a {FP8_DTYPE} tensor [..., K_pad]"
        _fail(f"activation must be {what}, got {a_q.dtype} of shape {tuple(a_q.shape)}")
    k_pad = padded(a_q.shape[-1]) if raw else a_q.shape[-1]
    if k_pad != w_q.shape[2]:
        _fail(f"activation K ({a_q.shape[-1]}) does not match the expert weight's K_pad ({w_q.shape[2]}): quantize it with per_token_group_quant, which pads K to {BLOCK}")
    grid = (*a_q.shape[:-1], k_pad // BLOCK)
    if not raw and (a_s.dtype != torch.float32 or tuple(a_s.shape) != grid or not a_s.is_contiguous()):
        _fail(f"activation scale must be contiguous float32 {list(grid)}, got {a_s.dtype} {tuple(a_s.shape)} strides {a_s.stride()}")
    if not a_q.is_contiguous():
        _fail(f"activation must be contiguous, got strides {a_q.stride()}")
    if a_q.numel() and not raw:  # an empty tensor's strides mean nothing
        _check_rows(a_q, "activation")
    if a_q.device != w_q.device or (not raw and a_s.device != w_q.device) or w_s.device != w_q.device:
        _fail("activation, expert weights and their scales must be on one device")


def _check_plan_fits_weight(w_q: torch.Tensor, n: int, plan: "GemmPlan") -> None:
    if not 1 <= n <= w_q.shape[0]:
        _fail(f"n ({n}) must be in 1..{w_q.shape[0]} (the weight's padded rows)")
    if w_q.shape[0] % plan.weight_tile:
        _fail(f"the plan's weight tile ({plan.weight_tile}) does not divide the weight's padded rows ({w_q.shape[0]})")


def _check_rows(t: torch.Tensor, name: str) -> None:
    """Rows must be contiguous along K and start 16-byte aligned (TMA's and vector loads')."""
    if t.stride(-1) != 1 or any(st % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
        _fail(f"{name} rows must be contiguous and 16-byte aligned, got strides {t.stride()} at offset {t.data_ptr() % 16}")
