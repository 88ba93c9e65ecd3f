"""Block keys: the one function prefill, decode, router and cache_store call to name KV blocks."""

from libs.blocks.keys import (
    KEY_BYTES,
    BlockKey,
    Namespace,
    NamespaceRoot,
    block_keys,
    chain_key,
    chain_keys,
    full_block_keys,
)

__all__ = ["KEY_BYTES", "BlockKey", "Namespace", "NamespaceRoot", "block_keys", "chain_key", "chain_keys", "full_block_keys"]
