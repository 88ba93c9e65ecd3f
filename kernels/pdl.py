"""Programmatic dependent launch (PDL): a decode step's kernels overlap their neighbours'
launch and ramp instead of queuing behind them.

Why: at batch 1 a decode step is ~100-300 small kernels, each bound by the bytes of one
weight. Launched the ordinary way, a kernel's programs are placed only once the previous
kernel has finished, and its first loads only then leave for memory, so every boundary
costs a launch plus a memory latency during which the GPU streams nothing: 3-5 us per
projection on an H200 against 2-8 us of bytes (bench/RESULTS.md, issue 10, round 5). On
Hopper (SM90+), a kernel launched with the programmatic-stream-serialization attribute
(Triton's ``launch_pdl=True``) may start as soon as every program of the previous kernel
has executed ``griddepcontrol.launch_dependents``; it must execute
``griddepcontrol.wait`` before it reads anything the previous kernel wrote, or writes
anything at all. CUDA graphs keep the attribute as a programmatic edge.

The contract every kernel here follows, which makes the overlap safe:

- before ``pdl_wait``, a program only *reads*, and only a weight its caller declared
  static (the skinny GEMM's ``static_weight``: a loaded model's). Nothing the previous
  kernel wrote is guaranteed visible before the wait, so a weight some kernel may just
  have written (a test's ``torch.randn``, a conversion at load) waits like any input;
- the one exception: what kernels at least two launches back on the stream wrote. Kernel
  N+1 starts only once every program of N has passed its own wait, i.e. once N-1 and
  everything before it has completed, so their writes are visible. Decode attention
  (kernels/attention) reads its step's lengths, positions, slots and block tables, and the
  keys and values earlier steps cached, before its wait; its caller guarantees the launch
  right before it (the qkv projection, or the KV store) writes none of them except the new
  token's K and V, which it reads after;
- a prefetch into L2 (kernels/fp8's GEMM asks for its weight rows' first lines) is not a
  read: nothing comes back to the program, and L2 is where every SM's writes meet, so it
  may come before the wait whoever wrote the bytes;
- every program calls ``pdl_wait`` (``gdc_wait``, then ``gdc_launch_dependents``) before
  any other read and before any write. So kernel N+1 can run its prologue while kernel N
  computes, but nothing of N+1 that depends on N, and nothing that N or N-1 could still
  read, happens before N has completed; since N itself waited for N-1, completion is
  transitive, and a kernel launched the ordinary way (cuBLAS, torch) after a PDL one waits
  for it in full as before.

``pdl_launch(device)`` gives a launch's keyword arguments: ``PDL`` (the kernels'
constexpr) and Triton's ``launch_pdl``, both on only where the GPU has PDL (compute
capability 9.0+) and ``TIDEPOOL_PDL`` is not ``0``. Triton's interpreter has no grid
dependency control, so on the CPU ``PDL`` is off and the kernels run as before.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "TIDEPOOL_PDL"
_MIN_CAPABILITY = (9, 0)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (and so for every kernel before it) to complete, then
    let the next kernel's programs start: call before reading what the step computed and
    before writing anything. A no-op without ``PDL``."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


def pdl_enabled(device: torch.device | str | None) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA GPU of compute capability 9.0+ (never
    the interpreter), unless ``TIDEPOOL_PDL=0``."""
    if device is None or os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    return _capable(dev.index if dev.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device | str | None) -> dict:
    """Keyword arguments for a launch of a kernel that calls ``pdl_wait(PDL)``."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}
