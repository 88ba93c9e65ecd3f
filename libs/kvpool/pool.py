"""The pool interface: one abstract base for the Redis client and its in-memory twin.

Prefill and decode move block bytes through a :class:`BlockPool` directly; cache_store uses
the same interface for policy (``evict``, ``reap_leases``, ``stats``). The twin
(libs/kvpool/memory.py) and the Redis client (libs/kvpool/redis_pool.py) implement the
same semantics, so unit tests of everything above the pool run on the twin.

Names. A block is addressed by its namespace (a :class:`Namespace` or its hex digest) and
its :class:`BlockKey` (or ``str(BlockKey)``). Pool-wide it is the *block id*
``"<namespace hex>:<str(key)>"``: the member name in the pool's indexes, the REST key of
cache_store, and the suffix of the Redis key ``<prefix>:kv:<block id>``.

Errors. A whole call fails with :class:`PoolUnavailable` when the backend cannot be reached
(after the configured retries). A write refused for one block (no room, unknown lease) is
not an exception: ``put_blocks`` returns a :class:`PutError` in that block's slot, and the
other blocks of the batch are unaffected. ``get_blocks_into`` never raises for the
backend: each block it could not deliver is a miss with its reason (READ_MISS_REASONS).

Values. ``put_blocks`` takes a value as one buffer or as a list of parts written back to
back (``BlockCodec.encode_views``: the header and views of staging memory); the parts
must not change until the call returns. ``get_blocks`` returns bytes-like values
(``bytes`` or a ``memoryview``; ``bytes(v)`` if you need ``bytes``); ``get_blocks_into``
receives them straight into memory the caller provides (the zero-copy path).
"""

from __future__ import annotations

import logging
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Sequence, Union, get_args

from libs.blocks.keys import KEY_BYTES, BlockKey, Namespace
from libs.kvpool.header import Buffer, Value, value_parts

NamespaceLike = Union[Namespace, str]
KeyLike = Union[BlockKey, str]

log = logging.getLogger(__name__)

PutErrorReason = Literal["oom", "lease", "rejected"]
PUT_ERROR_REASONS: tuple[str, ...] = get_args(PutErrorReason)

# Why get_blocks_into could not deliver a block: ``absent``; ``length`` (the stored value
# is not the size the caller expects: never written into its memory); ``error`` (Redis
# answered an error); or, after retries, the transport's reason: ``timeout``, ``closed``
# (dropped or cut short), ``connect``, ``protocol`` (bytes that are not RESP), ``auth``,
# ``redirect`` (the cluster kept redirecting), ``unavailable`` (a backend without detail).
ReadMissReason = Literal[
    "absent", "length", "error", "timeout", "closed", "connect", "protocol", "auth", "redirect", "unavailable"
]
READ_MISS_REASONS: tuple[str, ...] = get_args(ReadMissReason)

# Stats hash fields are "misses:<reason>"; a reason is a short label, bounded so that a
# caller cannot blow up metric cardinality or the hash with arbitrary strings.
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]*(:[a-z0-9_]+)?$")
_NS_RE = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")
_KEY_RE = re.compile(rf"^[0-9a-f]{{{2 * KEY_BYTES}}}(:partial:[1-9][0-9]{{0,4}})?$")
# The id create_lease hands out: 32 hex digits (random, from secrets).
LEASE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


class PoolError(Exception):
    """Base of everything the pool raises or reports."""


class PoolUnavailable(PoolError):
    """The backend could not be reached or timed out, after retries. Nothing is known to be done."""


