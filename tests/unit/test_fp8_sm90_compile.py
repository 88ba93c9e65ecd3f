"""The FP8 kernels compile for Hopper (sm_90) on this CPU-only machine.

The interpreter tests check what the kernels compute; the GPU tests need a GPU. This
checks in between that Triton's GPU compiler accepts them, down to a cubin through the
ptxas Triton bundles (tests/fp8_sm90_compile.py, in a process of its own: the
interpreter's ``triton.jit`` cannot be compiled): the GEMM with the quantization fused
and split-K, with 32-row tiles, with TMA descriptors, and the quantization kernel. And
that what Hopper needs is in the PTX: warpgroup MMAs (``wgmma``) for 64-row tiles, TMA
bulk copies where asked, the split-K counter atomics, IEEE divisions in the quantization,
and under programmatic dependent launch the weight's L2 prefetches before the wait.
Skips where this Triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sm90_compile import run_without_interpreter, tools_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not tools_available(), reason="this Triton has no NVIDIA backend / ptxas")
@pytest.mark.sm90_prestart("tests.fp8_sm90_compile")
def test_fp8_kernels_compile_for_sm90():
    got = json.loads(run_without_interpreter("tests.fp8_sm90_compile", ROOT, timeout=300).strip().splitlines()[-1])
    fused, narrow, tma, quant = got["swap fused split-K"], got["swap 32-row split-K"], got["normal tma"], got["quant"]
    assert fused["wgmma"] > 0 and fused["atomics"] > 0 and fused["div_rn"] > 0 and fused["cp_async"] > 0  # weights pipelined
    assert narrow["mma_sync"] > 0 and narrow["wgmma"] == 0  # 32 rows: below a warpgroup's 64
    assert tma["tma"] > 0 and tma["wgmma"] > 0 and tma["atomics"] == 0
    assert fused["l2_prefetch"] == narrow["l2_prefetch"] == tma["l2_prefetch"] == 0  # no PDL, no prefetch
    # Under PDL the swap-AB GEMM asks L2 for its weight rows' first lines before its wait,
    # and its first TMA load comes after the wait.
    pdl = got["swap tma split-K pdl"]
    assert pdl["l2_prefetch"] > 0 and pdl["tma"] > 0 and pdl["wgmma"] > 0
    assert 0 <= pdl["first_l2_prefetch"] < pdl["first_pdl_wait"] < pdl["first_tma"]
    assert quant["div_rn"] > 0
    # The MoE grouped GEMM's FP8 mode (FP8 experts): warpgroup MMAs on e4m3 with its loads
    # pipelined for 64- and 128-row tiles, mma.sync for the masked layout's 16-row decode tiles.
    for name in ("grouped contiguous fused", "grouped contiguous"):
        assert got[name]["wgmma"] > 0 and got[name]["cp_async"] > 0, (name, got[name])
    masked16, masked64 = got["grouped masked fused"], got["grouped masked 64"]  # both quantize their rows inside
    assert masked16["mma_sync"] > 0 and masked16["div_rn"] > 0
    assert masked64["wgmma"] > 0 and masked64["div_rn"] > 0
