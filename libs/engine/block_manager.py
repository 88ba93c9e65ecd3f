"""KV-cache blocks: allocation, reference counts and the prefix cache.

Full blocks are keyed with ``libs.blocks`` chain keys, the same keys the pool uses, so
"block i of this prompt is cached" means the same thing here, in the pool, in prefill and
in decode. Sequences that share a prefix share its blocks by reference count.

A block whose count drops to zero goes back to the free list but keeps its key: it is
still a prefix-cache hit until the allocator reuses it. Free blocks are handed out in
LRU order, keyless ones first, so cached prefixes survive as long as possible; a
sequence's blocks are released tail first, so a prompt's first blocks, the most
shareable, are evicted last.
"""

from __future__ import annotations

from collections import OrderedDict

from libs.blocks import Namespace, chain_keys
from libs.engine.sequence import Sequence
from libs.engine.prompt_logprobs import needs_scoring


class NoFreeBlocksError(RuntimeError):
    """Internal: an allocation was attempted without checking ``can_allocate`` first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: Namespace, *, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if namespace.block_size != block_size:
            raise ValueError("namespace block size differs from the cache's block size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Counters for metrics.
        self.prefix_hit_blocks = 0
        self.prefix_queried_blocks = 0

    # -- queries ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``seq`` needs so that ``num_new_tokens`` more tokens have slots."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def update_keys(self, seq: Sequence) -> None:
        """Extend ``seq.block_keys`` to cover every full block of its tokens."""
        keys = seq.block_keys
        parent = keys[-1] if keys else self.namespace.digest
        keys.extend(chain_keys(parent, seq.token_ids, self.block_size, len(keys), seq.num_tokens // self.block_size))

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of ``seq``, leaving at least one token to
        compute (the step that samples needs the last token's hidden state).

        Keys are computed only as far as the lookup needs (doubling past the ones already
        known, so a long hit costs few conversions): a new prompt costs one hash here, and
        the rest of its keys are computed once its step is on the GPU (``update_keys``
        from the engine, before ``commit`` needs them)."""
        if not self.enable_prefix_caching or needs_scoring(seq):  # scored prompts compute every position
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        keys = seq.block_keys
        hits = []
        for i in range(limit):
            if i == len(keys):
                keys.extend(chain_keys(keys[-1] if keys else self.namespace.digest, seq.token_ids, self.block_size, i, min(limit, 2 * i + 1)))
            block = self.key_to_block.get(keys[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def count_cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading full blocks of ``token_ids`` the prefix cache holds right now.

        Read-only, so a service thread may call it as a hint while the engine runs: the
        answer can be stale by the time the request is admitted, which only costs a
        redundant load or a recompute, never a wrong result."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key in chain_keys(self.namespace.digest, token_ids, self.block_size, 0, len(token_ids) // self.block_size):
            if key not in self.key_to_block:
                break
            n += 1
        return n

    # -- allocation ---------------------------------------------------------------------

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give a newly scheduled ``seq`` its cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        for b in hits:
            self._ref(b)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_committed_blocks = len(hits)
        self.prefix_queried_blocks += max(0, (seq.num_tokens - 1) // self.block_size)
        self.prefix_hit_blocks += len(hits)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append fresh blocks so ``num_new_tokens`` more tokens have slots."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(f"need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            seq.block_table.append(self._allocate())

    def allocate_blocks(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Append ``num_blocks`` fresh blocks (for imported KV); returns their ids."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {len(self._free)} free")
        new = [self._allocate() for _ in range(num_blocks)]
        seq.block_table.extend(new)
        return new

    def commit(self, seq: Sequence) -> None:
        """Publish the full, computed blocks of ``seq`` to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # (With async scheduling a block's last token may still be in flight: only blocks
        # whose tokens are all on the host can be keyed.)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table), seq.num_tokens // self.block_size)
        start = seq.num_committed_blocks
        if full <= start:
            return
        self.update_keys(seq)
        for i in range(start, full):
            key, block = seq.block_keys[i], seq.block_table[i]
            if self.block_key[block] is None and key not in self.key_to_block:
                self.block_key[block] = key
                self.key_to_block[key] = block
        seq.num_committed_blocks = full

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share ``parent``'s blocks with ``child``. Full blocks are shared by reference; a
        partial last block is copied (both will append to it). Returns the (src, dst) copy
        to perform, or None. The caller checks ``can_allocate(1)`` for the copy."""
        full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:full]
        for b in shared:
            self._ref(b)
        child.block_table = list(shared)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_committed_blocks = min(parent.num_committed_blocks, full)
        child.block_keys = list(parent.block_keys[:full])
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        dst = self._allocate()
        child.block_table.append(dst)
        return parent.block_table[full], dst

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s trailing blocks beyond those holding its first ``num_tokens``
        tokens: slots a speculative step allocated for drafts that were rejected."""
        keep = max(-(-num_tokens // self.block_size), seq.num_committed_blocks)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def reset_prefix_cache(self) -> None:
        for key, b in list(self.key_to_block.items()):
            if self.ref_counts[b] == 0:
                self.block_key[b] = None
                del self.key_to_block[key]

    # -- internals ----------------------------------------------------------------------

    def _allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free blocks")
        b, _ = self._free.popitem(last=False)
        key = self.block_key[b]
        if key is not None:  # evict it from the prefix cache
            del self.key_to_block[key]
            self.block_key[b] = None
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} freed twice"
        if self.ref_counts[b] == 0:
            self._free[b] = None
            if self.block_key[b] is None:
                self._free.move_to_end(b, last=False)  # nothing cached: reuse first

    def _ref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self._free[b]
        self.ref_counts[b] += 1