class PutError(PoolError):
    """One block's write was refused; ``reason`` is one of PUT_ERROR_REASONS."""

    def __init__(self, reason: PutErrorReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: PutErrorReason = reason


def namespace_hex(ns: NamespaceLike) -> str:
    text = ns.hex if isinstance(ns, Namespace) else ns
    if not _NS_RE.match(text):
        raise ValueError(f"namespace must be {2 * KEY_BYTES} lowercase hex digits, got {text!r}")
    return text


def key_text(key: KeyLike) -> str:
    text = str(key)
    if not _KEY_RE.match(text):
        raise ValueError(f"block key must be {2 * KEY_BYTES} hex digits with an optional ':partial:m', got {text!r}")
    return text


def block_id(ns: NamespaceLike, key: KeyLike) -> str:
    """``"<namespace hex>:<str(key)>"``: the pool-wide name of a block."""
    return f"{namespace_hex(ns)}:{key_text(key)}"


def block_ids(ns: NamespaceLike, keys: Sequence[KeyLike]) -> list[str]:
    prefix = namespace_hex(ns) + ":"
    return [prefix + key_text(k) for k in keys]


def leading_run(exists: Sequence[bool]) -> int:
    """How many of ``exists`` are true before the first false: a prompt's usable prefix."""
    return next((i for i, e in enumerate(exists) if not e), len(exists))


def parse_block_id(text: str) -> tuple[str, str]:
    """Split and validate a block id; raises ``ValueError`` naming what is wrong."""
    ns, sep, key = text.partition(":")
    if not sep:
        raise ValueError(f"block id must be '<namespace hex>:<block key>', got {text!r}")
    return namespace_hex(ns), key_text(key)


def check_reason(reason: str) -> str:
    if not _REASON_RE.match(reason) or len(reason) > 64:
        raise ValueError(f"miss reason must look like 'absent' or 'corrupt:checksum', got {reason!r}")
    return reason


@dataclass(frozen=True)
class PoolStats:
    """Pool-wide counters, as kept in the backend (every client contributes)."""

    blocks: int
    bytes: int
    leases: int
    pinned_blocks: int
    hits: int
    misses: dict[str, int] = field(default_factory=dict)
    evictions: int = 0
    evicted_bytes: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_counters(
        cls, *, blocks: int, bytes: int, leases: int, pinned_blocks: int, counters: dict[str, int]
    ) -> "PoolStats":
        """Build from the flat counter map both backends keep (``misses:<r>``, ``write_errors:<r>``)."""
        misses = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("misses:")}
        errors = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("write_errors:")}
        return cls(
            blocks=blocks,
            bytes=bytes,
            leases=leases,
            pinned_blocks=pinned_blocks,
            hits=counters.get("hits", 0),
            misses=misses,
            evictions=counters.get("evictions", 0),
            evicted_bytes=counters.get("evicted_bytes", 0),
            puts=counters.get("puts", 0),
            bytes_written=counters.get("bytes_written", 0),
            bytes_read=counters.get("bytes_read", 0),
            write_errors=errors,
        )


@dataclass(frozen=True)
class EvictResult:
    evicted: int
    freed_bytes: int
    bytes_after: int


