"""The live prefill and decode instances: registration, heartbeats, expiry.

An instance announces itself with ``RegisterInstance`` and then sends a ``Heartbeat`` about
every second carrying its load, and ``DeregisterInstance`` when it goes down (dropped at
once). One without a heartbeat for ``heartbeat_timeout_s`` is dropped: it is never picked again, even before the reaper gets to it, and a heartbeat from
it is answered 404 so it registers again. Registering again under the same id (a restart)
replaces the old entry.

Besides what instances report, the registry keeps what only the router knows, so
placement is not blind between two heartbeats:

- ``dispatched``: requests this router sent the instance since its last heartbeat (a
  heartbeat is up to a second old, and a burst would otherwise all go to one instance);
- ``in_flight``: this router's requests running there now;
- ``unusable``: why the router stopped sending it work (a connection error, a broken
  stream, a 503). It clears on the instance's next heartbeat or registration, which is how
  an overloaded instance comes back and a killed one does not.
- ``full``: the instance answered 429 (its queue is at its bound). It stays a candidate,
  ranked after every instance with room, until its next heartbeat clears the mark; a
  request that found every instance full waits and retries (handoff.py), bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from libs.blocks import NamespaceRoot
from libs.protocol.messages import Heartbeat, RegisterInstance, Role

T = TypeVar("T")

log = logging.getLogger("tidepool.router.registry")


class IncompatibleInstance(ValueError):
    """A registration refused because the instance cannot work with the ones registered:
    a prefill and a decode whose weights run differently (``quantization``) compute
    different KV, so no block one writes is any use to the other."""


@dataclass(eq=False)
class Instance:
    """One registered instance, its last reported load and the router's own view of it."""

    info: RegisterInstance
    root: NamespaceRoot
    registered_at: float  # wall clock, for humans
    last_seen: float  # monotonic, for expiry
    last_seen_wall: float
    load: Heartbeat | None = None
    dispatched: int = 0
    in_flight: int = 0
    unusable: str | None = None
    full: bool = False

    @property
    def id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> Role:
        return self.info.role

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def namespace(self) -> str:
        return self.info.namespace

    @property
    def free_blocks(self) -> int | None:
        """Free KV blocks as last reported; None before the first heartbeat."""
        return None if self.load is None else self.load.free_blocks

    @property
    def load_estimate(self) -> int:
        """Requests on the instance: the larger of what it last reported (plus what was sent
        since) and what this router knows is running there now."""
        reported = 0
        if self.load is not None:
            reported = max(self.load.queue_depth, self.load.running + self.load.waiting)
        return max(self.in_flight, reported + self.dispatched)

    def describe(self, now: float, wall: float) -> dict[str, Any]:
        """The ``/v1/workers`` entry."""
        load = None
        if self.load is not None:
            load = {
                "running": self.load.running,
                "waiting": self.load.waiting,
                "queue_depth": self.load.queue_depth,
                "free_blocks": self.load.free_blocks,
                "total_blocks": self.load.total_blocks,
            }
        return {
            "id": self.id,
            "object": "worker",
            "role": self.role,
            "url": self.url,
            "model": self.info.model,
            "namespace": self.namespace,
            "quantization": self.info.quantization,
            "block_size": self.info.block_size,
            "max_model_len": self.info.max_model_len,
            "registered_at": round(self.registered_at, 3),
            "last_seen": round(self.last_seen_wall, 3),
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "load": load,
            "router_in_flight": self.in_flight,
            "usable": self.unusable is None,
            "unusable_reason": self.unusable,
            "full": self.full,
        }


