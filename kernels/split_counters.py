"""Arrival counters for kernels whose last program reduces (the FP8 split-K GEMM, argmax).

A kernel that splits one output over several programs can merge the partials without a
second launch: each program stores its partial, bumps the output's counter, and the one
that finds it was last merges every partial in split order (so the result does not depend
on which finished last) and resets the counter for the next launch. The counters live in
one buffer per (device, stream): launches on a stream run one after another, so every
counter is back at 0 before the next kernel reads it, whichever kernel that is. Buffers
are never freed: a captured CUDA graph keeps their addresses.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, int], list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters, all 0 between launches, for the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    held = _COUNTERS.setdefault(key, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 4096, 2 * held[-1].numel() if held else 0), dtype=torch.int32, device=device))
    return held[-1]


def all_counters_zero() -> bool:
    """Every counter back at 0 (tests: a launch left nothing for the next one)."""
    return all(not c.any() for held in _COUNTERS.values() for c in held)
