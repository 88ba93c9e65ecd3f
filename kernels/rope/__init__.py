"""Rotary position embedding kernels (the Hugging Face "rotate half" layout).

- ``reference``: torch ``apply_rotary(q, k, positions, cos, sin) -> (q_out, k_out)``, the CPU
  path and the test oracle, with exactly the arithmetic of the model's ``RotaryEmbedding``.
- ``triton_rope``: the same function as one Triton launch for q and k, rotating them in
  place (imported on demand: it needs triton, and on the CPU ``TRITON_INTERPRET=1`` set
  beforehand).

Callers read only the returned tensors and treat ``q`` and ``k`` as consumed: the reference
returns new tensors and leaves its inputs alone, the Triton version overwrites its inputs
and returns them.

``kernels.select.ops_for(device)`` picks one of the two for a device.
This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.rope.reference import apply_rotary

__all__ = ["apply_rotary"]
