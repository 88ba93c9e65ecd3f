"""Run a service's app on uvloop until SIGINT/SIGTERM, then shut down cleanly.

Shutdown order: stop accepting connections, give in-flight requests
``settings.shutdown_timeout_s`` to finish, run the app's ``on_shutdown``/``on_cleanup``
hooks, then cancel and await any task still alive (each one is logged by name: a task that
outlives cleanup is a leak in the service, and it should be visible, not silent).

Once the app has started and its socket is bound, the heap it built is frozen out of the
garbage collector's scans (``gc_heap.freeze_startup_heap``) before the ready line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Callable

import uvloop
from aiohttp import web

from services.common.app import SERVICE_NAME
from services.common.gc_heap import freeze_startup_heap
from services.common.settings import BaseSettings

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Root logging at ``level`` to stderr, one line per record (the service's only log sink)."""
    logging.basicConfig(level=level.upper(), format=_LOG_FORMAT, stream=sys.stderr, force=True)


def run_service(
    app: web.Application,
    settings: BaseSettings,
    *,
    announce: Callable[[str], None] = lambda line: print(line, flush=True),
) -> None:
    """Serve ``app`` on ``settings.host:port`` with uvloop until SIGINT or SIGTERM.

    When the socket is bound, ``announce`` gets one line ending with the service's URL
    (``tidepool <name> ready at http://127.0.0.1:8000``); with ``port=0`` it carries the port
    the kernel picked, which is how launchers and tests find a service.
    """
    configure_logging(settings.log_level)
    uvloop.run(serve(app, settings, announce=announce))


async def serve(
    app: web.Application,
    settings: BaseSettings,
    *,
    announce: Callable[[str], None],
) -> None:
    """The coroutine behind :func:`run_service`, for callers that own the event loop."""
    name = app.get(SERVICE_NAME, "service")
    log = logging.getLogger(f"tidepool.{name}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that disconnects cancels its handler, so a streaming
    # handler learns at once (and a decode frees the request's blocks at once).
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, shutdown_timeout=settings.shutdown_timeout_s,
        handler_cancellation=True,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        # Everything alive now (for a worker: the model, its graphs) lives as long as the
        # process; take it out of the collector's sight (services/common/gc_heap.py).
        log.info("froze %d startup objects out of the garbage collector's scans", freeze_startup_heap())
        host, port = runner.addresses[0][:2]
        announce(f"tidepool {name} ready at http://{_url_host(host)}:{port}")
        await stop.wait()
        log.info("shutting down")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await _cancel_leftover_tasks(log)
    log.info("stopped")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _cancel_leftover_tasks(log: logging.Logger, *, rounds: int = 20, wait_s: float = 0.25) -> None:
    """Cancel what cleanup left running, and keep cancelling: on Python 3.11
    ``asyncio.wait_for`` (inside redis-py) can swallow a cancellation, so one ``cancel()``
    is not always enough. Gives up after ``rounds`` tries rather than hang the shutdown."""
    current = asyncio.current_task()
    leftover = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in leftover:
        log.warning("task %s still running after cleanup; cancelling", task.get_name())
    for _ in range(rounds):
        pending = [t for t in leftover if not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=wait_s)
    stuck = [t.get_name() for t in leftover if not t.done()]
    if stuck:
        log.error("tasks ignored cancellation, shutting down without them: %s", ", ".join(stuck))
