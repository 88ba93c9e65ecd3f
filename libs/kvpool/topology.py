"""Where the pool's keys live: one Redis, or the slot map of a Redis Cluster; and the pool's
partitions, which keep each Lua script's keys in one slot. No I/O here: the control plane
(libs/kvpool/control.py) fetches the map, and both planes route with it.

Slots. A cluster hashes every key to one of 16384 slots (CRC16 of the key, or of the part
between the first ``{`` and the next ``}``: the *hash tag*) and gives each node ranges of
slots. ``SlotMap`` answers "which node serves this slot"; a standalone Redis is a map with
one node for every slot, so callers never branch on the mode.

Partitions. A script may only touch keys of one slot, and the pool's bookkeeping (LRU,
sizes, pins, leases) must change in the same atomic step as a block's data. So on a
cluster the pool is cut into ``CLUSTER_PARTITIONS`` partitions: partition ``p`` owns the
hash tag ``PARTITION_TAGS[p]``, every key of its bookkeeping and of its blocks carries that
tag, and a block belongs to partition ``int(key[:8], 16) % n`` (block keys are uniform
hashes, so partitions fill evenly). The tags are chosen so that their slots are evenly
spaced over the slot range; ``redis-cli --cluster create`` gives each of N nodes one
contiguous range, so each node serves about ``CLUSTER_PARTITIONS / N`` partitions. On a
standalone Redis there is one partition and no tag (the key names are the pre-cluster
schema, unchanged). libs/kvpool/redis_pool.py documents the keys themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from redis.crc import REDIS_CLUSTER_HASH_SLOTS as SLOTS
from redis.crc import key_slot as _key_slot

# Fixed for the pool's lifetime: every client must agree, or they would name different keys.
# 16 spreads evenly over 1, 2, 4, 8 or 16 nodes; each lease operation runs one small script
# per partition, so more partitions cost every request a little.
CLUSTER_PARTITIONS = 16


@dataclass(frozen=True, order=True)
class Node:
    """A Redis server: ``host:port``, or a unix socket ``path``."""

    host: str
    port: int = 0
    path: str | None = None

    @property
    def name(self) -> str:
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.name


def key_slot(key: str | bytes) -> int:
    """The cluster slot of ``key`` (hash tags honoured)."""
    return _key_slot(key.encode() if isinstance(key, str) else key)


class SlotMap:
    """Which node serves each slot. ``cluster`` is False for a standalone Redis."""

    def __init__(self, ranges: Sequence[tuple[int, int, Node]], *, cluster: bool) -> None:
        self.cluster = cluster
        self._owner: list[Node | None] = [None] * SLOTS
        for start, end, node in ranges:
            if not 0 <= start <= end < SLOTS:
                raise ValueError(f"slot range {start}-{end} outside 0-{SLOTS - 1}")
            for slot in range(start, end + 1):
                self._owner[slot] = node
        self.nodes: list[Node] = sorted({n for n in self._owner if n is not None})
        self.uncovered = sum(o is None for o in self._owner)

    @classmethod
    def standalone(cls, node: Node) -> "SlotMap":
        return cls([(0, SLOTS - 1, node)], cluster=False)

    @classmethod
    def from_cluster_slots(cls, reply: Sequence[Any], seed: Node) -> "SlotMap":
        """Parse a raw ``CLUSTER SLOTS`` reply: ``[[start, end, [ip, port, id, ...], replicas...], ...]``.

        Only masters (the first node of each range) are used: the pool reads and writes
        there. A node that reports an empty or ``?`` address is the one we asked.
        """
        ranges = []
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            if host in ("", "?"):
                host = seed.host
            ranges.append((start, end, Node(host, int(master[1]))))
        return cls(ranges, cluster=True)

    def node(self, slot: int) -> Node | None:
        """The node serving ``slot``; None when no node does (a cluster being set up)."""
        return self._owner[slot]

    def node_for(self, key: str | bytes) -> Node | None:
        return self._owner[key_slot(key)] if self.cluster else self.nodes[0]

    def describe(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for n in self._owner:
            if n is not None:
                counts[n.name] = counts.get(n.name, 0) + 1
        return {"cluster": self.cluster, "slots_per_node": counts, "uncovered_slots": self.uncovered}


@lru_cache(maxsize=8)
def partition_tags(n: int) -> tuple[str, ...]:
    """``n`` short hash tags whose slots are evenly spaced: tag ``p`` lands in ``[p, p+1) * 16384/n``.

    Found by trying ``"<p>.<i>"`` for i = 0, 1, ... (CRC16 is fast; about 16384/n tries each).
    """
    tags = []
    for p in range(n):
        lo, hi = p * SLOTS // n, (p + 1) * SLOTS // n
        i = 0
        while not lo <= key_slot(f"{p}.{i}") < hi:
            i += 1
        tags.append(f"{p}.{i}")
    return tuple(tags)


def partition_of(block_id: str, n: int) -> int:
    """The partition of a block id ``<namespace hex>:<block key>`` among ``n``."""
    if n == 1:
        return 0
    key = block_id.partition(":")[2]
    return int(key[:8], 16) % n
