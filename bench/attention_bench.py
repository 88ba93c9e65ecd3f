"""Paged attention on a GPU: the Triton kernels against the torch reference.

SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64), block size 16, bf16, in
the engine's block-major cache with all 30 layers (so each layer's K/V are strided views and
a decode step's 30 layers touch 30 different slices of the cache, as in serving).

Decode, batch 1/16/64 x context 256/1024/2048/4096 (every sequence at that context, block
tables exactly as wide as needed), per layer:

- graph: the 30 layers' ``paged_decode_attention`` calls captured in one CUDA graph,
  replayed, time / 30. This is what the engine's captured decode step pays per layer;
  KV bytes / time gives the bandwidth column.
- eager: 30 back-to-back calls without a graph, time / 30 (host launch cost included).
- reference: one eager call of the torch reference (a gather and SDPA per sequence).
- splits: the split-K count the host heuristic picked.

Prefill, 16 sequences x 1024 new tokens (no prefix), and 16 x 512-token chunks after a
1024-token cached prefix: ``paged_prefill_attention`` vs the reference, plus dense causal
SDPA (flash attention) on contiguous, unpaged tensors of the same shape as a lower bound.

Times are medians of CUDA-event timings. ``--sweep`` adds tuning tables: the graph time of
every forced split count (to check the host heuristic), of decode tile widths and warp
counts, and of prefill tile shapes (set through the kernel modules' constants).

Run on a GPU: ``python3 bench/attention_bench.py [--sweep] [--markdown bench/results/attention.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from bench.swap_bench import median_ms  # noqa: E402  (CUDA-event median, shared with the swap bench)
from kernels.attention import reference as ref  # noqa: E402
from kernels.attention import triton_attention as tri  # noqa: E402
from kernels.attention.problems import PagedProblem, make_decode_problem, make_problem  # noqa: E402

DEVICE = "cuda"
LAYERS = 30
MODEL = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64)
CONTEXTS = (256, 1024, 2048, 4096)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
DECODE_TUNE_CASES = ((1, 4096), (16, 1024), (64, 1024), (64, 4096))
DECODE_TILES = [(n, w, st) for n, w in ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8))
                for st in (2, 3, 4)]
PREFILL_TILES = [(m, n, w, st) for m, n in ((64, 64), (128, 64), (128, 128)) for w in (4, 8)
                 for st in (2, 3)]


def graph_ms(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Capture ``calls`` back to back in one CUDA graph; median replay time per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = median_ms(graph.replay, reps, 2) / len(calls)
    del graph
    return ms


def layer_views(p: PagedProblem) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(p.cache[:, layer, 0], p.cache[:, layer, 1]) for layer in range(p.cache.shape[1])]


def decode_problem(batch: int, context: int) -> PagedProblem:
    return make_decode_problem([context] * batch, dtype=DTYPE, device=DEVICE, num_layers=LAYERS,
                               extra_table_width=0, spare_blocks=1, **MODEL)


def decode_calls(p: PagedProblem, splits: int | None = None) -> list[Callable[[], object]]:
    """One decode attention call per layer; ``splits`` forces the split count."""
    q, tables, lens, scale = p.q, p.block_tables, p.seq_lens, p.scale

    def layer_call(k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
        if splits is None:
            return lambda: tri.paged_decode_attention(q, k, v, tables, lens, scale)
        return lambda: tri.paged_decode_attention_splits(q, k, v, tables, lens, scale,
                                                         num_splits=splits)

    return [layer_call(k, v) for k, v in layer_views(p)]


def with_constants(fn: Callable[[], float], **constants: int) -> float:
    """Run ``fn`` with the kernels' tiling constants temporarily replaced (``_DECODE_*`` in
    kernels/attention/triton_decode.py, ``_PREFILL_*`` in triton_prefill.py)."""
    from kernels.attention import triton_decode, triton_prefill

    owners = {name: triton_prefill if name.startswith("_PREFILL") else triton_decode for name in constants}
    saved = {name: getattr(owners[name], name) for name in constants}
    for name, value in constants.items():
        setattr(owners[name], name, value)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            setattr(owners[name], name, value)


def decode_rows(sweep: bool) -> tuple[list[str], list[str]]:
    rows, sweep_rows = [], []
    for batch in BATCHES:
        for context in CONTEXTS:
            p = decode_problem(batch, context)
            q, tables = p.q, p.block_tables
            calls = decode_calls(p)
            graph = graph_ms(calls)

            def eager_step():
                for call in calls:
                    call()

            eager = median_ms(eager_step, 10, 2) / LAYERS
            reference = median_ms(lambda: ref.paged_decode_attention(*p.decode_args()), 3, 2)
            splits = tri.decode_num_splits(batch, 3, tables.shape[1] * p.block_size, q.device)
            kv_bytes = 2 * batch * context * 3 * 64 * p.cache.element_size()
            rows.append(
                f"| {batch} | {context} | {splits} | {graph * 1e3:.1f} | {graph * LAYERS:.3f} | "
                f"{kv_bytes / graph / 1e6:.0f} | {eager * 1e3:.1f} | {reference * 1e3:.0f} | "
                f"{reference / graph:.0f}x |"
            )
            print(rows[-1], flush=True)
            if sweep:
                times = []
                for forced in SWEEP_SPLITS:
                    if forced > 1 and context // forced < 64:
                        times.append("-")
                        continue
                    t = graph_ms(decode_calls(p, forced))
                    times.append(f"{t * 1e3:.1f}")
                sweep_rows.append(f"| {batch} | {context} | {splits} | " + " | ".join(times) + " |")
                print(sweep_rows[-1], flush=True)
            del p, calls
            torch.cuda.empty_cache()
    return rows, sweep_rows


def decode_tile_rows() -> list[str]:
    """Graph µs per layer for each (keys per tile, warps, stages), heuristic split count."""
    rows = []
    for batch, context in DECODE_TUNE_CASES:
        p = decode_problem(batch, context)
        calls = decode_calls(p)
        times = [
            with_constants(lambda: graph_ms(calls), _DECODE_BLOCK_N=block_n,
                           _DECODE_NUM_WARPS=warps, _DECODE_NUM_STAGES=stages)
            for block_n, warps, stages in DECODE_TILES
        ]
        rows.append(f"| {batch} | {context} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " |")
        print(rows[-1], flush=True)
        del p, calls
        torch.cuda.empty_cache()
    return rows


def causal_flops(query_lens: list[int], context_lens: list[int]) -> float:
    """QK^T and PV multiply-adds over the visible (causal) keys only."""
    visible = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens))
    return 4.0 * visible * MODEL["num_heads"] * MODEL["head_dim"]


PREFILL_CASES = (("16 x 1024", 1024, 0), ("16 x 512 after 1024 cached", 512, 1024))


def prefill_problem(q_len: int, prefix: int) -> PagedProblem:
    return make_problem([q_len] * 16, [q_len + prefix] * 16, dtype=DTYPE, device=DEVICE,
                        num_layers=LAYERS, extra_table_width=0, spare_blocks=1, **MODEL)


def prefill_rows() -> list[str]:
    rows = []
    for name, q_len, prefix in PREFILL_CASES:
        query_lens, context = [q_len] * 16, [q_len + prefix] * 16
        p = prefill_problem(q_len, prefix)
        ours = median_ms(lambda: tri.paged_prefill_attention(*p.prefill_args()), 20, 3)
        reference = median_ms(lambda: ref.paged_prefill_attention(*p.prefill_args()), 5, 2)
        # Dense, unpaged flash attention of the same shape (no prefix: a pure causal square).
        dense_q = torch.randn((16, 9, q_len, 64), dtype=DTYPE, device=DEVICE)
        dense_kv = torch.randn((16, 3, q_len + prefix, 64), dtype=DTYPE, device=DEVICE)
        if prefix == 0:
            dense = median_ms(lambda: F.scaled_dot_product_attention(
                dense_q, dense_kv, dense_kv, is_causal=True, enable_gqa=True), 20, 2)
            dense_text = f"{dense * 1e3:.0f}"
        else:
            dense_text = "-"
        tflops = causal_flops(query_lens, context) / (ours * 1e-3) / 1e12
        rows.append(f"| {name} | {ours * 1e3:.0f} | {tflops:.0f} | {reference * 1e3:.0f} | "
                    f"{reference / ours:.1f}x | {dense_text} |")
        print(rows[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def prefill_tile_rows() -> list[str]:
    """Triton µs for each (query rows, keys per tile, warps, stages)."""
    rows = []
    for name, q_len, prefix in PREFILL_CASES:
        p = prefill_problem(q_len, prefix)
        times = [
            with_constants(
                lambda: median_ms(lambda: tri.paged_prefill_attention(*p.prefill_args()), 10, 2),
                _PREFILL_BLOCK_M=m, _PREFILL_BLOCK_N=n, _PREFILL_NUM_WARPS=warps,
                _PREFILL_NUM_STAGES=stages)
            for m, n, warps, stages in PREFILL_TILES
        ]
        rows.append(f"| {name} | " + " | ".join(f"{t * 1e3:.0f}" for t in times) + " |")
        print(rows[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time every forced split count")
    parser.add_argument("--markdown", type=Path, help="write the tables to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench needs CUDA")

    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today()}; SmolLM2 attention (9/3 heads x 64), block 16, bf16, "
              f"{LAYERS}-layer block-major cache")
    print(header, flush=True)
    if args.sweep:
        print("(with --sweep, each decode row is followed by its graph µs per layer at "
              f"forced split counts {SWEEP_SPLITS})", flush=True)
    decode_head = ("| batch | context | splits | graph µs/layer | 30 layers ms | GB/s | eager µs/call "
                   "| reference µs | speedup (graph) |\n|---|---|---|---|---|---|---|---|---|")
    print(decode_head, flush=True)
    decode, sweep = decode_rows(args.sweep)
    prefill_head = ("| prefill | Triton µs | TFLOP/s | reference µs | speedup | dense SDPA µs |\n"
                    "|---|---|---|---|---|---|")
    print(prefill_head, flush=True)
    prefill = prefill_rows()
    decode_tiles, prefill_tiles = [], []
    if args.sweep:
        print("decode tiles, graph µs per layer:", DECODE_TILES, flush=True)
        decode_tiles = decode_tile_rows()
        print("prefill tiles, µs:", PREFILL_TILES, flush=True)
        prefill_tiles = prefill_tile_rows()

    parts = [f"# Paged attention\n\n{header}\n", "## Decode\n", decode_head, *decode, ""]
    if sweep:
        sweep_head = ("| batch | context | picked | " + " | ".join(f"{s} split" for s in SWEEP_SPLITS)
                      + " |\n|---|---|---|" + "---|" * len(SWEEP_SPLITS))
        parts += ["## Decode split sweep (graph µs per layer)\n", sweep_head, *sweep, ""]
    parts += ["## Prefill\n", prefill_head, *prefill, ""]
    if decode_tiles:
        head = ("| batch | context | " + " | ".join(f"N{n} w{w} s{st}" for n, w, st in DECODE_TILES)
                + " |\n|---|---|" + "---|" * len(DECODE_TILES))
        parts += ["## Decode tiles (graph µs per layer; N keys per tile, w warps, s stages)\n", head,
                  *decode_tiles, ""]
    if prefill_tiles:
        head = ("| prefill | " + " | ".join(f"M{m} N{n} w{w} s{st}" for m, n, w, st in PREFILL_TILES)
                + " |\n|---|" + "---|" * len(PREFILL_TILES))
        parts += ["## Prefill tiles (µs; M query rows, N keys per tile, w warps, s stages)\n", head,
                  *prefill_tiles, ""]
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(parts))


if __name__ == "__main__":
    main()
