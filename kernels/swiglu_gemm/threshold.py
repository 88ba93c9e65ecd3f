"""Where the gate/up GEMM with SwiGLU folded in serves, and with which tiles:
``threshold.json``, measured data (bench/swiglu_gemm_bench.py --write-threshold).

Per device name, per gate/up weight shape ``NxK`` (``N = 2 * intermediate``):

- ``min_m``: the smallest row count M from which the fused kernel beat cuBLAS followed by
  ``silu_and_mul`` at every larger M the sweep measured (the sweep stops at the prefill
  graphs' largest bucket; larger M keep its verdict);
- ``configs``: per measured M, the fastest tiles ``[block_m, block_n, block_k, group_m,
  num_stages, num_warps]``; an M between two takes the next larger M's, an M past the
  last the last's.

A device or shape the file does not name keeps the unfused path: the kernel has to be
measured faster on a GPU and shape before it serves there (on the H200 it loses to cuBLAS
at K >= 2048, where cuBLAS's GEMM is faster than the round trip it saves).
``TIDEPOOL_SWIGLU_GEMM`` overrides the file: ``0`` never, ``1`` at every M on CUDA (the
file's tiles, else ``DEFAULT_CONFIG``), so benchmarks can compare both paths in one run.
"""

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
ENV = "TIDEPOOL_SWIGLU_GEMM"
Tiles = tuple[int, int, int, int, int, int]  # a SwigluConfig's fields


class ShapeEntry(NamedTuple):
    min_m: int
    configs: dict[int, Tiles]


def parse_thresholds(data: dict) -> dict[str, dict[str, ShapeEntry]]:
    """``threshold.json`` -> ``{device name: {shape: ShapeEntry}}``, or a ``ValueError``
    naming the problem."""
    name = THRESHOLD_FILE.name
    if data.get("format") != FORMAT:
        raise ValueError(f"{name}: format {data.get('format')!r} is not {FORMAT}")
    out: dict[str, dict[str, ShapeEntry]] = {}
    for device, entry in data.get("devices", {}).items():
        shapes = entry.get("shapes") if isinstance(entry, dict) else None
        if not isinstance(shapes, dict):
            raise ValueError(f"{name}: {device}: 'shapes' must map NxK to an entry")
        parsed = {}
        for shape, e in shapes.items():
            min_m = e.get("min_m") if isinstance(e, dict) else None
            configs = e.get("configs") if isinstance(e, dict) else None
            if not (isinstance(min_m, int) and not isinstance(min_m, bool) and min_m > 0) or not isinstance(configs, dict) or not configs:
                raise ValueError(f"{name}: {device}: {shape}: needs a positive int min_m and a non-empty configs, got {e!r}")
            tiles = {}
            for m, cfg in configs.items():
                if not (str(m).isdigit() and isinstance(cfg, list) and len(cfg) == 6 and all(isinstance(c, int) and c > 0 for c in cfg)):
                    raise ValueError(f"{name}: {device}: {shape} M={m}: a config is 6 positive ints, got {cfg!r}")
                tiles[int(m)] = tuple(cfg)
            parsed[shape] = ShapeEntry(min_m, tiles)
        out[device] = parsed
    return out


@lru_cache(maxsize=1)
def _thresholds() -> dict[str, dict[str, ShapeEntry]]:
    return parse_thresholds(json.loads(THRESHOLD_FILE.read_text()))


def reload() -> None:
    """Forget the file's contents (after the benchmark rewrote it)."""
    _thresholds.cache_clear()


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def _tiles_at(configs: dict[int, Tiles], m: int) -> Tiles:
    fits = [tm for tm in configs if tm >= m]
    return configs[min(fits) if fits else max(configs)]


def swiglu_gemm_config(device: torch.device, n: int, k: int, m: int):
    """The tiles (a ``SwigluConfig``) with which an ``[m, k]`` input and an ``n x k``
    gate/up weight take the fused kernel on ``device``, or None where the unfused path
    serves (always off CUDA)."""
    from kernels.swiglu_gemm.triton_swiglu_gemm import DEFAULT_CONFIG, SwigluConfig

    if device.type != "cuda":
        return None
    override = os.environ.get(ENV)
    if override not in (None, "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {override!r}")
    if override == "0":
        return None
    facts = device_facts(device)
    entry = _thresholds().get(facts[0], {}).get(shape_key(n, k)) if facts is not None else None
    if override == "1":
        return SwigluConfig(*_tiles_at(entry.configs, m)) if entry is not None else DEFAULT_CONFIG
    if entry is None or m < entry.min_m:
        return None
    return SwigluConfig(*_tiles_at(entry.configs, m))
