"""Which M take the Triton skinny GEMM on a device, and with which tiles: ``threshold.json``,
measured data (bench/gemv_bench.py).

A device the file does not name takes cuBLAS at every M (the kernel has to be measured
faster on a device before it serves there). ``TIDEPOOL_SKINNY_MAX_M`` overrides the file
(benchmarks compare both paths in one run with it). Per device:

- ``max_m``: the largest M at which the kernel beat cuBLAS on every model's decode-step
  sum; it serves weight shapes the sweep did not measure;
- ``max_m_by_shape`` (optional; files written before it lack it): per weight shape
  ``NxK``, the largest M up to which the kernel beat cuBLAS (with the norm or activation
  each path runs) at every measured M, for the shapes the sweep measured;
- ``configs``: per weight shape ``NxK`` and M, the fastest ``[BLOCK_M, BLOCK_N, BLOCK_K,
  num_warps]`` of the tuning sweep; ``NxK:fp8`` for an FP8 weight of padded shape ``NxK``
  (bench/fp8_gemm_bench.py's sweep);
- ``fp8_max_m`` (optional, 0 when absent): the largest M at which an FP8 layer takes the
  kernel with its e4m3 weight (bench/fp8_gemm_bench.py --write-threshold: where it beat
  the block-scaled FP8 GEMMs of kernels/fp8 on every shape measured), for shapes not in
  ``fp8_max_m_by_shape`` (optional): per padded weight shape ``NxK:fp8``, the largest M
  up to which it beat them at every measured M. ``TIDEPOOL_FP8_SKINNY_MAX_M`` overrides
  both.

``partial_sweeps`` (optional) lists later sweeps of some models only (``--models``, e.g.
one tensor-parallel rank's shard shapes): they added or replaced those shapes' limits and
tiles and left the rest, ``max_m`` included, as the full sweep of ``date`` wrote them."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.device import device_facts

THRESHOLD_FILE = Path(__file__).with_name("threshold.json")
FORMAT = 1
ENV = "TIDEPOOL_SKINNY_MAX_M"
FP8_ENV = "TIDEPOOL_FP8_SKINNY_MAX_M"
MAX_M = 64  # the kernel's largest row count: larger batches are cuBLAS's whatever the file says
FP8_MAX_M = 8  # with an FP8 weight the kernel has no tensor-core path: few rows only (16 measured 4-30x slower than kernels/fp8 on an H200)


Config = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps


class DeviceThreshold(NamedTuple):
    max_m: int
    configs: dict[str, dict[int, Config]]
    max_m_by_shape: dict[str, int]
    fp8_max_m: int = 0
    fp8_max_m_by_shape: dict[str, int] = {}


def _non_negative_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_thresholds(data: dict) -> dict[str, DeviceThreshold]:
    """``threshold.json`` -> ``{device name: DeviceThreshold}``, or a ``ValueError``
    naming the problem."""
    if data.get("format") != FORMAT:
        raise ValueError(f"{THRESHOLD_FILE.name}: format {data.get('format')!r} is not {FORMAT}")
    out = {}
    for name, entry in data.get("devices", {}).items():
        value = entry.get("max_m") if isinstance(entry, dict) else None
        if not _non_negative_int(value):
            raise ValueError(f"{THRESHOLD_FILE.name}: {name}: max_m must be a non-negative int, got {value!r}")
        by_shape = entry.get("max_m_by_shape", {})
        bad = next((f"{k}: {v!r}" for k, v in by_shape.items() if not _non_negative_int(v)), None) if isinstance(by_shape, dict) else repr(by_shape)
        if bad is not None:
            raise ValueError(f"{THRESHOLD_FILE.name}: {name}: max_m_by_shape holds a non-negative int per shape, got {bad}")
        configs: dict[str, dict[int, Config]] = {}
        for shape, by_m in entry.get("configs", {}).items():
            for m, cfg in by_m.items():
                if not (str(m).isdigit() and isinstance(cfg, list) and len(cfg) == 4 and all(isinstance(c, int) and c > 0 for c in cfg)):
                    raise ValueError(f"{THRESHOLD_FILE.name}: {name}: {shape} M={m}: a config is 4 positive ints, got {cfg!r}")
                configs.setdefault(shape, {})[int(m)] = tuple(cfg)
        fp8_max_m, fp8_by_shape = entry.get("fp8_max_m", 0), entry.get("fp8_max_m_by_shape", {})
        if not _non_negative_int(fp8_max_m) or not isinstance(fp8_by_shape, dict) or not all(map(_non_negative_int, fp8_by_shape.values())):
            raise ValueError(f"{THRESHOLD_FILE.name}: {name}: fp8_max_m and fp8_max_m_by_shape's values must be non-negative ints, "
                             f"got {fp8_max_m!r} and {fp8_by_shape!r}")
        out[name] = DeviceThreshold(value, configs, dict(by_shape), fp8_max_m, dict(fp8_by_shape))
    return out


@lru_cache(maxsize=1)
def _thresholds() -> dict[str, DeviceThreshold]:
    return parse_thresholds(json.loads(THRESHOLD_FILE.read_text()))


def reload() -> None:
    """Forget the file's contents (after the benchmark rewrote it)."""
    _thresholds.cache_clear()


def shape_key(n: int, k: int, fp8: bool = False) -> str:
    return f"{n}x{k}:fp8" if fp8 else f"{n}x{k}"


def tuned_config(device_name: str, n: int, k: int, m: int, fp8: bool = False) -> Config | None:
    """The configuration measured fastest for this shape (``fp8``: an FP8 weight of that
    padded shape) at the smallest tuned M >= ``m`` (a tuned M's block of rows holds every
    smaller M), or None."""
    entry = _thresholds().get(device_name)
    by_m = entry.configs.get(shape_key(n, k, fp8), {}) if entry is not None else {}
    fits = [tm for tm in by_m if tm >= m]
    return by_m[min(fits)] if fits else None


def skinny_max_m(device: torch.device, n: int | None = None, k: int | None = None) -> int:
    """The largest M that takes the Triton kernel on ``device`` (0: none; always 0 off
    CUDA), for an ``n x k`` weight when given (its own measured limit where the sweep
    measured that shape, else the device's)."""
    return _max_m(device, n, k, fp8=False)


def fp8_skinny_max_m(device: torch.device, n_pad: int | None = None, k_pad: int | None = None) -> int:
    """The largest M at which an FP8 layer takes the kernel on ``device`` (0: none; always
    0 off CUDA), for a padded ``n_pad x k_pad`` e4m3 weight when given (its own measured
    limit where the sweep measured that shape, else the device's ``fp8_max_m``), or
    ``TIDEPOOL_FP8_SKINNY_MAX_M``."""
    return _max_m(device, n_pad, k_pad, fp8=True)


def _max_m(device: torch.device, n: int | None, k: int | None, fp8: bool) -> int:
    env, cap = (FP8_ENV, FP8_MAX_M) if fp8 else (ENV, MAX_M)
    override = os.environ.get(env)
    if override is not None:
        if not override.isdigit():
            raise ValueError(f"{env} must be a non-negative int, got {override!r}")
        return min(int(override), cap) if device.type == "cuda" else 0
    facts = device_facts(device)
    entry = _thresholds().get(facts[0]) if facts is not None else None
    if entry is None:
        return 0
    overall, by_shape = (entry.fp8_max_m, entry.fp8_max_m_by_shape) if fp8 else (entry.max_m, entry.max_m_by_shape)
    limit = by_shape.get(shape_key(n, k, fp8), overall) if n is not None and k is not None else overall
    return min(limit, cap)
