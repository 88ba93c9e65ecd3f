"""The launcher's supervisor (services/launch/supervisor.py) on small real child processes:
a killed child comes back (and stays up), restarts back off while a child keeps dying, a
stopped child is left alone, and ``paused`` holds one down."""

import logging
import os
import signal
import sys
import threading
import time

import pytest

from services.launch.processes import Child
from services.launch.supervisor import RestartPolicy, Supervisor

FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.4, stable_after_s=60, ready_timeout_s=10, poll_s=0.02)


def child(tmp_path, name: str = "svc", code: str = "import time; time.sleep(120)") -> Child:
    """A process that announces itself like a service, then runs ``code``."""
    script = f"print('tidepool {name} ready at http://127.0.0.1:1', flush=True); {code}"
    return Child(name, [sys.executable, "-c", script], log_path=tmp_path / f"{name}.log")


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def supervisor():
    s = Supervisor(FAST).start()
    yield s
    s.stop()


def test_backoff_doubles_up_to_the_cap():
    p = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=10, multiplier=2)
    assert [p.backoff(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [0.5, 1, 2, 4, 8, 10, 10]


def test_a_killed_child_is_restarted_stays_up_and_is_logged(tmp_path, supervisor, caplog):
    c = child(tmp_path)
    c.start()
    c.wait_ready(10)
    supervisor.watch(c)
    first = c.pid
    with caplog.at_level(logging.WARNING, logger="tidepool.launch"):
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: supervisor.restarts("svc") == 1)
    assert c.running and c.pid != first
    (event,) = supervisor.events
    assert event.exit == "SIGKILL" and event.attempt == 1 and event.downtime_s is not None
    assert "svc exited (SIGKILL)" in caplog.text and "svc is back" in caplog.text
    # The restart ran on a thread that has ended since: the child must not die with it
    # (PR_SET_PDEATHSIG follows the forking thread, not the process).
    time.sleep(0.5)
    assert c.running, "the restarted child died when its restart thread ended"
    c.stop()


def test_a_crash_loop_backs_off_and_keeps_trying(tmp_path, supervisor):
    c = child(tmp_path, code="import sys; sys.exit(3)")  # ready, then dies at once, every time
    c.start()
    c.wait_ready(10)
    supervisor.watch(c)
    wait_until(lambda: supervisor.restarts("svc") >= 4, timeout=20)
    c.stop()
    attempts = [e.attempt for e in supervisor.events]
    assert attempts[:4] == [1, 2, 3, 4]  # one streak: each restart waited longer
    assert supervisor.events[0].exit == "status 3"


def test_a_stopped_child_is_not_restarted_and_paused_holds_one_down(tmp_path, supervisor):
    stopped, held = child(tmp_path, "stopped"), child(tmp_path, "held")
    for c in (stopped, held):
        c.start()
        c.wait_ready(10)
        supervisor.watch(c)
    stopped.stop()  # a deliberate stop: not a crash
    with supervisor.paused(held):
        held.kill()
        time.sleep(0.5)
        assert not held.running and not stopped.running
    wait_until(lambda: supervisor.restarts("held") == 1)
    assert held.running and supervisor.restarts("stopped") == 0
    held.stop()


def test_a_restart_that_fails_to_come_up_is_retried(tmp_path, supervisor):
    flag = tmp_path / "broken"
    flag.write_text("")
    # Exits before announcing itself while the flag file exists, like a worker that fails to load.
    c = Child("svc", [sys.executable, "-c", f"import os, sys; os.path.exists({str(flag)!r}) and sys.exit(1); print('tidepool svc ready at http://127.0.0.1:1', flush=True); import time; time.sleep(120)"], log_path=tmp_path / "svc.log")
    flag.unlink()
    c.start()
    c.wait_ready(10)
    supervisor.watch(c)
    flag.write_text("")
    c.kill()
    wait_until(lambda: supervisor.events and supervisor.events[0].failed_starts >= 2)
    flag.unlink()
    wait_until(lambda: supervisor.restarts("svc") == 1)
    assert c.running
    c.stop()


def test_a_restart_counts_only_once_its_on_ready_has_run(tmp_path, supervisor):
    """Callers wait for ``restarts`` to grow and then use the child: the count must not lead
    the return's log line or its ``on_ready`` hook (it once led both, and a test read the
    log before the line was written)."""
    entered, release = threading.Event(), threading.Event()

    def on_ready(_child: Child) -> None:
        entered.set()
        release.wait(10)

    c = child(tmp_path)
    c.start()
    c.wait_ready(10)
    supervisor.watch(c, on_ready=on_ready)
    c.kill()
    assert entered.wait(10), "on_ready never ran"
    time.sleep(0.2)
    assert supervisor.restarts("svc") == 0, "the restart was counted before on_ready returned"
    release.set()
    wait_until(lambda: supervisor.restarts("svc") == 1)
    c.stop()
