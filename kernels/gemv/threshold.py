"""Which M take the Triton skinny GEMM on a device: ``threshold.json``, measured data.

A device the file does not name takes cuBLAS at every M (the kernel has to be measured
faster on a device before it serves there). ``TIDEPOOL_SKINNY_MAX_M`` overrides the file
(benchmarks compare both paths in one run with it)."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch

THRESHOLD_FILE = Path(__file__).with_name("threshold.json")
FORMAT = 1
ENV = "TIDEPOOL_SKINNY_MAX_M"


def parse_thresholds(data: dict) -> dict[str, int]:
    """``threshold.json`` -> ``{device name: max_m}``, or a ``ValueError`` naming the problem."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{THRESHOLD_FILE.name}: format {data.get('format')!r} is not {FORMAT}")
    out = {}
    for name, entry in data.get("devices", {}).items():
        value = entry.get("max_m") if isinstance(entry, dict) else None
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{THRESHOLD_FILE.name}: {name}: max_m must be a non-negative int, got {value!r}")
        out[name] = value
    return out


@lru_cache(maxsize=1)
def _thresholds() -> dict[str, int]:
    return parse_thresholds(json.loads(THRESHOLD_FILE.read_text()))


@lru_cache(maxsize=None)
def _device_max_m(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return _thresholds().get(torch.cuda.get_device_name(device), 0)


def skinny_max_m(device: torch.device) -> int:
    """The largest M that takes the Triton kernel on ``device`` (0: none; always 0 off CUDA)."""
    override = os.environ.get(ENV)
    if override is not None:
        if not override.isdigit():
            raise ValueError(f"{ENV} must be a non-negative int, got {override!r}")
        return int(override) if device.type == "cuda" else 0
    return _device_max_m(device)
