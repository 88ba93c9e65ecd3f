"""Timing GPU kernels the way a decode step runs them: replayed from a CUDA graph, with
the weights cold in L2.

``triton.testing.do_bench`` times each call between two events, one call at a time. For
kernels of 5-50 us that measures the host as much as the GPU: whenever the Python
wrapper (checks, allocations, Triton's launcher) takes longer than the L2 flush queued
before it, the GPU idles between the start event and the kernel, and the figure grows by
that gap. The H100 run of bench/fp8_gemm_bench.py showed it: the same kernel, config and
shape at 0.022 ms on one M and 0.088 ms on the next; the quantization kernel anywhere
from 0.006 to 0.04 ms.

Here the calls are captured once in a CUDA graph and the graph is replayed: no host work
between kernels, as in the engine's decode graphs. L2 (50 MB on an H100) would otherwise
keep a 16 MB weight warm from one call to the next; instead each call gets its own copy
of the operands, cycled so that the bytes between two uses of one copy exceed ``cold_bytes``.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable

import torch

COLD_BYTES = 160 << 20  # ~3x an H100's L2


def copies_for(nbytes: int, cold_bytes: int = COLD_BYTES, most: int = 48) -> int:
    """How many copies of ``nbytes`` of operands keep every call cold in L2."""
    return max(1, min(most, math.ceil(cold_bytes / max(nbytes, 1))))


@functools.lru_cache(maxsize=None)
def _capture_stream(device: int) -> torch.cuda.Stream:
    """One side stream per device for every capture (per-stream state is made once)."""
    return torch.cuda.Stream(device)


def graph_ms(calls: list[Callable[[], object]], *, min_calls: int = 24, reps: int = 5) -> float:
    """Median milliseconds per call of ``calls`` (one per operand copy, used in turn),
    captured in one CUDA graph of at least ``min_calls`` calls and replayed ``reps`` times.

    Every call runs once eagerly first, on the capture stream (Triton compiles there and
    per-stream state such as split-K counters exists before the capture)."""
    stream = _capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    stream.synchronize()
    n = math.ceil(min_calls / len(calls)) * len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def kernel_timer(device: torch.device) -> Callable[[list[Callable[[], object]]], float]:
    """Milliseconds per call of a list of calls (one per operand copy): ``graph_ms`` on
    CUDA; on the CPU (the benchmarks' ``--toy`` runs in Triton's interpreter, which only
    check the scripts) one timed call."""
    if device.type == "cuda":
        return lambda calls: graph_ms(calls, min_calls=max(24, len(calls)))

    def cpu(calls: list[Callable[[], object]]) -> float:
        calls[0]()
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e3

    return cpu
