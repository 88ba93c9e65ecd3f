"""Compile the kernels that take part in programmatic dependent launch (kernels/pdl) for
Hopper (sm_90) without a GPU, with ``PDL`` on and off, and print what their PTX holds as
JSON: run by tests/unit/test_pdl.py in a process of its own (without
``TRITON_INTERPRET``, whose interpreter has no grid dependency control).

Per variant: how many ``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents``
the PTX has, and how many global loads come before the first wait (the skinny GEMM's
weight prefetch where one step covers K, with an FP8 weight its block scales too; decode
attention's step metadata and cached keys; otherwise nothing may be read before it).

    python -m tests.pdl_sm90_compile
"""

from __future__ import annotations

import json
import os
import re

assert "TRITON_INTERPRET" not in os.environ or os.environ["TRITON_INTERPRET"] in ("", "0"), "run without TRITON_INTERPRET"

from tests.sm90_compile import compile_kernel  # noqa: E402

BF16 = {"dtype": "bfloat16"}
# K: the weight's width the launch is for (the wrapper prefetches where BLOCK_K covers it).
SKINNY = dict(module="kernels.gemv.triton_gemv", kernel="_skinny_kernel", ptr="*bf16", floats=("eps", "q_eps", "fp32_max", "fp8_max"),
              K=2048, constexprs=dict(HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RESIDUAL=False, USE_DOT=False, W_FP8=False,
                                      BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, EVEN=False))
KERNELS = {
    "skinny": SKINNY,
    "skinny fp8": {**SKINNY, "ptr_types": {"w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}, "constexprs": {**SKINNY["constexprs"], "W_FP8": True}},
    "skinny norm": {**SKINNY, "constexprs": {**SKINNY["constexprs"], "NORM": True, "HAS_RESIDUAL": True}},
    "skinny several steps": {**SKINNY, "K": 8192, "constexprs": {**SKINNY["constexprs"], "SILU_MUL": True}},
    "skinny dot": {**SKINNY, "K": 4096, "constexprs": {**SKINNY["constexprs"], "USE_DOT": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}},
    "fp8 gemm": dict(module="kernels.fp8.triton_gemm", kernel="_fp8_gemm_kernel", ptr="*fp8e4nv", floats=("eps", "fp32_max", "fp8_max"),
                     ptr_types={"xs_ptr": "*fp32", "ws_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"},
                     constexprs=dict(SWAP_AB=True, X_RAW=False, USE_TMA=False, SPLIT_K=4, BLOCK_T=16, BLOCK_W=64, GROUP=8)),
    "fp8 quant": dict(module="kernels.fp8.triton_quant", kernel="_per_token_group_quant_kernel", ptr="*bf16",
                      floats=("eps", "fp32_max", "fp8_max"), ptr_types={"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                      constexprs=dict(BLOCK_ROWS=16, GROUP=128)),
    "rms_norm": dict(module="kernels.norm.triton_norm", kernel="_rms_norm_kernel", ptr="*bf16", floats=("eps",),
                     constexprs=dict(ADD_RESIDUAL=True, BLOCK=2048)),
    "silu_and_mul": dict(module="kernels.activation.triton_activation", kernel="_silu_and_mul_kernel", ptr="*bf16",
                         constexprs=dict(BLOCK=1024)),
    "decode": dict(module="kernels.attention.triton_decode", kernel="_decode_kernel", ptr="*bf16", floats=("qk_scale",),
                   ptr_types={"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                              "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"},
                   constexprs=dict(HEAD_DIM=64, GROUP=4, SPLIT=True, NATIVE_DOT=True, BLOCK_G=16, BLOCK_N=128, BLOCK_D=64,
                                   BLOCK_SIZE=16, ROPE=True, HALF=32, PREFETCH_KV=True)),
    "decode_reduce": dict(module="kernels.attention.triton_decode", kernel="_decode_reduce_kernel", ptr="*fp32",
                          constexprs=dict(HEAD_DIM=64, BLOCK_S=16, BLOCK_D=64)),
}


def stats(ptx: str) -> dict:
    body = ptx[ptx.index(".entry"):]
    first_wait = body.find("griddepcontrol.wait")
    before = body[:first_wait] if first_wait >= 0 else ""
    return {"wait": body.count("griddepcontrol.wait"), "launch_dependents": body.count("griddepcontrol.launch_dependents"),
            "loads_before_wait": len(re.findall(r"\bld\.global", before))}


def main() -> dict:
    out = {}
    for name, job in KERNELS.items():
        for pdl in (True, False):
            flags = {"PDL": pdl}
            if job["kernel"] == "_skinny_kernel":  # as the wrapper: prefetch where one step covers K
                flags["PREFETCH"] = pdl and job["constexprs"]["BLOCK_K"] >= job["K"]
            kernel = compile_kernel({**job, "constexprs": {**job["constexprs"], **flags}})
            out[f"{name} pdl={pdl}"] = stats(kernel.asm["ptx"])
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
