"""Which instance serves a request, and whether prefill runs at all.

Decode is chosen by load. In order of priority:

1. the instance shares the namespace prefill writes in (``namespace``), so the handoff's
   blocks are loadable there (any other decode still serves the request, recomputing);
2. it has not answered 429 since its last heartbeat (``Instance.full``);
3. it has room: free KV blocks for the prompt (``ceil((prompt + 1) / block_size)``); an
   instance before its first heartbeat counts as having room;
4. fewest requests (``Instance.load_estimate``: reported running + waiting, plus what this
   router sent since, or this router's own in-flight count when that is larger);
5. most free blocks; then the id, so equal instances are picked deterministically (the
   ``dispatched`` count then spreads a burst across them).

Prefill is chosen by queue depth (reported queue depth plus what was sent since), among
instances of the namespace decode will read from that are not full: with every prefill
full, decode computes the prompt itself.

Prefill is skipped (decode computes the prompt itself) for prompts shorter than the
threshold, where a handoff costs more than it saves, and for prompts whose blocks are
all in the pool already, where decode loads them directly (cache_store's answer; the
prefill call starts beside the query and is abandoned when it says so, handoff.py).
"""

from __future__ import annotations

from typing import Iterable

from services.router.registry import Instance

# Prefill decisions: the trace's ``prefill.decision`` and the metric's label.
PREFILL = "prefill"
SKIP_SHORT_PROMPT = "skip_short_prompt"
SKIP_IN_POOL = "skip_in_pool"
NO_PREFILL_INSTANCE = "no_prefill_instance"
PREFILL_FAILED = "prefill_failed"


def blocks_needed(prompt_len: int, block_size: int) -> int:
    return -(-(prompt_len + 1) // block_size)


def decode_key(inst: Instance, prompt_len: int, namespace: str | None) -> tuple[int, int, int, int, int, str]:
    """Sort key of a decode candidate: smaller is better (see the module docstring)."""
    free = inst.free_blocks
    lacks_room = free is not None and free < blocks_needed(prompt_len, inst.info.block_size)
    other_namespace = namespace is not None and inst.namespace != namespace
    return (int(other_namespace), int(inst.full), int(lacks_room), inst.load_estimate, -(free or 0), inst.id)


def pick_decode(candidates: Iterable[Instance], prompt_len: int, namespace: str | None = None) -> Instance | None:
    return min(candidates, key=lambda i: decode_key(i, prompt_len, namespace), default=None)


def pick_prefill(candidates: Iterable[Instance], namespace: str) -> Instance | None:
    same = [i for i in candidates if i.namespace == namespace and not i.full]
    return min(same, key=lambda i: (i.load_estimate, i.id), default=None)
