"""Choosing an expert executor: an explicit setting, or automatic from capability checks.

``select_executor(strategy, device, dtype, shape)`` returns the executor and a sentence
saying why (logged once per layer shape). Strategies (``MoEOptions.strategy``):

- ``auto``: ``hybrid`` with the Triton kernels where Triton runs on a CUDA device, else
  ``loop`` (the CPU, or CUDA without Triton). Always something that runs.
- ``loop``, ``contiguous``, ``masked``, ``hybrid``: that executor. The three grouped ones use
  the Triton kernels where Triton runs on the device and the torch references of the same
  kernels elsewhere (the CPU), so an explicit choice never fails for lack of a GPU.
- ``grouped_mm``: ``torch._grouped_mm`` where it runs (a bf16 SM90+ GPU in the torch builds
  we target; torch's CPU build has it too); elsewhere it falls back to what ``auto`` picks,
  and says so.

**FP8 experts** (``fp8=True``: the layer's weights are ``Fp8Experts``). Only the grouped
executors run them. Their GEMMs are Triton where the GPU has FP8 tensor cores
(``kernels.fp8.fp8_gemm_supported``: SM 8.9+), the dequantize-then-matmul references
elsewhere (the CPU; an older GPU keeps its Triton scatter and combine). ``auto`` is the
hybrid with the Triton FP8 GEMMs on such a GPU (its own ``fp8_max_masked_tokens`` crossover,
contiguous only until one is measured), else ``contiguous`` on the references, which on the CPU
costs about what the loop does. ``loop`` and ``grouped_mm`` fall back to ``auto`` and say so.
Off FP8 tensor cores on CUDA the reference GEMMs read expert ids on the host, so those
executors are marked not capturable in a CUDA graph.

**Capability checks never raise.** Each (``triton_usable``, ``sm_version``,
``grouped_mm_usable``, and libs/model/graph_capture.py's ``capturing_graph``) catches
everything and answers False or None: during automatic selection a missing package, an old
GPU or an odd build must steer the choice, not crash the engine (the seed PR's checks
raised during auto selection). Nothing optional is imported or probed at module import:
the first call does it, and caches it.

**CUDA graphs.** The grouped executors are capturable; ``loop`` and ``grouped_mm`` are not
(yet). The MoE block asks ``capturing_graph`` (libs/model/graph_capture.py: the capture, or
the engine's warm-up runs before it) at each call and refuses, with the strategy's
name, to run a non-capturable executor inside a capture (for the hybrid: the one it picks
for the batch inside a capture, which is never ``grouped_mm``: the hybrid captures).

**Hybrid threshold.** Data, not code: hybrid_thresholds.json beside this module, keyed by
GPU name and layer shape, written by ``bench/moe_bench.py --write-thresholds``: the token
count up to which masked wins, (``"large"``) whether our contiguous executor or
``torch._grouped_mm`` was faster on large batches, and where grouped_mm wins
(``"min_grouped_mm_tokens"``: the count from which it was faster at every larger one
measured; contiguous between the two ranges). That is how ``grouped_mm`` competes in
automatic selection: as a measured candidate, used only where it runs, and never inside a
graph capture (contiguous takes its batches there). An entry without the grouped_mm
crossover (measured before it was) sends every batch above the masked range to grouped_mm.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch

from kernels.fp8 import fp8_gemm_supported
from kernels.moe.select import moe_ops_for, reference_moe_ops, triton_moe_ops
from libs.model.moe.executors import (
    ContiguousExecutor,
    ExpertExecutor,
    GroupedMMExecutor,
    HybridExecutor,
    LoopExecutor,
    MaskedExecutor,
)
from libs.model.moe.options import STRATEGIES

log = logging.getLogger(__name__)

THRESHOLDS_PATH = Path(__file__).with_name("hybrid_thresholds.json")


class LayerShape(NamedTuple):
    num_experts: int  # experts computed here (local ones under expert parallelism)
    top_k: int
    hidden: int
    intermediate: int

    def key(self) -> str:
        return f"E{self.num_experts}-k{self.top_k}-H{self.hidden}-I{self.intermediate}"


@dataclass(frozen=True)
class Selection:
    executor: ExpertExecutor
    requested: str
    reason: str


# -- capability checks: never raise ---------------------------------------------------------


def sm_version(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability, or None (not CUDA, no driver, anything odd)."""
    try:
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton.language")
        return True
    except Exception:
        return False


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run for real on ``device`` (a CUDA GPU with triton installed)."""
    try:
        return sm_version(device) is not None and _triton_importable()
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _grouped_mm_probe(device_str: str, dtype: torch.dtype) -> bool:
    """One tiny ``torch._grouped_mm`` call on the device: the build really has a kernel."""
    try:
        device = torch.device(device_str)
        a = torch.zeros((32, 16), dtype=dtype, device=device)
        b = torch.zeros((2, 16, 16), dtype=dtype, device=device)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, b.transpose(1, 2).contiguous().transpose(1, 2), offs=offs)
        return tuple(out.shape) == (32, 16)
    except Exception:
        return False


def grouped_mm_usable(device: torch.device, dtype: torch.dtype, shape: LayerShape) -> bool:
    """``torch._grouped_mm`` exists, takes this dtype on this device, and the layer's rows
    are 16-byte aligned (its stride rule). On CUDA only SM90+ counts: that is where it runs
    CUTLASS grouped GEMMs rather than a fallback."""
    try:
        if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
            return False
        if device.type == "cuda" and (sm_version(device) or (0, 0)) < (9, 0):
            return False
        if device.type not in ("cuda", "cpu"):
            return False
        row_bytes = dtype.itemsize
        if (shape.hidden * row_bytes) % 16 or (shape.intermediate * row_bytes) % 16:
            return False
        return _grouped_mm_probe(str(device), dtype)
    except Exception:
        return False


# -- the hybrid threshold, as data ----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _thresholds(path: Path = THRESHOLDS_PATH) -> dict:
    return json.loads(path.read_text())


def device_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    except Exception:
        return device.type


def hybrid_threshold(device: torch.device, shape: LayerShape, path: Path | None = None) -> tuple[int, dict]:
    """``(max_masked_tokens, its entry)`` for this GPU and layer shape: the most specific
    entry of the data file (device+shape, device default, default+shape, default)."""
    path = path or THRESHOLDS_PATH
    table = _thresholds(path)
    for dev in (device_name(device), "default"):
        by_shape = table.get(dev)
        if not by_shape:
            continue
        for key in (shape.key(), "default"):
            if key in by_shape:
                entry = by_shape[key]
                return int(entry["max_masked_tokens"]), entry
    raise ValueError(f"{path} has no 'default' entry")


# -- selection ------------------------------------------------------------------------------


def _kernels(device: torch.device, fp8: bool = False) -> tuple[SimpleNamespace, str]:
    if fp8:
        if triton_usable(device):
            ops = moe_ops_for(device, fp8=True)
            if ops is triton_moe_ops():
                return ops, "Triton FP8 kernels"
            return ops, "Triton scatter with torch reference FP8 GEMMs (FP8 tensor cores need SM 8.9+)"
        return reference_moe_ops(), "torch reference FP8 kernels (dequantize-then-matmul; Triton FP8 needs an SM 8.9+ GPU)"
    if triton_usable(device):
        return triton_moe_ops(), "Triton kernels"
    return reference_moe_ops(), "torch reference kernels (Triton needs a CUDA GPU)"


def _grouped(kind: type[ExpertExecutor], device: torch.device, fp8: bool) -> tuple[ExpertExecutor, str]:
    """A contiguous or masked executor on this device's kernels."""
    ops, which = _kernels(device, fp8)
    executor = kind(ops)
    if fp8 and device.type == "cuda" and ops is not triton_moe_ops():
        executor.graph_safe = False  # the reference GEMMs read expert ids on the host
    return executor, which


