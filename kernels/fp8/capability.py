"""Whether a device runs the FP8 GEMM kernels: FP8 tensor cores are SM 8.9+ (Ada, Hopper
and later). A question, never an error: anything that goes wrong while asking (no CUDA
build, no driver, a bad device string, no triton) answers False, and the caller takes
the dequantize-then-matmul path (libs/model/fp8.py)."""

from __future__ import annotations

import importlib.util

import torch

MIN_CAPABILITY = (8, 9)


def fp8_gemm_supported(device: torch.device | str | None = None) -> bool:
    """True where ``kernels.fp8.triton_gemm`` can run: a CUDA (not ROCm: its e4m3 is the
    ``fnuz`` variant) device of compute capability 8.9 or newer, with triton installed."""
    try:
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
            return False
        if importlib.util.find_spec("triton") is None:
            return False
        return tuple(torch.cuda.get_device_capability(dev)) >= MIN_CAPABILITY
    except Exception:  # a question, never an error
        return False
