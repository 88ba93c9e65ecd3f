"""How one FP8 GEMM is tiled: ``GemmPlan``, and ``plan_gemm``, which picks one.

Two data files decide, both written on a GPU by the benchmarks and read here at launch:

- ``swap_ab_threshold.json`` (``bench/fp8_gemm_bench.py --write-threshold``): the largest M
  that takes the swap-AB variant (the issue asks for the threshold as data): a default,
  and per device name where a GPU measured its own (``by_device``; a file without that
  field, the first form, is still read: every device takes the default);
- ``gemm_configs.json`` (``bench/fp8_tune.py``): per device name, per weight shape
  ``N_pad x K_pad`` and variant, the fastest tile configuration measured for each M bucket
  (an entry tuned at M = 16 serves 4 < m <= 16 when the tuned Ms are ..., 4, 16, ...;
  past the last tuned M only if that one is large).

Where neither has an answer (a device or a shape that was not tuned, the CPU) a heuristic
plan runs: the tiles the kernels had before tuning, plus split-K where the weight's row
tiles cannot fill the GPU's SMs on their own (few rows, long K: Llama's down projection
at decode sizes), and the activation quantization fused into the GEMM for a handful of
tokens (one launch per linear layer instead of two).

Backward compatibility of the serialized form (seed 000's reviewers flagged a config
object whose pickled form changed incompatibly): ``GemmPlan.to_dict`` writes every field
and ``from_dict`` reads any older form. The fields of the first release (``swap_ab``,
``token_tile``, ``weight_tile``, ``num_warps``, ``num_stages``) are required; every field
added since has a default that means "what the kernel did before the field existed", so
an old file or message still describes the same launch. Unknown keys are refused (a
typo must not silently become a default).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kernels.device import device_facts
from kernels.fp8.layout import BLOCK, padded

THRESHOLD_FILE = Path(__file__).with_name("swap_ab_threshold.json")
CUBLAS_THRESHOLD_FILE = Path(__file__).with_name("cublas_threshold.json")
CONFIGS_FILE = Path(__file__).with_name("gemm_configs.json")
CONFIGS_FORMAT = 1
VARIANTS = ("swap_ab", "normal")
LARGE_M = 1024  # a tuned bucket this large also serves the Ms above it

_POWERS_OF_TWO = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GemmPlan:
    """The launch of one ``[M, K] x [N, K]^T`` block-scaled GEMM.

    - ``swap_ab``: compute ``(W X^T)^T``: the weight's rows fill the MMA's M dimension
      (64+ rows on Hopper) and the few tokens its N dimension (8+), instead of padding a
      handful of tokens to a 64-row tile.
    - ``token_tile``: tokens per program; pre-quantized activations must be padded to a
      multiple of it (``row_multiple``).
    - ``weight_tile``: weight rows per program (any power of two from 16 to 256: the
      kernel reads each row's block scale, so a tile may span two 128-row blocks).
    - ``num_warps``, ``num_stages``: Triton's launch options (warps per program, depth of
      the software pipeline over K).
    - ``group``: programs that share a band of left-operand tiles run next to each other,
      so the right operand's tiles they all read stay in L2 (Triton's grouped ordering).
    - ``split_k``: the K blocks are shared out over this many programs per output tile;
      each writes an fp32 partial and the last to finish sums them in a fixed order
      (deterministic), so a weight of few rows still keeps every SM streaming.
    - ``fuse_quant``: the GEMM reads the unquantized activations and quantizes each
      ``[tokens, 128]`` group in registers, bit-identical to ``per_token_group_quant``:
      one launch per linear layer instead of two, and no padded copy (worth it for few
      tokens, where every program re-quantizing the same activations costs nothing).
    - ``tma``: pre-quantized operands are read through TMA tensor descriptors instead of
      pointer loads (Hopper+; only the tuner turns it on, where it measured faster).
    """

    swap_ab: bool
    token_tile: int
    weight_tile: int
    num_warps: int
    num_stages: int
    group: int = 8
    split_k: int = 1
    fuse_quant: bool = False
    tma: bool = False

    def __post_init__(self) -> None:
        if self.token_tile not in _POWERS_OF_TWO or self.weight_tile not in _POWERS_OF_TWO:
            raise ValueError(f"token_tile and weight_tile must be one of {_POWERS_OF_TWO}, got {self.token_tile}, {self.weight_tile}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_warps must be a power of two up to 16 and num_stages in 1..8, got {self.num_warps}, {self.num_stages}")
        if not 1 <= self.group <= 64 or not 1 <= self.split_k <= 16:
            raise ValueError(f"group must be in 1..64 and split_k in 1..16, got {self.group}, {self.split_k}")
        if self.fuse_quant and self.tma:
            raise ValueError("tma reads pre-quantized operands; a plan that fuses the quantization cannot use it")

    @property
    def row_multiple(self) -> int:
        """What ``per_token_group_quant(..., row_multiple=)`` must pad the tokens to."""
        return self.token_tile

    @property
    def label(self) -> str:
        """A short description, for benchmark tables and logs."""
        extras = [f"split{self.split_k}"] * (self.split_k > 1) + ["fused"] * self.fuse_quant + ["tma"] * self.tma
        tiles = f"t{self.token_tile} w{self.weight_tile} {self.num_warps}w{self.num_stages}s"
        return " ".join([("swap" if self.swap_ab else "normal"), tiles, *extras])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GemmPlan":
        """Any serialized form, old or new (see the module docstring)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown GemmPlan field(s) {unknown}; known: {sorted(fields)}")
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
        if missing:
            raise ValueError(f"GemmPlan is missing required field(s) {missing}")
        kinds = {"swap_ab": bool, "fuse_quant": bool, "tma": bool}
        for name, value in data.items():
            want = kinds.get(name, int)
            if type(value) is not want:
                raise ValueError(f"GemmPlan field {name!r} must be {want.__name__}, got {value!r}")
        return cls(**data)