def _hybrid(device: torch.device, dtype: torch.dtype, shape: LayerShape, fp8: bool = False) -> tuple[ExpertExecutor, str]:
    threshold, entry = hybrid_threshold(device, shape)
    note = " (provisional threshold, not yet measured)" if entry.get("provisional") else ""
    if fp8:
        # FP8 experts have their own crossover ("fp8_max_masked_tokens") once measured; until
        # then contiguous only: the bf16 crossover sent Mixtral's 1-token FP8 layer to the
        # masked FP8 GEMM, 4.24 ms against 0.94 ms contiguous at 8 tokens (H100, 2026-11-23).
        threshold = int(entry.get("fp8_max_masked_tokens", 0))
        note += "" if "fp8_max_masked_tokens" in entry else " (FP8 crossover not measured: contiguous only)"
    small, which = _grouped(MaskedExecutor, device, fp8)
    large, _ = _grouped(ContiguousExecutor, device, fp8)
    if not fp8 and entry.get("large") == "grouped_mm" and grouped_mm_usable(device, dtype, shape):
        # From the measured crossover up (an entry without one: right above the masked range).
        start = max(int(entry.get("min_grouped_mm_tokens", threshold + 1)), threshold + 1)
        tiers = f"contiguous up to {start - 1}, grouped_mm from {start}" if start > threshold + 1 else "grouped_mm above"
        return (HybridExecutor(small, large, threshold, GroupedMMExecutor(small.ops), start),
                f"{which}, masked up to {threshold} tokens, {tiers} (contiguous inside a graph capture){note}")
    return HybridExecutor(small, large, threshold), f"{which}, masked up to {threshold} tokens, {large.name} above{note}"


