"""Block digests on the device: xxh3_64 of a pool value's payload, straight from the cache.

Prefill's pool writes carry each block's xxh3_64 (libs/kvpool/header.py). Hashing 47 MB of
a 2048-token prompt's blocks on the CPU, on the bulk threads before they send, held
prefill's writes back by about 6 ms on an H100 host (bench/RESULTS.md, issue 8, round 8);
the GPU reads the same bytes in well under a millisecond. The digest is the same number,
so nothing about the value format changes: readers still verify it on the CPU.

- ``xxh3``: XXH3's secret, primes and the key table the kernels read.
- ``reference``: the torch reference (the test oracle), ``block_digests``.
- ``triton_digest``: the same on the device (``launch_digests`` for device operands).
- ``checks``: what both accept (``supports(cache)``).
- ``probe``: python-xxhash over the same payloads, and the one-time check that a device
  implementation agrees with it (the swapper turns digests off where it does not).
"""

from kernels.digest.checks import DigestShapeError, supports
from kernels.digest.reference import block_digests

__all__ = ["DigestShapeError", "block_digests", "supports"]
