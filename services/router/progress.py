"""Prefill's progress on one prompt, as the router learns it (the streamed handoff).

With ``--stream-handoff`` the router asks prefill for ``stream_progress``: prefill's answer
becomes a message stream of ``PrefillProgress`` (the leading run of the prompt's blocks
durable in the pool, and the lease) ending in the ``PrefillResult``. A
:class:`HandoffProgress` holds what has arrived so far; each choice's decode attempt
watches it and forwards every change to its decode instance as a ``HandoffUpdate``
(handoff.py), so decode loads blocks while prefill still computes. See docs/HANDOFF.md.

Watchers never miss a change: each one remembers the ``version`` it acted on and
:meth:`HandoffProgress.wait_newer` returns as soon as there is a newer one. Updates are
cumulative, so a watcher that is slow simply skips intermediate states.
"""

from __future__ import annotations

import asyncio

from libs.protocol.messages import PrefillProgress, PrefillResult


class HandoffProgress:
    """Latest known state of one prompt's prefill: durable blocks, lease, and its outcome."""

    def __init__(self) -> None:
        self.durable_blocks = 0
        self.num_blocks = 0
        self.lease_id: str | None = None
        self.result: PrefillResult | None = None
        self.error: str | None = None  # why prefill failed (its decision reason)
        self.version = 0
        self.progress_events = 0
        self._changed = asyncio.Event()

    @property
    def final(self) -> bool:
        """Prefill finished (``result``) or failed (``error``): no more changes."""
        return self.result is not None or self.error is not None

    @property
    def started(self) -> bool:
        """Prefill announced that it streams (or is already done)."""
        return self.progress_events > 0 or self.final

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def update(self, p: PrefillProgress) -> None:
        if self.final:
            return
        self.progress_events += 1
        self.num_blocks = p.num_blocks
        self.durable_blocks = max(self.durable_blocks, p.durable_blocks)
        self.lease_id = p.lease_id or self.lease_id
        self._bump()

    def finish(self, result: PrefillResult) -> None:
        if self.final:
            return
        self.result = result
        self.lease_id = result.lease_id or self.lease_id
        self._bump()

    def fail(self, reason: str) -> None:
        if self.final:
            return
        self.error = reason
        self._bump()

    async def wait_newer(self, version: int) -> None:
        """Return once ``self.version > version`` (at once if it already is)."""
        while self.version <= version:
            await self._changed.wait()

    async def wait_started(self) -> None:
        while not self.started:
            await self.wait_newer(self.version)
