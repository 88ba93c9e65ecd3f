"""Which M take the Triton skinny GEMM on a device, and with which tiles: ``threshold.json``,
measured data (bench/gemv_bench.py).

A device the file does not name takes cuBLAS at every M (the kernel has to be measured
faster on a device before it serves there). ``TIDEPOOL_SKINNY_MAX_M`` overrides the file
(benchmarks compare both paths in one run with it). ``configs`` holds, per weight shape
``NxK`` and M, the fastest ``[BLOCK_M, BLOCK_N, BLOCK_K, num_warps]`` of the tuning sweep."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch

from kernels.device import device_facts

THRESHOLD_FILE = Path(__file__).with_name("threshold.json")
FORMAT = 1
ENV = "TIDEPOOL_SKINNY_MAX_M"


Config = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps


def parse_thresholds(data: dict) -> dict[str, tuple[int, dict[str, dict[int, Config]]]]:
    """``threshold.json`` -> ``{device name: (max_m, {"NxK": {M: config}})}``, or a
    ``ValueError`` naming the problem."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{THRESHOLD_FILE.name}: format {data.get('format')!r} is not {FORMAT}")
    out = {}
    for name, entry in data.get("devices", {}).items():
        value = entry.get("max_m") if isinstance(entry, dict) else None
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{THRESHOLD_FILE.name}: {name}: max_m must be a non-negative int, got {value!r}")
        configs: dict[str, dict[int, Config]] = {}
        for shape, by_m in entry.get("configs", {}).items():
            for m, cfg in by_m.items():
                if not (str(m).isdigit() and isinstance(cfg, list) and len(cfg) == 4 and all(isinstance(c, int) and c > 0 for c in cfg)):
                    raise ValueError(f"{THRESHOLD_FILE.name}: {name}: {shape} M={m}: a config is 4 positive ints, got {cfg!r}")
                configs.setdefault(shape, {})[int(m)] = tuple(cfg)
        out[name] = (value, configs)
    return out


@lru_cache(maxsize=1)
def _thresholds() -> dict[str, tuple[int, dict[str, dict[int, Config]]]]:
    return parse_thresholds(json.loads(THRESHOLD_FILE.read_text()))


def reload() -> None:
    """Forget the file's contents (after the benchmark rewrote it)."""
    _thresholds.cache_clear()


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def tuned_config(device_name: str, n: int, k: int, m: int) -> Config | None:
    """The configuration measured fastest for this shape at the smallest tuned M >= ``m``
    (a tuned M's block of rows holds every smaller M), or None."""
    by_m = _thresholds().get(device_name, (0, {}))[1].get(shape_key(n, k), {})
    fits = [tm for tm in by_m if tm >= m]
    return by_m[min(fits)] if fits else None


def skinny_max_m(device: torch.device) -> int:
    """The largest M that takes the Triton kernel on ``device`` (0: none; always 0 off CUDA)."""
    override = os.environ.get(ENV)
    if override is not None:
        if not override.isdigit():
            raise ValueError(f"{ENV} must be a non-negative int, got {override!r}")
        return int(override) if device.type == "cuda" else 0
    facts = device_facts(device)
    return _thresholds().get(facts[0], (0, {}))[0] if facts is not None else 0