def _auto(device: torch.device, dtype: torch.dtype, shape: LayerShape, fp8: bool = False) -> tuple[ExpertExecutor, str]:
    if fp8 and fp8_gemm_supported(device) and triton_usable(device):
        executor, why = _hybrid(device, dtype, shape, fp8)
        return executor, f"auto: FP8 experts, hybrid with {why}"
    if fp8:
        executor, which = _grouped(ContiguousExecutor, device, fp8)
        return executor, f"auto: FP8 experts, contiguous with {which}"
    if triton_usable(device):
        executor, why = _hybrid(device, dtype, shape)
        return executor, f"auto: hybrid with {why}"
    return LoopExecutor(), f"auto: per-expert loop (no Triton-capable GPU: {device})"


def select_executor(strategy: str, device: torch.device, dtype: torch.dtype, shape: LayerShape, fp8: bool = False) -> Selection:
    """The executor for ``strategy`` on this device; explicit choices are honoured where
    they can run, and a path that cannot (``grouped_mm`` off SM90; ``loop`` or
    ``grouped_mm`` with FP8 experts) falls back to ``auto``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown moe_strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        executor, reason = _auto(device, dtype, shape, fp8)
    elif fp8 and strategy in ("loop", "grouped_mm"):
        executor, why = _auto(device, dtype, shape, fp8)
        reason = f"{strategy} runs dense expert weights only; {why}"
    elif strategy == "loop":
        executor, reason = LoopExecutor(), "loop: per-expert torch matmuls"
    elif strategy == "hybrid":
        executor, why = _hybrid(device, dtype, shape, fp8)
        reason = f"hybrid: {why}"
    elif strategy in ("contiguous", "masked"):
        executor, which = _grouped(ContiguousExecutor if strategy == "contiguous" else MaskedExecutor, device, fp8)
        reason = f"{strategy}: {which}"
    elif grouped_mm_usable(device, dtype, shape):
        ops, _ = _kernels(device)
        executor, reason = GroupedMMExecutor(ops), "grouped_mm: torch._grouped_mm"
    else:
        executor, why = _auto(device, dtype, shape)
        reason = f"grouped_mm unavailable (needs torch._grouped_mm, bf16, an SM90+ GPU or the CPU build, 16-byte rows); {why}"
    return Selection(executor, strategy, reason)
