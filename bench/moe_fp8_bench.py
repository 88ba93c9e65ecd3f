"""FP8 MoE experts against bf16 ones: the grouped expert GEMMs and the whole expert layer.

Layer shapes with random weights (bench/moe_bench.py's): Mixtral-8x7B (8 experts, top-2,
hidden 4096, intermediate 14336) and Qwen3-30B-A3B (128 experts, top-8, hidden 2048,
intermediate 768); token counts 1, 8, 64, 256 (decode) and 1024, 4096, 16384 (prefill);
routing from a random router's top-k. The FP8 weights are the bf16 ones quantized at load
(``Fp8Experts.quantize``: e4m3, 128x128 block scales per expert). In the same run, on the
same inputs:

``gemm`` rows: the two grouped GEMMs of the experts on one contiguous layout (the scatter
done once, outside the timing; rows padded per expert to the executor's tile):

- ours FP8: per-token-group quantization (Triton) + the FP8 grouped GEMM with SwiGLU fused,
  quantization of its output + the FP8 grouped GEMM (kernels/moe/gemm, ``*_fp8``);
- ours bf16: the bf16 Triton grouped GEMMs, SwiGLU fused;
- ``torch._grouped_mm`` bf16 (CUTLASS on SM90) on the same layout, SwiGLU unfused.

``layer`` rows: the whole expert layer (scatter, GEMMs, combine) as the engine runs it:
``auto`` with FP8 experts (the hybrid with FP8 GEMMs), ``auto`` with bf16 experts, and the
``grouped_mm`` executor (bf16).

FP8's output is checked against bf16's before timing (relative error < 0.15: e4m3 on
both operands of two GEMMs). Reported per row: ms per candidate and the ratios
``fp8 speedup vs ours bf16`` and ``vs torch._grouped_mm`` (> 1: FP8 is faster).

Timing (``--timing``, bench/moe_bench.py's): ``graphs``, the default on CUDA, replays
each candidate from a CUDA graph over differently routed inputs, as the engine's graphs
run the experts; a candidate that cannot be captured (the ``grouped_mm`` executor) is
timed eagerly and named in the row's ``eager``. ``eager`` times one call between two
CUDA events, the Python launches included: at decode sizes that measures the host (FP8
launches a quantization before each GEMM, so twice bf16's kernels), which is how the H100
and H200 rounds up to 2026-11-29 were measured.

GPU (H100): ``python -m bench.moe_fp8_bench --out bench/results/moe_fp8_h100.json
--markdown bench/results/moe_fp8_h100.md`` (about 3 minutes, Triton compilation included).
CPU check of the script (toy shapes, torch reference kernels): ``python -m bench.moe_fp8_bench --toy``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table  # noqa: E402
from bench.moe_bench import CallsTimer, Layer, calls_timer, common_args, grid, head_commit, rel_err, report  # noqa: E402
from kernels.select import ops_for  # noqa: E402
from libs.model.fp8 import Fp8Experts  # noqa: E402
from libs.model.moe import executors as ex  # noqa: E402
from libs.model.moe.strategy import LayerShape, select_executor  # noqa: E402

TOKENS = [1, 8, 64, 256, 1024, 4096, 16384]
TOY_TOKENS = [1, 8, 64]
GEMM = ("ours fp8", "ours bf16", "torch._grouped_mm")
LAYER = ("auto fp8", "auto bf16", "grouped_mm executor")
MAX_FP8_ERR = 0.15


def gemm_candidates(
    layer: Layer, q13: Fp8Experts, q2: Fp8Experts, x: torch.Tensor, ids: torch.Tensor, grouped_mm: bool
) -> tuple[dict[str, Callable[[], torch.Tensor] | None], torch.Tensor]:
    """The experts' two GEMMs on one contiguous layout, per candidate; the layout's used rows."""
    shape, device = layer.shape, layer.device
    ops = select_executor("contiguous", device, torch.bfloat16, shape, fp8=True).executor.ops
    block_m = ex.contiguous_block_m(x.shape[0], shape.top_k, shape.num_experts)
    lay = ops.scatter_contiguous(x, ids, shape.num_experts, block_m)
    silu_and_mul = ops_for(device).silu_and_mul

    def fp8() -> torch.Tensor:
        act = ex.gemm_contiguous(ops, lay.x, q13, lay.m_indices, block_m, fuse_silu_and_mul=True)
        return ex.gemm_contiguous(ops, act, q2, lay.m_indices, block_m)

    def bf16() -> torch.Tensor:
        act = ex.gemm_contiguous(ops, lay.x, layer.w13, lay.m_indices, block_m, fuse_silu_and_mul=True)
        return ex.gemm_contiguous(ops, act, layer.w2, lay.m_indices, block_m)

    def torch_grouped() -> torch.Tensor:
        h = torch._grouped_mm(lay.x, layer.w13.transpose(1, 2), offs=lay.seg_ends)
        return torch._grouped_mm(silu_and_mul(h), layer.w2.transpose(1, 2), offs=lay.seg_ends)

    used = lay.m_indices >= 0
    return {"ours fp8": fp8, "ours bf16": bf16, "torch._grouped_mm": torch_grouped if grouped_mm else None}, used


def layer_candidates(layer: Layer) -> dict[str, ex.ExpertExecutor | None]:
    shape, device = layer.shape, layer.device
    gm = select_executor("grouped_mm", device, torch.bfloat16, shape)
    return {
        "auto fp8": select_executor("auto", device, torch.bfloat16, shape, fp8=True).executor,
        "auto bf16": select_executor("auto", device, torch.bfloat16, shape).executor,
        "grouped_mm executor": gm.executor if gm.executor.name == "grouped_mm" else None,
    }


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    err = rel_err(got, ref)
    if err > MAX_FP8_ERR:
        raise AssertionError(f"{name} differs from bf16 by {err:.3g} ({where})")


def run(shapes: dict[str, LayerShape], tokens: list[int], device: torch.device, time_calls: CallsTimer, routings: int) -> list[dict]:
    results = []
    for name, shape in shapes.items():
        layer = Layer(shape, device)
        q13, q2 = Fp8Experts.quantize(layer.w13, parts=2), Fp8Experts.quantize(layer.w2)
        grouped_mm = select_executor("grouped_mm", device, torch.bfloat16, shape).executor.name == "grouped_mm"
        executors = layer_candidates(layer)
        for t in tokens:
            inputs = layer.routed(t, "topk", routings)
            x, r = inputs[0]
            where = f"{name}, T={t}"
            flops = 6 * t * shape.top_k * shape.hidden * shape.intermediate
            per_input = [gemm_candidates(layer, q13, q2, xi, ri.ids, grouped_mm) for xi, ri in inputs]
            gemms, used = per_input[0]
            _check("fp8 GEMMs", gemms["ours fp8"]()[used], gemms["ours bf16"]()[used], where)
            row = {"shape": name, "tokens": t, "flops": flops, "part": "gemm", "eager": []}
            for c, fn in gemms.items():
                if fn is None:
                    row[c] = None
                    continue
                row[c], eagerly = time_calls([g[c] for g, _ in per_input], True)
                row["eager"] += [c] if eagerly else []
            results.append(row)
            print(json.dumps(row), flush=True)
            weights = {"auto fp8": (q13, q2)}
            ref = executors["auto bf16"](x, r, layer.w13, layer.w2)
            _check("fp8 experts", executors["auto fp8"](x, r, q13, q2), ref, where)
            row = {"shape": name, "tokens": t, "flops": flops, "part": "layer", "eager": [],
                   "fp8 took": executors["auto fp8"].for_tokens(t).name,
                   "fp8 took in a graph": executors["auto fp8"].for_tokens(t, capturing=True).name}
            for c, executor in executors.items():
                w13, w2 = weights.get(c, (layer.w13, layer.w2))
                if executor is None:
                    row[c] = None
                    continue
                calls = [lambda xi=xi, ri=ri, e=executor: e(xi, ri, w13, w2) for xi, ri in inputs]
                row[c], eagerly = time_calls(calls, executor.graph_safe)
                row["eager"] += [c] if eagerly else []
            results.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        fp8, ours, peer = (GEMM if r["part"] == "gemm" else LAYER)
        ms = lambda n: "n/a" if r.get(n) is None else f"{r[n]:.3f}"  # noqa: E731
        ratio = lambda n: "n/a" if r.get(n) is None else f"{r[n] / r[fp8]:.2f}x"  # noqa: E731
        rows.append([r["shape"], r["part"], r["tokens"], ms(fp8), ms(ours), ms(peer), ratio(ours), ratio(peer), f"{r['flops'] / (r[fp8] * 1e-3) / 1e12:.1f}",
                     ", ".join(r.get("eager", [])) or "none"])
    headers = ["shape", "part", "tokens", "fp8 ms", "bf16 ours ms", "bf16 torch._grouped_mm ms", "fp8 speedup vs ours bf16", "fp8 speedup vs torch._grouped_mm", "fp8 TFLOP/s",
               "timed eagerly"]
    return table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes, tokens = grid(args, TOKENS, TOY_TOKENS)
    results = run(shapes, tokens, device, calls_timer(device, args.timing, args.reps, args.warmup), args.routings)
    report(args, device, head_commit(), results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
