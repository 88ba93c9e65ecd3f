"""The facts about a CUDA device that kernels' host code sizes and selects launches by: its
name (the key of the measured tables: FP8 tiles, the skinny GEMM's threshold) and its SM
count (how many programs fill it). Cached per device: launch wrappers ask on every call."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=16)
def _device_facts(device: torch.device) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def device_facts(device: torch.device | str | None) -> tuple[str, int] | None:
    """(name, SM count) of a CUDA device; None for anything else (the CPU, the interpreter)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_facts(dev)


def device_name(device: torch.device | str | None) -> str | None:
    """The name the measured tables key a CUDA device by (``device_facts``'s); None for
    anything else."""
    facts = device_facts(device)
    return facts[0] if facts is not None else None
