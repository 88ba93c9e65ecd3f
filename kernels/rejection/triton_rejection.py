"""Triton rejection sampler: the GPU path, the same signature and tokens as ``reference.py``.

One program per sequence. It walks the row's ``num_draft_tokens`` drafts with scalar loads
(``p(d)``, ``q(d)`` and the uniform at each position, or the target's argmax on a greedy
row) to find the first rejection, then makes at most one pass over the vocabulary, in
``BLOCK_V`` tiles, for the recovered or bonus token: ``argmax(max(0, p - q) / E)`` with a
running maximum across tiles (first index on ties, as ``torch.argmax``). Greedy rows skip
that pass. Nothing is read back to the host, so the launch can sit inside a CUDA graph.

Bit-equality with the reference: the comparison ``p / q >= u`` and the race ``w / E`` use
IEEE round-to-nearest division (``div_rn``; Triton's ``/`` is approximate on NVIDIA GPUs),
and ``max(0, p - q)`` is one fp32 subtraction in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rejection.reference import PLACEHOLDER

_BLOCK_V = 1024
# A jitted kernel may read a module global only as a constexpr (compiled Triton refuses a
# plain int; the interpreter does not notice).
_PLACEHOLDER = tl.constexpr(PLACEHOLDER)


@triton.jit
def _rejection_kernel(
    draft_ptr, num_draft_ptr, draft_probs_ptr, target_probs_ptr, target_argmax_ptr,
    greedy_ptr, uniform_ptr, noise_ptr, out_ptr,
    K, V,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_TARGET_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + b).to(tl.int64)
    greedy_flag = tl.load(greedy_ptr + b)
    greedy = greedy_flag != 0
    if HAS_TARGET_PROBS:
        sampling = greedy_flag == 0
    else:  # every row is greedy
        sampling = greedy_flag < 0
    a = n  # first rejected position (n: all accepted)
    for i in range(0, K):
        valid = i < n
        d = tl.load(draft_ptr + b * K + i).to(tl.int64)
        d = tl.where(valid & (d >= 0), d, 0)
        ok_greedy = d == tl.load(target_argmax_ptr + b * (K + 1) + i)
        p = tl.load(target_probs_ptr + (b * (K + 1) + i) * V + d, mask=valid & sampling, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (b * K + i) * V + d, mask=valid & sampling, other=1.0)
        else:
            q = 1.0
        u = tl.load(uniform_ptr + b * K + i, mask=valid & sampling, other=0.0)
        safe_q = tl.where(q > 0, q, 1.0)
        ok_random = (q > 0) & (tl.math.div_rn(p, safe_q) >= u)
        ok = tl.where(greedy, ok_greedy, ok_random)
        a = tl.where(valid & (ok == 0) & (a == n), i, a)

    final = tl.load(target_argmax_ptr + b * (K + 1) + a)
    rejected_here = a < n
    a_q = tl.minimum(a, K - 1)
    d_a = tl.load(draft_ptr + b * K + a_q, mask=rejected_here, other=0).to(tl.int64)
    best_val = -1.0
    best_idx = final * 0
    span = tl.where(sampling, V, 0)  # greedy rows skip the vocabulary pass
    for v0 in range(0, span, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        p = tl.load(target_probs_ptr + (b * (K + 1) + a) * V + offs, mask=m, other=0.0)
        if HAS_DRAFT_PROBS:
            # (bounds, not ``m & scalar``: the interpreter mistypes a block & scalar mask)
            q = tl.load(draft_probs_ptr + (b * K + a_q) * V + offs, mask=offs < tl.where(rejected_here, V, 0), other=0.0)
        else:
            q = tl.where(offs == tl.where(rejected_here, d_a, -1), 1.0, 0.0)
        e = tl.load(noise_ptr + b * V + offs, mask=m, other=1.0)
        w = tl.math.div_rn(tl.maximum(p - q, 0.0), e)
        w = tl.where(m, w, -1.0)
        tile_max = tl.max(w, axis=0)
        tile_arg = tl.argmax(w, axis=0)
        better = tile_max > best_val
        best_idx = tl.where(better, v0 + tile_arg, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    final = tl.where(sampling, best_idx, final)

    for i in range(0, K + 1):
        d = tl.load(draft_ptr + b * K + i, mask=i < K, other=0).to(tl.int64)
        tok = tl.where(i < a, d, tl.where(i == a, final, _PLACEHOLDER))
        tl.store(out_ptr + b * (K + 1) + i, tok)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    """Emitted tokens ``[B, K + 1]``; see ``kernels/rejection/reference.py``."""
    B, K = draft_token_ids.shape
    device = draft_token_ids.device
    out = torch.empty((B, K + 1), dtype=torch.long, device=device)
    if B == 0:
        return out
    drafts = draft_token_ids.to(torch.long).contiguous()
    num = num_draft_tokens.to(device=device, dtype=torch.int32).contiguous()
    greedy = is_greedy.to(device=device, dtype=torch.int8).contiguous()
    argmax = target_argmax.to(torch.long).contiguous()
    V = exp_noise.shape[1] if target_probs is None else target_probs.shape[2]
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    _rejection_kernel[(B,)](
        drafts, num,
        dummy if draft_probs is None else draft_probs.contiguous(),
        dummy if target_probs is None else target_probs.contiguous(),
        argmax, greedy,
        uniform.contiguous() if K else dummy,
        exp_noise.contiguous(),
        out, K, V,
        HAS_DRAFT_PROBS=draft_probs is not None,
        HAS_TARGET_PROBS=target_probs is not None,
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(max(V, 16))),
        num_warps=4,
    )
    return out
