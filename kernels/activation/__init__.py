"""MLP activation kernels: SwiGLU's ``silu(gate) * up`` on the fused gate/up projection.

- ``reference``: torch ``silu_and_mul(x) -> out``, the CPU path and the test oracle, with
  exactly the arithmetic of the model's MLP.
- ``triton_activation``: the same function in one kernel (imported on demand: it needs
  triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).

``kernels.select.ops_for(device)`` picks one of the two for a device.
This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.activation.reference import silu_and_mul

__all__ = ["silu_and_mul"]
