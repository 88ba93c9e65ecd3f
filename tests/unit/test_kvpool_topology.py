"""Slot maps and partitions: keys route by CRC16 (hash tags honoured, as Redis does), the
partition tags are spread evenly over the slots so N nodes share the partitions evenly,
and blocks fill the partitions evenly."""

from __future__ import annotations

from collections import Counter

import pytest

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.pool import block_id
from libs.kvpool.topology import CLUSTER_PARTITIONS, SLOTS, Node, SlotMap, key_slot, partition_of, partition_tags


def test_key_slots_are_redis_cluster_slots() -> None:
    # Values from the Redis Cluster specification's CRC16 (XMODEM) reference.
    assert key_slot("123456789") == 0x31C3 % SLOTS
    assert key_slot("user:{42}:a") == key_slot("{42}") == key_slot("42")
    assert key_slot("a{}b") != key_slot("")  # an empty tag is no tag


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 8, 16])
def test_partitions_spread_evenly_over_nodes_cut_like_redis_cli(nodes: int) -> None:
    tags = partition_tags(CLUSTER_PARTITIONS)
    assert len(set(tags)) == CLUSTER_PARTITIONS
    ranges = [(i * SLOTS // nodes, (i + 1) * SLOTS // nodes - 1, Node("h", 7000 + i)) for i in range(nodes)]
    slots = SlotMap(ranges, cluster=True)
    per_node = Counter(slots.node_for(f"P:{{{t}}}:lru") for t in tags)
    assert len(per_node) == nodes
    assert max(per_node.values()) - min(per_node.values()) <= 1


def test_blocks_fill_partitions_evenly() -> None:
    ns = Namespace(model_digest="topology", dtype="bf16", block_size=16)
    keys = block_keys(ns, list(range(16 * 4096)))
    counts = Counter(partition_of(block_id(ns, k), CLUSTER_PARTITIONS) for k in keys)
    assert len(counts) == CLUSTER_PARTITIONS
    assert max(counts.values()) < 1.25 * len(keys) / CLUSTER_PARTITIONS
    assert all(partition_of(block_id(ns, k), 1) == 0 for k in keys[:10])


def test_cluster_slots_replies_parse_to_masters() -> None:
    reply = [
        [0, 8191, [b"127.0.0.1", 7000, b"id-a"], [b"127.0.0.1", 7003, b"id-r"]],
        [8192, 16383, [b"", 7001, b"id-b"]],  # an empty address is the node asked
    ]
    slots = SlotMap.from_cluster_slots(reply, Node("10.0.0.5", 7001))
    assert slots.cluster and slots.uncovered == 0
    assert slots.node(0) == Node("127.0.0.1", 7000) and slots.node(16383) == Node("10.0.0.5", 7001)
    assert slots.nodes == [Node("10.0.0.5", 7001), Node("127.0.0.1", 7000)]
    partial = SlotMap([(0, 99, Node("h", 1))], cluster=True)
    assert partial.node(100) is None and partial.uncovered == SLOTS - 100
    standalone = SlotMap.standalone(Node("h", 6379))
    assert not standalone.cluster and standalone.node_for("anything") == Node("h", 6379)
