"""Compile the FP8 kernels for Hopper (sm_90) on a machine without a GPU, and print what
the PTX holds, as JSON: run by tests/unit/test_fp8_sm90_compile.py in a process of its
own (without ``TRITON_INTERPRET``, under which ``triton.jit`` gives interpreted functions
that the compiler cannot take).

Triton's compiler and the ptxas its wheel bundles need no device: ``triton.compile`` with
a ``GPUTarget`` runs the whole pipeline (front end, TTGIR, LLVM, PTX, cubin). The
signature marks pointers and the sizes and strides a real launch passes as multiples of
16, as Triton's specialization does, so the same layouts and vector widths come out.

    python -m tests.fp8_sm90_compile
"""

from __future__ import annotations

import json
import os
import re

assert "TRITON_INTERPRET" not in os.environ or os.environ["TRITON_INTERPRET"] in ("", "0"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.fp8.plan import GemmPlan  # noqa: E402
from tests.sm90_compile import HOPPER  # noqa: E402
from kernels.fp8.triton_gemm import _fp8_gemm_kernel  # noqa: E402
from kernels.fp8.triton_quant import _per_token_group_quant_kernel  # noqa: E402

TARGET = HOPPER
PLANS = {
    "swap fused split-K": GemmPlan(True, 16, 64, 4, 5, split_k=4, fuse_quant=True),
    "swap 32-row split-K": GemmPlan(True, 16, 32, 4, 5, split_k=8),
    "normal tma": GemmPlan(False, 128, 128, 8, 3, tma=True),
    "swap tma split-K pdl": GemmPlan(True, 16, 64, 4, 5, split_k=4, tma=True),
}
PDL_PLANS = ("swap tma split-K pdl",)
DIV16 = ("x_ptr", "xs_ptr", "w_ptr", "w_bytes_ptr", "ws_ptr", "y_ptr", "part_ptr", "count_ptr", "k", "K_BLOCKS", "W_ROWS",
         "stride_xm", "stride_xs", "stride_w", "stride_ws", "stride_ym")


def stats(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    first = lambda pattern: (found.start() if (found := re.search(pattern, ptx)) else -1)  # noqa: E731
    return {"wgmma": count(r"wgmma\.mma_async"), "mma_sync": count(r"mma\.sync"), "tma": count(r"cp\.async\.bulk\.tensor"),
            "cp_async": count(r"cp\.async\.c[ag]"), "atomics": count(r"atom\."), "div_rn": count(r"div\.rn\.f32"),
            "l2_prefetch": count(r"prefetch\.global\.L2"), "first_l2_prefetch": first(r"prefetch\.global\.L2"),
            "first_pdl_wait": first(r"griddepcontrol\.wait"), "first_tma": first(r"cp\.async\.bulk\.tensor")}


def gemm(plan: GemmPlan, pdl: bool = False) -> dict:
    fn = _fp8_gemm_kernel
    sig = dict.fromkeys(fn.arg_names, "i32")
    x_type = "bf16" if plan.fuse_quant else "fp8e4nv"
    sig.update(x_ptr=f"*{x_type}", w_ptr="*fp8e4nv", w_bytes_ptr="*fp8e4nv", xs_ptr="*fp32", ws_ptr="*fp32", y_ptr="*bf16",
               part_ptr="*fp32", count_ptr="*i32", eps="fp32", fp32_max="fp32", fp8_max="fp32")
    if plan.tma:
        sig.update(x_ptr=f"tensordesc<fp8e4nv[{plan.token_tile}, 128]>", w_ptr=f"tensordesc<fp8e4nv[{plan.weight_tile}, 128]>")
    consts = dict(SWAP_AB=plan.swap_ab, X_RAW=plan.fuse_quant, USE_TMA=plan.tma, SPLIT_K=plan.split_k,
                  BLOCK_T=plan.token_tile, BLOCK_W=plan.weight_tile, GROUP=plan.group, PDL=pdl)
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in DIV16 if not (plan.tma and a in ("x_ptr", "w_ptr"))}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                            options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    return stats(kernel)


def quant() -> dict:
    fn = _per_token_group_quant_kernel
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", eps="fp32", fp32_max="fp32", fp8_max="fp32", BLOCK_ROWS="constexpr",
               GROUP="constexpr", PDL="constexpr")
    consts = {"BLOCK_ROWS": 16, "GROUP": 128, "PDL": False}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=TARGET, options={"num_warps": 4})
    return stats(kernel)


# The MoE grouped GEMM's FP8 mode (kernels/moe/gemm/triton_gemm.py): (masked, fused SwiGLU, BLOCK_M).
# (masked, fused SwiGLU, BLOCK_M, quantization inside the GEMM)
GROUPED = {
    "grouped contiguous fused": (False, True, 64, False), "grouped contiguous": (False, False, 128, False),
    "grouped masked fused": (True, True, 16, True), "grouped masked 64": (True, False, 64, True),
}
GROUPED_DIV16 = ("a_ptr", "w_ptr", "c_ptr", "m_indices_ptr", "counts_ptr", "as_ptr", "ws_ptr", "k_dim", "up_offset", "a_k",
                 "stride_am", "stride_we", "stride_wn", "stride_cm")


def grouped(masked: bool, fuse: bool, block_m: int, a_raw: bool) -> dict:
    from kernels.fp8.layout import FP8_DTYPE
    from kernels.moe.gemm.triton_gemm import _grouped_gemm_kernel, gemm_config

    fn = _grouped_gemm_kernel
    cfg = gemm_config(block_m, 4096, 4096, fuse, FP8_DTYPE)
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(a_ptr="*bf16" if a_raw else "*fp8e4nv", w_ptr="*fp8e4nv", c_ptr="*bf16", m_indices_ptr="*i32", counts_ptr="*i32",
               as_ptr="*fp32", ws_ptr="*fp32", eps="fp32", fp32_max="fp32", fp8_max="fp32")
    consts = dict(MASKED=masked, FUSE_SILU=fuse, PRECISION="tf32", FP8=True, A_RAW=a_raw, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
    sig.update(dict.fromkeys(consts, "constexpr"))
    consts.update(stride_ak=1, stride_wk=1, stride_cn=1)  # a launch specializes unit strides so
    sig.update(stride_ak="constexpr", stride_wk="constexpr", stride_cn="constexpr")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in GROUPED_DIV16}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return stats(kernel)


def main() -> None:
    out = {name: gemm(plan, pdl=name in PDL_PLANS) for name, plan in PLANS.items()}
    out["quant"] = quant()
    out.update({name: grouped(*args) for name, args in GROUPED.items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