@dataclass
class Registry:
    """Instances by id; ``clock`` is injectable so expiry can be tested without sleeping."""

    heartbeat_timeout_s: float
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    instances: dict[str, Instance] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def register(self, msg: RegisterInstance) -> Instance:
        """Add (or replace, on a restart) an instance; ``ValueError`` for a bad namespace,
        ``IncompatibleInstance`` for a quantization the other role's instances do not share."""
        root = NamespaceRoot.from_hex(msg.namespace, msg.block_size)
        other = "decode" if msg.role == "prefill" else "prefill"
        clash = next((i for i in self.live(other) if i.info.quantization != msg.quantization), None)
        if clash is not None:
            reason = (
                f"{msg.role} instance {msg.instance_id!r} runs {msg.quantization} weights but {other} instance "
                f"{clash.id!r} runs {clash.info.quantization}: prefill and decode must use the same --quantization "
                "(their KV caches would differ)"
            )
            log.warning("refused registration at %s: %s", msg.url, reason)
            raise IncompatibleInstance(reason)
        now, wall = self.clock(), self.wall_clock()
        previous = self.instances.get(msg.instance_id)
        inst = Instance(info=msg, root=root, registered_at=wall, last_seen=now, last_seen_wall=wall)
        self.instances[msg.instance_id] = inst
        if previous is None:
            log.info("registered %s %s at %s (max_model_len %d)", msg.role, msg.instance_id, msg.url, msg.max_model_len)
        else:
            log.info("re-registered %s %s at %s", msg.role, msg.instance_id, msg.url)
        self._notify()
        return inst

    def deregister(self, instance_id: str, role: str, reason: str = "") -> Instance | None:
        """Forget an instance that announced it is going down; None if it was unknown."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.role != role:
            return None
        del self.instances[instance_id]
        log.warning("%s %s at %s deregistered: %s", role, instance_id, inst.url, reason or "stopping")
        self._notify()
        return inst

    def heartbeat(self, msg: Heartbeat) -> Instance | None:
        """Record a heartbeat; None when the instance is unknown (or expired) and must register."""
        inst = self.instances.get(msg.instance_id)
        if inst is None or inst.role != msg.role or self._expired(inst, self.clock()):
            return None
        inst.load = msg
        inst.last_seen = self.clock()
        inst.last_seen_wall = self.wall_clock()
        inst.dispatched = 0
        if inst.unusable is not None or inst.full:
            if inst.unusable is not None:
                log.info("%s %s is usable again (heartbeat after: %s)", inst.role, inst.id, inst.unusable)
            inst.unusable = None
            inst.full = False
            self._notify()
        return inst

    def expire(self) -> list[Instance]:
        """Drop every instance whose heartbeats stopped; returns them."""
        now = self.clock()
        dead = [inst for inst in self.instances.values() if self._expired(inst, now)]
        for inst in dead:
            del self.instances[inst.id]
            log.warning(
                "dropped %s %s at %s: no heartbeat for %.1f s", inst.role, inst.id, inst.url, now - inst.last_seen
            )
        if dead:
            self._notify()
        return dead

    def live(self, role: Role) -> list[Instance]:
        """Registered instances of ``role`` whose heartbeats are current."""
        now = self.clock()
        return [i for i in self.instances.values() if i.role == role and not self._expired(i, now)]

    def usable(self, role: Role) -> list[Instance]:
        """Live instances of ``role`` the router is willing to send work to now."""
        return [i for i in self.live(role) if i.unusable is None]

    def mark_unusable(self, inst: Instance, reason: str) -> None:
        """Stop using ``inst`` until it heartbeats or registers again."""
        if self.instances.get(inst.id) is inst and inst.unusable is None:
            inst.unusable = reason
            log.warning("not using %s %s until its next heartbeat: %s", inst.role, inst.id, reason)

    def mark_full(self, inst: Instance) -> None:
        """``inst`` refused work with a 429; rank it last until its next heartbeat."""
        if self.instances.get(inst.id) is inst and not inst.full:
            inst.full = True
            log.info("%s %s is full (429) until its next heartbeat", inst.role, inst.id)

    def max_model_len(self, role: Role) -> int | None:
        """The longest prompt + completion any live ``role`` instance takes; None if there is none."""
        lens = [i.info.max_model_len for i in self.live(role)]
        return max(lens) if lens else None

    async def wait_for(self, find: Callable[[], T | None], timeout: float) -> T | None:
        """``find()`` once it is not None, re-trying on each registry change for up to
        ``timeout``; None if it never is.

        A router that just restarted knows no instance until their next heartbeat makes them
        register again, and a crashed instance comes back after its supervisor restarts it; a
        request arriving in that gap waits (a fault costs latency) instead of getting a 503."""
        deadline = time.monotonic() + timeout
        while (found := find()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.wait_for_change(left)
        return found

    def describe(self) -> list[dict[str, Any]]:
        now, wall = self.clock(), self.wall_clock()
        return [i.describe(now, wall) for i in sorted(self.instances.values(), key=lambda i: (i.role, i.id))]

    async def wait_for_change(self, timeout: float) -> None:
        """Return when an instance registers, recovers or is dropped, or after ``timeout``."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _expired(self, inst: Instance, now: float) -> bool:
        return now - inst.last_seen > self.heartbeat_timeout_s
