"""Token bitmask kernels: apply a grammar's allowed-token mask to logits before sampling.

A bitmask row holds one bit per vocabulary token, packed little-endian into int32 words
(token ``t`` is bit ``t % 32`` of word ``t // 32``; 1 = allowed), the layout both xgrammar
and llguidance fill. ``apply_token_bitmask_(logits, bitmask, rows)`` sets every disallowed
token of logits row ``rows[i]`` to ``-inf`` according to bitmask row ``i``; other logits
rows are untouched, so unconstrained requests in the batch cost nothing.

- ``reference``: torch, the CPU path and the tests' oracle.
- ``triton_bitmask``: the same function, one program per (row, block of tokens) (imported
  on demand: it needs triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.bitmask.reference import apply_token_bitmask_

__all__ = ["apply_token_bitmask_"]