class BlockPool(ABC):
    """What prefill, decode and cache_store need from the pool. All methods are coroutines.

    The public methods validate names and arguments once, here, and hand block ids to the
    backend's ``_``-methods, so the twin and the Redis client cannot drift apart on what
    they accept.
    """

    # -- data plane -------------------------------------------------------------------

    async def exists_prefix(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> int:
        """How many of ``keys``, from the first, exist without a gap (read-only)."""
        if len(keys) > 1 and not (await self._exists_blocks(block_ids(ns, keys[:1])))[0]:
            # A new prompt's first block is absent: one key answers, and the other ids are
            # not even built (this query is in front of every prompt's compute).
            return 0
        ids = block_ids(ns, keys)
        return await self._exists_prefix(ids) if ids else 0

    async def exists_blocks(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether each key exists (read-only)."""
        ids = block_ids(ns, keys)
        return await self._exists_blocks(ids) if ids else []

    async def get_blocks(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> list[Buffer | None]:
        """Each block's value, ``None`` where absent. Counts hits and ``misses:absent``, touches the LRU."""
        ids = block_ids(ns, keys)
        return await self._get_blocks(ids) if ids else []

    async def get_blocks_into(
        self,
        ns: NamespaceLike,
        keys: Sequence[KeyLike],
        dests: Sequence[Sequence[memoryview]],
        *,
        on_landed: Callable[[int], None] | None = None,
    ) -> list[str | None]:
        """Receive each block's value straight into ``dests[i]``: writable views filled in
        order, whose sizes add up to the value length the caller expects.

        Per block ``None`` (the value landed, whole) or a miss reason (READ_MISS_REASONS);
        a value of another length is never written anywhere (``"length"``). Memory of a
        block that missed may hold anything. Counts hits and ``misses:absent`` and touches
        the LRU like ``get_blocks``. When the call returns, or raises (cancelled), nothing
        writes into ``dests`` any more.

        ``on_landed(i)`` is called once for each block whose value landed, as soon as it
        has, possibly on a bulk-transfer thread and while other blocks are still arriving:
        decode verifies checksums there, overlapped with the transfer. It must be quick,
        thread-safe and must not raise (an exception is logged and the block counts as a
        miss ``"error"``).
        """
        ids = block_ids(ns, keys)
        if len(dests) != len(ids):
            raise ValueError(f"{len(dests)} destinations for {len(ids)} keys")
        if not ids:
            return []
        if on_landed is None:
            return await self._get_blocks_into(ids, dests, None)
        failed: set[int] = set()

        def landed(i: int) -> None:
            try:
                on_landed(i)
            except Exception:  # noqa: BLE001 - the caller's bug must not break the transport
                log.exception("on_landed(%d) raised", i)
                failed.add(i)

        outcomes = await self._get_blocks_into(ids, dests, landed)
        return ["error" if i in failed and o is None else o for i, o in enumerate(outcomes)]

    async def put_blocks(
        self,
        ns: NamespaceLike,
        items: Sequence[tuple[KeyLike, Value]],
        *,
        lease_id: str | None = None,
    ) -> list[PutError | None]:
        """Write blocks; per block ``None`` (written) or the :class:`PutError` that refused it.

        With ``lease_id`` each written block is pinned by that lease in the same atomic
        step; an unknown or expired lease refuses the block (reason ``"lease"``).
        """
        if lease_id is not None and not LEASE_ID_RE.match(lease_id):
            raise ValueError(f"malformed lease id {lease_id!r}")
        ids = block_ids(ns, [k for k, _ in items])
        if not ids:
            return []
        return await self._put_blocks(list(zip(ids, (v for _, v in items))), lease_id)

    async def delete_blocks(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> int:
        """Delete blocks (leased or not); returns how many existed."""
        ids = block_ids(ns, keys)
        return await self._delete_blocks(ids) if ids else 0

    # -- leases -----------------------------------------------------------------------

    async def create_lease(self, ns: NamespaceLike, keys: Sequence[KeyLike], ttl_s: float) -> str:
        """Pin ``keys`` (present or still to be written) until released or ``ttl_s`` passes."""
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl_s}")
        lease_id = secrets.token_hex(16)
        await self._create_lease(lease_id, block_ids(ns, keys), ttl_s)
        return lease_id

    async def release_lease(self, lease_id: str) -> bool:
        """Unpin a lease's blocks; ``False`` if it was unknown (never existed, released, reaped)."""
        if not LEASE_ID_RE.match(lease_id):
            return False
        return await self._release_lease(lease_id)

    # -- accounting and policy ------------------------------------------------------------

    async def record_misses(self, reason: str, n: int = 1) -> None:
        """Count ``n`` blocks that a reader could not use, e.g. ``"corrupt:checksum"``.

        ``get_blocks`` counts a block it returns as a hit and one it cannot find as
        ``misses:absent``; what happens after is the reader's to report: a block that came
        back but fails ``BlockCodec.decode`` is recorded here as ``corrupt:<reason>``.
        """
        check_reason(reason)
        if n < 0:
            raise ValueError(f"miss count must be >= 0, got {n}")
        if n:
            await self._count({f"misses:{reason}": n})

    @abstractmethod
    async def stats(self) -> PoolStats: ...

    @abstractmethod
    async def evict(self, budget_bytes: int, max_blocks: int) -> EvictResult:
        """Delete least recently used unleased blocks until ``bytes <= budget_bytes`` or ``max_blocks`` went."""

    @abstractmethod
    async def memory_fill(self) -> float:
        """The fullest server's used memory over its memory limit (0.0 where none is set).

        A byte budget counts values; a server also holds their allocator overhead, keys,
        bookkeeping and client buffers, and refuses writes (OOM) at its limit. The policy
        loop evicts by this too, so that a budget set too close to the limit (or a pool
        whose overhead grew) still leaves room for writes."""

    @abstractmethod
    async def reap_leases(self, max_leases: int = 1000) -> int:
        """Release leases whose TTL has passed; returns how many."""

    # -- lifecycle --------------------------------------------------------------------

    @abstractmethod
    async def ping(self) -> None:
        """Raise :class:`PoolUnavailable` unless the backend answers."""

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> "BlockPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what a backend implements, on validated, non-empty block ids ------------------------

    @abstractmethod
    async def _exists_prefix(self, ids: list[str]) -> int: ...

    @abstractmethod
    async def _exists_blocks(self, ids: list[str]) -> list[bool]: ...

    @abstractmethod
    async def _get_blocks(self, ids: list[str]) -> list[Buffer | None]: ...

    async def _get_blocks_into(
        self, ids: list[str], dests: Sequence[Sequence[memoryview]], on_landed: Callable[[int], None] | None
    ) -> list[str | None]:
        """Through ``_get_blocks`` and a copy, for a backend without a zero-copy path (the twin)."""
        try:
            values = await self._get_blocks(ids)
        except PoolUnavailable:
            return ["unavailable"] * len(ids)
        out: list[str | None] = []
        for value, dest in zip(values, dests):
            if value is None:
                out.append("absent")
                continue
            src = value_parts(value)[0]
            views = value_parts(list(dest))
            if src.nbytes != sum(v.nbytes for v in views):
                out.append("length")
                continue
            pos = 0
            for view in views:
                view[:] = src[pos : pos + view.nbytes]
                pos += view.nbytes
            out.append(None)
            if on_landed is not None:
                on_landed(len(out) - 1)
        return out

    @abstractmethod
    async def _put_blocks(self, pairs: list[tuple[str, Value]], lease_id: str | None) -> list[PutError | None]: ...

    @abstractmethod
    async def _delete_blocks(self, ids: list[str]) -> int: ...

    @abstractmethod
    async def _create_lease(self, lease_id: str, ids: list[str], ttl_s: float) -> None: ...

    @abstractmethod
    async def _release_lease(self, lease_id: str) -> bool: ...

    @abstractmethod
    async def _count(self, counters: dict[str, int]) -> None:
        """Add to the stats counters (``misses:<reason>``, ``write_errors:<reason>``)."""
