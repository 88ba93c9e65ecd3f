"""Supervision: any launched process that dies is started again, with backoff, and logged.

Why: a crashed worker, router, cache_store or Redis used to take the whole local cluster
down with it (``make run`` stopped everything when one child exited). Faults must cost
latency, never the service, so every child the launcher starts is watched:

- a wanted child (services/launch/processes.py) that is not running is restarted with the
  same argv, so it comes back under the same name, port (router, cache_store, Redis) and
  instance id (workers re-register and replace their old entry in the router);
- restarts back off exponentially (``initial_backoff_s`` doubling up to ``max_backoff_s``)
  while a child keeps dying; one that stayed up ``stable_after_s`` starts over at the
  initial backoff, so a crash an hour later is restarted at once;
- a restart that fails to come up (exits, or is not ready in ``ready_timeout_s``) counts
  as another crash and backs off again: the supervisor never gives up on a child;
- every exit and every return is logged with the exit status and timings, and recorded
  in ``events`` (what tests and the chaos matrix read).

Recovery around a restart is the services' own business: workers re-register with the
router, clients of a restarted Redis reconnect (services/worker/pool_health.py), the router
resumes a broken decode stream on another or the restarted instance. A child's restart
runs on its own thread, so a slow one (a worker loading its model) never delays another.
``paused`` holds one child down (tests that need an outage of known length).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from services.launch.processes import Child, ServiceStartError, describe_exit

log = logging.getLogger("tidepool.launch")


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    multiplier: float = 2.0
    stable_after_s: float = 30.0
    ready_timeout_s: float = 180.0
    poll_s: float = 0.1

    def backoff(self, consecutive_failures: int) -> float:
        """Delay before restart number ``consecutive_failures`` (1-based) of a crash streak."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, consecutive_failures - 1))


@dataclass
class RestartEvent:
    """One exit of a wanted child and, once it is back, its return."""

    name: str
    exit: str
    uptime_s: float
    attempt: int  # 1 for the first restart of a crash streak
    died_at: float  # monotonic
    back_at: float | None = None
    failed_starts: int = 0

    @property
    def downtime_s(self) -> float | None:
        return None if self.back_at is None else self.back_at - self.died_at


@dataclass
class _Watch:
    child: Child
    on_ready: Callable[[Child], None] | None
    streak: int = 0
    restarting: bool = False
    paused: int = 0


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    events: list[RestartEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- configuration --------------------------------------------------------------------

    def watch(self, child: Child, on_ready: Callable[[Child], None] | None = None) -> None:
        """Restart ``child`` whenever it dies while wanted; ``on_ready`` runs after each return."""
        with self._lock:
            self._watches[child.name] = _Watch(child, on_ready)

    def restarts(self, name: str) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.name == name and e.back_at is not None)

    @contextmanager
    def paused(self, child: Child) -> Iterator[None]:
        """Do not restart ``child`` inside this block (it is restarted after, if it is down)."""
        with self._lock:
            self._watches[child.name].paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._watches[child.name].paused -= 1

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Supervisor":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """No restart starts after this returns (one already starting finishes its start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_s):
            with self._lock:
                due = [w for w in self._watches.values() if not w.restarting and not w.paused and w.child.wanted and not w.child.running]
                for w in due:
                    w.restarting = True
            for w in due:
                threading.Thread(target=self._restart, args=(w,), name=f"restart-{w.child.name}", daemon=True).start()

    def _restart(self, w: _Watch) -> None:
        child, p = w.child, self.policy
        try:
            uptime = child.uptime_s
            if uptime >= p.stable_after_s:
                w.streak = 0
            w.streak += 1
            event = RestartEvent(
                child.name, describe_exit(child.proc.returncode if child.proc else None), uptime, w.streak, time.monotonic()
            )
            with self._lock:
                self.events.append(event)
            while not self._stop.is_set():
                delay = p.backoff(w.streak)
                log.warning(
                    "%s exited (%s) after %.1f s up; restart %d in %.1f s",
                    child.name, event.exit, uptime, w.streak, delay,
                )
                if self._stop.wait(delay):
                    return
                with child.lock:
                    if not child.wanted or child.running:  # stopped, or restarted by someone else
                        return
                    if self._stop.is_set():
                        return
                    child.start()
                try:
                    child.wait_ready(p.ready_timeout_s)
                except ServiceStartError as exc:
                    event.failed_starts += 1
                    w.streak += 1
                    uptime = child.uptime_s
                    log.warning("%s did not come back: %s", child.name, exc)
                    with child.lock:
                        if child.running:
                            child.proc.kill()  # type: ignore[union-attr]
                            child.proc.wait()  # type: ignore[union-attr]
                    continue
                # The restart is counted (``restarts``) only once it is logged and ``on_ready``
                # has run: a caller that waits for the count sees the whole return.
                back_at = time.monotonic()
                log.warning("%s is back after %.1f s (restart %d, pid %s)", child.name, back_at - event.died_at, w.streak, child.pid)
                try:
                    if w.on_ready is not None:
                        w.on_ready(child)
                finally:
                    with self._lock:
                        event.back_at = back_at
                return
        except Exception:  # the supervisor's thread must never die silently
            log.exception("restarting %s failed", child.name)
        finally:
            with self._lock:
                w.restarting = False
