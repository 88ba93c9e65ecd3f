"""``python -m tests.chaos`` (``make chaos``): the fault matrix against the real stack.

    python -m tests.chaos                      # every row, report to bench/results/chaos.md
    python -m tests.chaos --rows reduced       # one row per process kind
    python -m tests.chaos --rows "SIGKILL decode,overload 5x" --out /tmp/chaos.md

Exits 1 if any row misses the pass bar (tests/chaos/matrix.py).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
from pathlib import Path

from tests.chaos.faults import FAULTS, FULL, REDUCED
from tests.chaos.matrix import HEADER, markdown, row_cells, run_matrix


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="full", help=f"full, reduced, or a comma list of: {', '.join(FAULTS)}")
    p.add_argument("--concurrency", type=int, default=4, help="steady clients (default 4)")
    p.add_argument("--warm-s", type=float, default=5.0, help="load before each fault (default 5)")
    p.add_argument("--fault-s", type=float, default=10.0, help="length of timed faults (default 10)")
    p.add_argument("--after-s", type=float, default=5.0, help="load after recovery (default 5)")
    p.add_argument("--out", default="bench/results/chaos.md", help="the report (default bench/results/chaos.md)")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temporary folder)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    names = {"full": FULL, "reduced": REDUCED}.get(args.rows) or [n.strip() for n in args.rows.split(",")]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(FAULTS)}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tidepool-chaos-"))
    print(f"chaos: {len(names)} rows, service logs in {log_dir}", flush=True)
    print(" | ".join(HEADER), flush=True)
    results = run_matrix(
        names, log_dir, concurrency=args.concurrency, warm_s=args.warm_s, fault_s=args.fault_s, after_s=args.after_s,
        on_row=lambda r: print(" | ".join(row_cells(r)), flush=True),
    )
    report = markdown(
        results, command="python -m tests.chaos " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        concurrency=args.concurrency, warm_s=args.warm_s, fault_s=args.fault_s, after_s=args.after_s,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(f"report: {args.out}", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
