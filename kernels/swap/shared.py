"""Staging buffers in shared memory: every rank of a tensor-parallel instance maps the same rows.

A TP instance's ranks are processes on one host. Each gathers its own KV heads into the
same staging row (kernels/swap/heads.py), so the row ends up holding the whole block the
pool stores, and rank 0 sends it as it is; on the way in, rank 0 receives whole values
into the rows and each rank scatters its heads from there. The rows therefore live in one
shared-memory file (``/dev/shm``) that every rank maps: rank 0 creates it, the others
attach by name, and rank 0 unlinks the name once all have attached (``unlink``), so the
memory goes away with the last process even if every one of them is killed.

On CUDA the mapping is registered with the driver (``cudaHostRegister``): pinned, so the
head-slice kernel reads and writes it directly (mapped memory) and copies never bounce
through pageable memory.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

from kernels.swap.errors import SwapShapeError

SHM_DIR = Path("/dev/shm")


class SharedStaging:
    """``num_buffers`` host tensors of ``shape`` (``[max_blocks, *block]``) in one shared
    file named ``name``. ``create``: make it (rank 0), else attach (the others).
    ``pin``: register it with CUDA. ``close()`` unmaps it (tensors handed out must be
    dropped first); the creator also removes the name if ``unlink`` was not called."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int, *, create: bool, pin: bool = False):
        if "/" in name or not name:
            raise SwapShapeError(f"shared staging name must be a plain file name, got {name!r}")
        self.path = SHM_DIR / name
        self.creator = create
        item = dtype.itemsize
        per = math.prod(shape) * item
        self.nbytes = per * num_buffers
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.nbytes)
            elif os.fstat(fd).st_size != self.nbytes:
                raise SwapShapeError(f"{self.path} holds {os.fstat(fd).st_size} bytes, expected {self.nbytes}")
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} shared bytes failed ({err})")
            self._registered = True
        self._base = flat.data_ptr()
        self.buffers: list[torch.Tensor] = [flat[i * per : (i + 1) * per].view(dtype).view(shape) for i in range(num_buffers)]
        del flat

    def unlink(self) -> None:
        """Remove the name (every rank has attached): the memory lives on while mapped."""
        if self.creator:
            self.path.unlink(missing_ok=True)
            self.creator = False

    def close(self) -> None:
        """Unregister and unmap. Idempotent; the memory stays while tensors still use it."""
        self.buffers = []
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._base)
            self._registered = False
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # someone still holds a tensor over it: freed with the last one
            pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
