"""The staging pool: pinned host buffers with an explicit lifetime, and the swaps through them.

``BlockSwapper(cache, max_blocks)`` owns, for its whole life, ``num_buffers`` host
buffers of ``max_blocks`` blocks each (pinned when the cache is on a GPU), plus a device
staging buffer and a device id list when its strategy needs them. Nothing is allocated
per swap and nothing is global: two swappers never share memory, and ``close()`` hands
all of it back to torch's allocators.

Lifetime rules:

- ``acquire(n)`` (or ``swap_out``) lends one buffer as a ``StagingBuffer``; it stays valid,
  and is never handed to anyone else, until ``release()`` (or the end of its ``with``
  block). The prefill service can therefore give it to async pool writes while the next
  engine step runs, and release it when the writes are acknowledged.
- Lending more than ``num_buffers`` at once raises ``StagingStateError`` (it never blocks:
  a caller that holds every buffer and waits for one would wait forever).
- A released buffer, or any buffer of a closed swapper, raises ``StagingStateError`` on use.
  Releasing twice raises too; releasing after ``close()`` is allowed and does nothing, so
  shutdown order does not matter.
- ``close()`` waits for copies in flight, then drops every buffer. Tensors a caller still
  holds (from ``StagingBuffer.host``) keep their memory alive, as torch tensors do.

Synchronisation (stream-ordered, never a device-wide sync):

- ``swap_out(block_ids)`` enqueues the device-to-host copy on the current CUDA stream and
  returns at once with the buffer. ``StagingBuffer.host`` blocks until that copy has
  landed, so reading host memory through it is always safe; ``wait()`` and ``ready()``
  make the wait explicit. Later kernels on the same stream (say, ones that reuse the
  swapped-out blocks) run after the copy, so they cannot overwrite what it reads.
- ``swap_in(buf, block_ids)`` enqueues the host-to-device copy on the current stream and
  returns at once; later kernels on that stream (attention) see the blocks. The host
  buffer is read asynchronously, so ``buf.host`` blocks until that read is done before
  handing the memory out again.
- Work issued on another stream must be ordered by its owner (``wait_stream``), as for any
  torch op. On the CPU every swap is done when it returns.

Digests (``digests``, on by default on CUDA where ``kernels.digest`` supports the cache):
``swap_out(block_ids, num_tokens=...)`` also computes each block's pool digest (xxh3_64 of
its value payload of that many tokens, kernels/digest) on the device, from the cache, in
the same stream order as the copy; ``StagingBuffer.digests`` reads them with the rows.
Prefill's pool writes then carry them instead of hashing the rows on the CPU
(kernels/swap/digests.py: the bookkeeping, and the check that turns them off where they
disagree with python-xxhash).

Paths, chosen per swap from the block ids:

- at most ``max_direct_runs`` runs of consecutive ids (a single run by default): one copy
  per run between the cache slice and the host buffer, no kernel;
- otherwise ``"staged"``: one gather kernel into device staging and one copy to the host
  (and the reverse for swap-in), or ``"mapped"``: the kernel reads or writes the pinned
  host buffer directly. bench/swap_bench.py measures both; bench/results/swap.md has the
  numbers behind the default.

Tensor parallelism (``heads``, kernels/swap/heads.py): a rank's cache holds only its KV
heads, while staging rows hold whole blocks (the pool's values), in memory every rank of
the instance maps (``host_buffers``, kernels/swap/shared.py). Each rank's swapper then
moves only its heads' part of each row, with the head-slice kernel (mapped: straight
between its device and the shared host rows; no run fast path, the part is strided).
Rank 0 lends the buffers; the other ranks fill or read the same buffer by its index
(``gather_into`` / ``scatter_from``) when rank 0 tells them to.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType
from typing import Literal, Sequence

import numpy as np
import torch

from kernels.swap import reference
from kernels.swap.checks import BlockIds, as_block_ids, check_cache, check_triton_operands
from kernels.swap.digests import DigestRows, SwapDigests, digests_wanted, token_counts
from kernels.swap.errors import StagingStateError, SwapShapeError
from kernels.swap.heads import HeadSlice
from kernels.swap.runs import Run, block_runs, copy_run, count_runs

Strategy = Literal["staged", "mapped"]
Backend = Literal["torch", "triton"]

# Chosen by bench/swap_bench.py on an H200: staged beat mapped both ways (bench/results/swap.md).
DEFAULT_CUDA_STRATEGY: Strategy = "staged"


class _Slot:
    """One lendable host buffer, its host-side id list, and the event of its last copy."""

    def __init__(self, host: torch.Tensor, ids: torch.Tensor, event: torch.cuda.Event | None, digests: DigestRows | None) -> None:
        self.host = host
        self.ids = ids
        self.ids_np = ids.numpy()  # same memory: filling it costs no torch op
        self.event = event
        self.digests = digests  # the rows' pool digests, where the swapper computes them

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class StagingBuffer:
    """``n`` blocks of host staging lent by a ``BlockSwapper`` until ``release()``.

    Row ``j`` of ``host`` is block ``block_ids[j]`` of the swap that filled or will read
    it, in the cache's block layout (the pool's payload order).
    """

    def __init__(self, owner: BlockSwapper, slot: _Slot, n: int) -> None:
        self._owner = owner
        self._slot = slot
        self._n = n
        self._released = False

    @property
    def n(self) -> int:
        return self._n

    @property
    def index(self) -> int:
        """Which of its swapper's buffers this is (tensor-parallel ranks address it so)."""
        return self._owner._slots.index(self._live_slot())

    @property
    def host(self) -> torch.Tensor:
        """The host memory, ``[n, layers, 2, block_size, kv_heads, head_dim]``.

        Blocks until every copy into or out of this buffer has completed, so what it
        returns is never half-written and is safe to overwrite.
        """
        slot = self._live_slot()
        slot.wait()
        return slot.host[: self._n]

    def wait(self) -> None:
        """Block until every copy into or out of this buffer has completed."""
        self._live_slot().wait()

    def ready(self) -> bool:
        """Whether every copy into or out of this buffer has completed (never blocks)."""
        return self._live_slot().ready()

    @property
    def digests(self) -> np.ndarray | None:
        """Each row's pool digest (xxh3_64 as int64 bits) from the swap-out that filled it, or
        None where it computed none (no ``num_tokens``, digests off, or a swap-in since).
        Blocks until that swap's copies have landed, like ``host``."""
        slot = self._live_slot()
        if slot.digests is None or slot.digests.count != self._n or self._n == 0:
            return None
        slot.wait()
        return slot.digests.out_np[: self._n]

    def release(self) -> None:
        """Give the buffer back to its swapper; this handle is unusable afterwards."""
        self._owner._release(self)

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._released:
            self.release()

    def _live_slot(self) -> _Slot:
        if self._released:
            raise StagingStateError("this staging buffer was released; acquire a new one")
        self._owner._check_open()
        return self._slot


