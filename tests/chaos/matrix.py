"""Running the chaos matrix: one row per fault, under steady load, and the report.

A row:

1. waits until the stack is fully healthy (``ChaosStack.problems`` is empty);
2. starts the steady load (tests/chaos/load.py) and lets it run ``warm_s``;
3. injects the fault (tests/chaos/faults.py), which blocks while the fault lasts;
4. measures the time to recover: from the end of the fault (at once for a SIGKILL; the
   SIGCONT, the latency removed, the last block corrupted for timed ones) until the stack
   is fully healthy again (every process up, the router ready, every instance registered
   and usable, Redis reachable from cache_store and every worker);
5. keeps the load on ``after_s`` more, then stops it and lets every request finish;
6. reads what is still held (``ChaosStack.wait_no_leaks``: leases get their TTL to expire).

The pass bar: 0 failed requests (429s are allowed: that is load shedding), 0 leaked blocks,
leases or requests, recovered within ``recover_timeout_s``, and no request the client had
to send twice unless the fault killed the client's own endpoint (the router).
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.faults import FAULTS, Context, Fault
from tests.chaos.load import LoadStats, SteadyLoad
from tests.chaos.stack import ChaosStack, Leaks
from tests.integration.pd_helpers import metrics


@dataclass
class RowResult:
    fault: Fault
    stats: LoadStats
    recovery_s: float | None
    leaks: Leaks
    note: str
    pool_misses: dict[str, float]
    landed: int | None = None

    @property
    def failures(self) -> list[str]:
        out = []
        if self.stats.failed:
            out.append(f"{self.stats.failed} failed ({', '.join(f'{k} {v}' for k, v in self.stats.errors.items())})")
        if self.leaks.total:
            out.append(f"leaked: {self.leaks.describe()}")
        if self.recovery_s is None:
            out.append("did not recover")
        if self.stats.client_retries and not self.fault.client_retries_allowed:
            out.append(f"{self.stats.client_retries} client retries")
        if self.stats.completed == 0:
            out.append("nothing completed")
        if self.landed == 0:
            out.append("the fault did not land")
        if self.fault.must_miss and not self.pool_misses.get(self.fault.must_miss):
            out.append(f"the fault did not land (no '{self.fault.must_miss}' pool misses)")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures


def _pool_misses(stack: ChaosStack) -> dict[str, dict[str, float]]:
    """Blocks not loaded from the pool, per worker and reason (their /metrics)."""
    out: dict[str, dict[str, float]] = {}
    for c in stack.workers:
        mine = out.setdefault(c.name, {})
        try:
            samples = metrics(c.url)
        except OSError:
            continue
        for key, value in samples.items():
            if key.startswith("tidepool_pool_miss_blocks_total{"):
                reason = key.split('reason="', 1)[1].split('"', 1)[0].split(":")[0]
                mine[reason] = mine.get(reason, 0) + value
    return out


def _misses_since(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Misses counted in between, summed over workers (a restarted worker counts from zero)."""
    total: dict[str, float] = {}
    for worker, counts in after.items():
        was = before.get(worker, {})
        restarted = any(counts.get(k, 0) < v for k, v in was.items())
        for reason, n in counts.items():
            d = n if restarted else n - was.get(reason, 0)
            if d:
                total[reason] = total.get(reason, 0) + d
    return total


def run_row(
    stack: ChaosStack,
    fault: Fault,
    *,
    concurrency: int,
    warm_s: float,
    fault_s: float,
    after_s: float,
    recover_timeout_s: float = 120.0,
) -> RowResult:
    if stack.wait_healthy(recover_timeout_s) is None:
        raise RuntimeError(f"the stack is not healthy before {fault.name!r}: {stack.problems()}")
    misses_before = _pool_misses(stack)
    load = SteadyLoad(stack.url, concurrency=concurrency, retry_connection_errors=fault.client_retries_allowed,
                      seed=zlib.crc32(fault.name.encode()) % 1000).start()
    ctx = Context(concurrency=concurrency, fault_s=fault_s, extra=LoadStats())
    try:
        time.sleep(warm_s)
        note = fault.inject(stack, ctx)
        recovery_s = stack.wait_healthy(recover_timeout_s)
        time.sleep(after_s)
    finally:
        stats = load.stop()
    stats.add(ctx.extra)
    leaks = stack.wait_no_leaks(stack.lease_ttl_s + 10.0)
    return RowResult(fault, stats, recovery_s, leaks, note, _misses_since(misses_before, _pool_misses(stack)), ctx.landed)


def run_matrix(names: list[str], log_dir: Path, *, concurrency: int, warm_s: float, fault_s: float, after_s: float,
               on_row=None) -> list[RowResult]:
    results = []
    with ChaosStack(log_dir) as stack:
        for name in names:
            result = run_row(stack, FAULTS[name], concurrency=concurrency, warm_s=warm_s, fault_s=fault_s, after_s=after_s)
            results.append(result)
            if on_row is not None:
                on_row(result)
    return results


# -- the report ------------------------------------------------------------------------------

HEADER = ["fault", "sent", "completed", "failed", "429", "client retries", "leaked blocks", "leaked leases",
          "time to recover (after the fault)", "latency p50 / max", "pool misses", "result", "what happened"]


def row_cells(r: RowResult) -> list[str]:
    lat = sorted(r.stats.latencies_s)
    latency = f"{statistics.median(lat):.1f} / {lat[-1]:.1f} s" if lat else "-"
    misses = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.pool_misses.items())) or "-"
    return [
        r.fault.name, str(r.stats.sent), str(r.stats.completed), str(r.stats.failed), str(r.stats.rejected),
        str(r.stats.client_retries), str(r.leaks.blocks), str(r.leaks.leases),
        "-" if r.recovery_s is None else f"{r.recovery_s:.1f} s", latency, misses,
        "pass" if r.passed else "FAIL: " + "; ".join(r.failures), r.note,
    ]


def markdown(results: list[RowResult], *, command: str, concurrency: int, warm_s: float, fault_s: float, after_s: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Chaos matrix",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; commit {commit}; command: `{command}`",
        f"- machine: {platform.machine()}, {_cpus()} CPUs, load average {_loadavg()} at the end (shared box)",
        "- stack: Redis (behind a latency proxy, 0 ms unless the row adds 50), cache_store, router, "
        "1 prefill, 2 decodes (SmolLM2-135M, CPU, 1 thread each), started by `services.launch` (supervised)",
        f"- load: {concurrency} closed-loop clients streaming completions (prompts 16-96 random tokens, "
        f"12-32 output tokens, ignore_eos); {warm_s:.0f} s before the fault, {after_s:.0f} s after recovery; "
        f"timed faults last {fault_s:.0f} s",
        "- pass bar: 0 failed (429 allowed), 0 leaked blocks/leases/requests (read from cache_store's and each "
        "worker's /stats after the load), recovered; the client re-sends a request only when the router itself died",
        "- pool misses: blocks prefill or decode did not load from the pool during the row, by reason, from their "
        "/metrics (`absent` includes prompts never written: shorter ones skip prefill; `after_gap`: blocks after the "
        "first miss); they show where a fault landed, and each one was recomputed",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in results]
    passed = sum(r.passed for r in results)
    lines += ["", f"{passed} of {len(results)} rows pass."]
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"