def parse_swap_ab_threshold(data: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """``swap_ab_threshold.json`` -> (the default, {device name: its own}), or a
    ``ValueError`` naming what is wrong. ``by_device`` is optional (the first form had
    only the default)."""

    def checked(value: Any, where: str) -> int:
        if type(value) is not int or value < 0:
            raise ValueError(f"{THRESHOLD_FILE}: {where} must be a non-negative int, got {value!r}")
        return value

    default = checked(data.get("swap_ab_max_m"), "swap_ab_max_m")
    by_device = data.get("by_device", {})
    if not isinstance(by_device, dict):
        raise ValueError(f"{THRESHOLD_FILE}: by_device must map device names to entries, got {by_device!r}")
    return default, {name: checked(entry.get("swap_ab_max_m") if isinstance(entry, dict) else None, f"by_device[{name!r}].swap_ab_max_m")
                     for name, entry in by_device.items()}


@lru_cache(maxsize=None)
def swap_ab_max_m(device_name: str | None = None) -> int:
    """The largest M that takes the swap-AB variant on ``device_name`` (the default for a
    device that did not measure its own, and for None): data, written by
    ``bench/fp8_gemm_bench.py --write-threshold`` from measured timings."""
    default, by_device = parse_swap_ab_threshold(json.loads(THRESHOLD_FILE.read_text()))
    return by_device.get(device_name, default) if device_name is not None else default


@lru_cache(maxsize=1)
def cublas_min_m() -> int:
    """The smallest M that takes cuBLASLt's block-scaled GEMM (kernels/fp8/cublas_gemm.py)
    where it runs: data, written by ``bench/fp8_gemm_bench.py --write-threshold``."""
    data = json.loads(CUBLAS_THRESHOLD_FILE.read_text())
    value = data["cublas_min_m"]
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{CUBLAS_THRESHOLD_FILE}: cublas_min_m must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class TunedEntry:
    max_m: int
    plan: GemmPlan


def parse_configs(data: dict[str, Any]) -> dict[str, dict[str, dict[str, list[TunedEntry]]]]:
    """``gemm_configs.json`` -> ``{device: {"NxK": {variant: [entries by max_m]}}}``, or a
    ``ValueError`` saying what is wrong with it."""
    if data.get("format") != CONFIGS_FORMAT:
        raise ValueError(f"gemm configs format {data.get('format')!r} is not {CONFIGS_FORMAT}")
    out: dict[str, dict[str, dict[str, list[TunedEntry]]]] = {}
    for device, entry in data.get("devices", {}).items():
        shapes = out.setdefault(device, {})
        for shape, variants in entry.get("shapes", {}).items():
            for variant, rows in variants.items():
                if variant not in VARIANTS:
                    raise ValueError(f"{device} {shape}: unknown variant {variant!r}")
                entries = sorted((TunedEntry(int(r["max_m"]), GemmPlan.from_dict(r["plan"])) for r in rows), key=lambda e: e.max_m)
                if any(e.plan.swap_ab != (variant == "swap_ab") for e in entries):
                    raise ValueError(f"{device} {shape} {variant}: a plan of the other variant")
                shapes.setdefault(shape, {})[variant] = entries
    return out


@lru_cache(maxsize=1)
def tuned_configs() -> dict[str, dict[str, dict[str, list[TunedEntry]]]]:
    """The tuned table; empty when the file does not exist (nothing tuned yet)."""
    if not CONFIGS_FILE.exists():
        return {}
    return parse_configs(json.loads(CONFIGS_FILE.read_text()))


def shape_key(n_pad: int, k_pad: int) -> str:
    return f"{n_pad}x{k_pad}"


def tuned_plan(m: int, n_pad: int, k_pad: int, swap_ab: bool, device_name: str) -> GemmPlan | None:
    """The tuned plan of the smallest M bucket that holds ``m``, or None where this
    device, shape or variant was not tuned. Past the last bucket, the last one's plan
    only if that bucket is already a large M (``LARGE_M``): a plan tuned for 64 tokens
    (split-K, fused quantization) says nothing about a prefill of 8192."""
    entries = tuned_configs().get(device_name, {}).get(shape_key(n_pad, k_pad), {}).get("swap_ab" if swap_ab else "normal")
    if not entries or (m > entries[-1].max_m and entries[-1].max_m < LARGE_M):
        return None
    plan = next((e.plan for e in entries if e.max_m >= m), entries[-1].plan)
    return plan if n_pad % plan.weight_tile == 0 else None


def heuristic_plan(m: int, swap_ab: bool, n_pad: int | None = None, k_pad: int | None = None, num_sms: int | None = None) -> GemmPlan:
    """The untuned plan. Split-K only where the SM count and the shape are known. The
    quantization stays a kernel of its own: the fused form measured 2-7x slower at
    M <= 16 on the H200 (113 against 17 us on 6144 x 4096 at M = 1; bench/RESULTS.md), and
    no tune on the H100 or H200 picked it."""
    if swap_ab:
        # The tokens become the MMA's N: 16 is the smallest tile every FP8 MMA takes.
        tile = min(max(16, 1 << (m - 1).bit_length()), 64)
        split = 1
        if num_sms and n_pad and k_pad:
            tiles = (n_pad // 64) * (padded(m, tile) // tile)
            k_blocks = k_pad // BLOCK
            # Enough programs to keep every SM streaming, each still with 8+ K blocks.
            while split < 8 and tiles * split * 2 <= num_sms and k_blocks >= 16 * split:
                split *= 2
        return GemmPlan(True, token_tile=tile, weight_tile=64, num_warps=4, num_stages=4, split_k=split)
    if m <= 64:
        return GemmPlan(False, token_tile=64, weight_tile=128, num_warps=4, num_stages=4)
    return GemmPlan(False, token_tile=128, weight_tile=128, num_warps=8, num_stages=3)


def plan_gemm(
    m: int, *, swap_ab: bool | None = None, n: int | None = None, k: int | None = None, device: torch.device | str | None = None
) -> GemmPlan:
    """The plan for ``m`` tokens against an ``[n, k]`` weight on ``device``.

    ``swap_ab=None`` decides the variant by the stored threshold. With the shape and a
    CUDA device, the tuned table answers where it can; otherwise the heuristic. Memoized:
    a linear layer asks on every call."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    return _plan_gemm(m, swap_ab, n, k, device)


def reload() -> None:
    """Forget the data files read so far (the tuner and the benchmark rewrite them)."""
    for cached in (swap_ab_max_m, cublas_min_m, tuned_configs, _plan_gemm):
        cached.cache_clear()


@lru_cache(maxsize=4096)
def _plan_gemm(m: int, swap_ab: bool | None, n: int | None, k: int | None, device: torch.device | str | None) -> GemmPlan:
    facts = device_facts(device)
    if swap_ab is None:
        swap_ab = m <= swap_ab_max_m(facts[0] if facts else None)
    n_pad = None if n is None else padded(n)
    k_pad = None if k is None else padded(k)
    if facts is not None and n_pad and k_pad:
        tuned = tuned_plan(m, n_pad, k_pad, swap_ab, facts[0])
        if tuned is not None:
            return tuned
    return heuristic_plan(m, swap_ab, n_pad, k_pad, facts[1] if facts else None)