class BlockSwapper:
    """Moves blocks of one paged cache to and from host staging buffers it owns.

    ``cache``: the engine's ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
    tensor, kept for the swapper's life. ``max_blocks``: the most blocks one swap moves
    (each host buffer, and the device staging, hold that many). ``backend``: ``"triton"``
    (default on CUDA) or ``"torch"`` (default on the CPU; the reference). ``scattered``:
    how a swap that is not a few runs moves, ``"staged"`` or ``"mapped"`` (default: staged
    on CUDA, mapped on the CPU where host memory is the cache's own). ``max_direct_runs``:
    up to this many runs of consecutive ids move as one copy per run.

    ``heads``: the cache holds this slice of each block's KV heads, staging rows hold whole
    blocks (tensor parallelism). ``host_buffers``: ``num_buffers`` host tensors of
    ``max_blocks`` whole blocks to use as the buffers (shared memory; pinned, on CUDA);
    the swapper does not own their memory.
    """

    def __init__(
        self,
        cache: torch.Tensor,
        max_blocks: int,
        *,
        num_buffers: int = 2,
        backend: Backend | None = None,
        scattered: Strategy | None = None,
        max_direct_runs: int = 1,
        heads: HeadSlice | None = None,
        host_buffers: Sequence[torch.Tensor] | None = None,
        digests: bool | None = None,
    ) -> None:
        check_cache(cache)
        if max_blocks < 1:
            raise SwapShapeError(f"max_blocks must be at least 1, got {max_blocks}")
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be at least 1, got {num_buffers}")
        if max_direct_runs < 1:
            raise ValueError(f"max_direct_runs must be at least 1, got {max_direct_runs}")
        on_cuda = cache.is_cuda
        backend = backend or ("triton" if on_cuda else "torch")
        scattered = scattered or (DEFAULT_CUDA_STRATEGY if on_cuda else "mapped")
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
        if scattered not in ("staged", "mapped"):
            raise ValueError(f"scattered must be 'staged' or 'mapped', got {scattered!r}")
        if backend == "triton":
            # Imported here so a CPU-only install without triton can use the reference.
            from kernels.swap import triton_swap

            triton_swap.check_device(cache)
            self._triton = triton_swap
        self._cache = cache
        self._on_cuda = on_cuda
        self._backend: Backend = backend
        self._max_blocks = max_blocks
        self._max_direct_runs = max_direct_runs
        if heads is not None and cache.shape[4] != heads.count:
            raise SwapShapeError(f"cache has {cache.shape[4]} KV heads, the head slice {heads.count}")
        self._heads = heads if heads is not None and not heads.is_whole else None
        self._digests = SwapDigests(cache, max_blocks) if digests_wanted(digests, cache, backend == "triton", self._heads) else None
        block = tuple(cache.shape[1:]) if heads is None else (*cache.shape[1:4], heads.total, cache.shape[5])
        shape = (max_blocks, *block)
        if host_buffers is not None:
            _check_host_buffers(host_buffers, num_buffers, shape, cache.dtype, on_cuda)
        self._slots = [
            _Slot(
                host=host_buffers[i] if host_buffers is not None else torch.empty(shape, dtype=cache.dtype, pin_memory=on_cuda),
                ids=torch.empty(max_blocks, dtype=torch.int64, pin_memory=on_cuda),
                event=torch.cuda.Event() if on_cuda else None,
                digests=self._digests.rows() if self._digests is not None else None,
            )
            for i in range(num_buffers)
        ]
        self._num_buffers = num_buffers
        self._free: deque[_Slot] = deque(self._slots)
        self._staging = (
            torch.empty(shape, dtype=cache.dtype, device=cache.device) if scattered == "staged" and self._heads is None else None
        )
        self._device_ids = (
            torch.empty(max_blocks, dtype=torch.int64, device=cache.device)
            if backend == "triton" and on_cuda
            else None
        )
        # Recorded after each use of the device staging and id list, which all swaps share.
        self._shared_event = torch.cuda.Event() if on_cuda else None
        if backend == "triton":
            staging = [] if self._staging is None else [self._staging]
            check_triton_operands(cache, *(slot.host for slot in self._slots), *staging)
        self._lock = threading.Lock()
        self._closed = False

    # -- properties -------------------------------------------------------------------

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    @property
    def num_buffers(self) -> int:
        return self._num_buffers

    @property
    def in_use(self) -> int:
        """Buffers lent out and not yet released."""
        with self._lock:
            return len(self._slots) - len(self._free)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def digests_on(self) -> bool:
        """Whether ``swap_out(..., num_tokens=...)`` computes the blocks' pool digests."""
        return self._digests is not None and self._digests.on

    # -- lifetime ---------------------------------------------------------------------

    def acquire(self, n: int) -> StagingBuffer:
        """Lend a buffer for ``n`` blocks (0 <= n <= max_blocks) until it is released."""
        if not 0 <= n <= self._max_blocks:
            raise SwapShapeError(
                f"{n} blocks requested, but a staging buffer holds 0..{self._max_blocks}: "
                "split the swap or build the swapper with a larger max_blocks"
            )
        with self._lock:
            self._check_open()
            if not self._free:
                raise StagingStateError(
                    f"all {self._num_buffers} staging buffers are in use: release one, or build "
                    "the swapper with more num_buffers"
                )
            return StagingBuffer(self, self._free.popleft(), n)

    def close(self) -> None:
        """Wait for copies in flight, then free every buffer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots:
                slot.wait()
            if self._shared_event is not None:
                self._shared_event.synchronize()
            for slot in self._slots:
                # Handles still out keep their slot object; drop its memory all the same.
                slot.host = slot.ids = slot.ids_np = None
                slot.digests = None
            self._slots = []
            self._free.clear()
            self._staging = None
            self._device_ids = None
            self._digests = None

    def __enter__(self) -> BlockSwapper:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A safety net, not the contract: copies in flight must land before the pinned
        # memory they target goes back to the allocator.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn torch down
            pass

    # -- swaps ------------------------------------------------------------------------

    def swap_out(self, block_ids: BlockIds, num_tokens: Sequence[int] | None = None) -> StagingBuffer:
        """Device→host: copy blocks ``block_ids`` (repeats allowed) into a newly lent buffer.

        ``num_tokens`` (one count per block, 1..block_size): also compute each block's pool
        digest for that many tokens, where this swapper computes digests
        (``StagingBuffer.digests``; ``digests_on`` says whether it does).
        Returns once the copy is enqueued; ``buf.host`` waits for it to land.
        """
        ids = as_block_ids(block_ids, self._cache.shape[0], unique=False)
        tokens = None if num_tokens is None or not self.digests_on else token_counts(num_tokens, ids.size, self._cache.shape[3])
        buf = self.acquire(ids.size)
        try:
            with self._lock:
                self._check_open()
                self._swap(ids, buf._slot, out=True, digest_tokens=tokens)
        except BaseException:
            buf.release()
            raise
        return buf

    def swap_in(self, buf: StagingBuffer, block_ids: BlockIds, *, first_row: int | None = None) -> None:
        """Host→device: write row ``first_row + j`` of ``buf`` into cache block ``block_ids[j]``
        (every row by default; fewer where the rest was a local cache hit).

        Ids must not repeat. Returns once the copy is enqueued on the current stream.
        """
        ids = as_block_ids(block_ids, self._cache.shape[0], unique=True)
        if buf._owner is not self:
            raise StagingStateError("this staging buffer belongs to another swapper")
        with self._lock:
            slot = buf._live_slot()
            if first_row is None and ids.size != buf.n:
                raise SwapShapeError(f"{ids.size} block ids for a staging buffer of {buf.n} blocks")
            first_row = first_row or 0
            if first_row < 0 or first_row + ids.size > buf.n:
                raise SwapShapeError(f"{ids.size} block ids from row {first_row} for a staging buffer of {buf.n} blocks")
            self._swap(ids, slot, out=False, first_row=first_row)

    # -- tensor-parallel mirrors: another rank lends the buffer ----------------------

    def gather_into(self, index: int, block_ids: BlockIds) -> None:
        """Device→host: this cache's written heads of blocks ``block_ids`` into rows
        ``0..n-1`` of buffer ``index``, which this swapper does not lend (rank 0 of a
        tensor-parallel instance lent it). Enqueued; ``wait_buffer(index)`` waits for it."""
        ids = as_block_ids(block_ids, self._cache.shape[0], unique=False)
        with self._lock:
            self._check_open()
            self._swap(ids, self._slot_at(index, ids.size), out=True)

    def scatter_from(self, index: int, block_ids: BlockIds, *, first_row: int = 0) -> None:
        """Host→device: rows ``first_row + j`` of buffer ``index`` into blocks ``block_ids``."""
        ids = as_block_ids(block_ids, self._cache.shape[0], unique=True)
        with self._lock:
            self._check_open()
            self._swap(ids, self._slot_at(index, first_row + ids.size), out=False, first_row=first_row)

    def wait_buffer(self, index: int) -> None:
        """Block until every copy into or out of buffer ``index`` has completed."""
        self._slot_at(index, 0).wait()

    def _slot_at(self, index: int, rows: int) -> _Slot:
        if not 0 <= index < len(self._slots):
            raise StagingStateError(f"no staging buffer {index} (this swapper has {len(self._slots)})")
        if rows > self._max_blocks:
            raise SwapShapeError(f"{rows} rows for a staging buffer of {self._max_blocks} blocks")
        return self._slots[index]

    # -- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StagingStateError("this BlockSwapper is closed")

    def _release(self, buf: StagingBuffer) -> None:
        with self._lock:
            if buf._released:
                raise StagingStateError("this staging buffer was already released")
            buf._released = True
            if not self._closed:
                self._free.append(buf._slot)

    def _stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self._cache.device) if self._on_cuda else None

    def _direct_runs(self, ids: np.ndarray) -> list[Run] | None:
        if count_runs(ids) > self._max_direct_runs:
            return None
        return block_runs(ids)

    def _device_ids_for(self, ids: np.ndarray, slot: _Slot) -> torch.Tensor:
        """The ids where the kernel reads them, through the slot's pinned list (no allocation)."""
        if self._device_ids is None:
            return torch.from_numpy(ids)
        n = ids.size
        slot.wait()  # the slot's id list may still be read by its previous swap
        slot.ids_np[:n] = ids
        self._device_ids[:n].copy_(slot.ids[:n], non_blocking=True)
        return self._device_ids[:n]

    def _kernel_gather(self, ids: np.ndarray, slot: _Slot, out: torch.Tensor) -> None:
        if self._backend == "triton":
            self._triton.launch_gather(self._cache, self._device_ids_for(ids, slot), out)
        else:
            reference.gather_blocks(self._cache, ids, out)

    def _kernel_scatter(self, ids: np.ndarray, slot: _Slot, src: torch.Tensor) -> None:
        if self._backend == "triton":
            self._triton.launch_scatter(src, self._device_ids_for(ids, slot), self._cache)
        else:
            reference.scatter_blocks(src, ids, self._cache)

    def _swap(self, ids: np.ndarray, slot: _Slot, *, out: bool, first_row: int = 0, digest_tokens: np.ndarray | None = None) -> None:
        """Enqueue one swap: device→host when ``out``, host→device otherwise (host rows
        from ``first_row``); with ``digest_tokens``, the swapped-out blocks' digests too."""
        n = ids.size
        if slot.digests is not None:
            slot.digests.count = 0
        if n == 0:
            return
        stream = self._stream()
        if stream is not None:
            # A copy on another stream may still touch this host buffer: order after it.
            stream.wait_event(slot.event)
        if digest_tokens is not None and self._digests is not None and slot.digests is not None:
            # Before the copies, on the same stream: both read the cache as it is here.
            self._digests.compute(slot.digests, ids, digest_tokens, stream, self._shared_event, slot.wait)
        host = slot.host[first_row : first_row + n]
        runs = self._direct_runs(ids) if self._heads is None else None
        if runs is not None:
            for run in runs:
                copy_run(self._cache, host, run, out=out)
        else:
            if stream is not None:
                stream.wait_event(self._shared_event)
            if self._heads is not None:
                self._swap_heads(ids, slot, host, out=out)
            elif out:
                self._gather_scattered(ids, slot)
            else:
                self._scatter_scattered(ids, slot, host)
            if stream is not None:
                self._shared_event.record(stream)
        if stream is not None:
            slot.event.record(stream)

    def _gather_scattered(self, ids: np.ndarray, slot: _Slot) -> None:
        n = ids.size
        if self._staging is None:
            self._kernel_gather(ids, slot, slot.host[:n])
            return
        self._kernel_gather(ids, slot, self._staging[:n])
        slot.host[:n].copy_(self._staging[:n], non_blocking=True)

    def _scatter_scattered(self, ids: np.ndarray, slot: _Slot, host: torch.Tensor) -> None:
        n = ids.size
        if self._staging is None:
            self._kernel_scatter(ids, slot, host)
            return
        self._staging[:n].copy_(host, non_blocking=True)
        self._kernel_scatter(ids, slot, self._staging[:n])

    def _swap_heads(self, ids: np.ndarray, slot: _Slot, host: torch.Tensor, *, out: bool) -> None:
        """This cache's heads between the device and whole-block host rows (mapped)."""
        heads = self._heads
        assert heads is not None
        if self._backend == "triton":
            dev = self._device_ids_for(ids, slot)
            if out:
                self._triton.launch_gather_heads(self._cache, dev, host, heads)
            else:
                self._triton.launch_scatter_heads(host, dev, self._cache, heads)
        elif out:
            reference.gather_heads(self._cache, ids, host, heads)
        else:
            reference.scatter_heads(host, ids, self._cache, heads)


def _check_host_buffers(buffers: Sequence[torch.Tensor], count: int, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> None:
    if len(buffers) != count:
        raise SwapShapeError(f"{len(buffers)} host buffers given for num_buffers={count}")
    for b in buffers:
        if tuple(b.shape) != shape or b.dtype != dtype or b.device.type != "cpu" or not b.is_contiguous():
            raise SwapShapeError(f"a host buffer must be a contiguous CPU {dtype} tensor of shape {shape}, got {b.dtype} {tuple(b.shape)} on {b.device}")
        if pinned and not b.is_pinned():
            raise SwapShapeError("host buffers of a CUDA cache must be pinned (registered) memory")
