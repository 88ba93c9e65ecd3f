"""RMSNorm kernels: the normalisation before attention, before the MLP and after the last layer.

- ``reference``: torch ``rms_norm(x, weight, eps)`` and
  ``fused_add_rms_norm(x, residual, weight, eps)``, the CPU path and the test oracle. Their
  arithmetic is exactly the model's ``RMSNorm`` (and its residual add), so the CPU engine
  stays bit-for-bit equal to Hugging Face transformers.
- ``triton_norm``: the same two functions, one program per row (imported on demand: it
  needs triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).

``kernels.select.ops_for(device)`` picks one of the two for a device.
This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.norm.reference import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "rms_norm"]
