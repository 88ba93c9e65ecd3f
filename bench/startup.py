"""Cold and warm starts: how long until a restarted worker (or router) can serve again.

Recovery from a crash is only as fast as a start, so this measures, each in fresh
processes (imports included, nothing cached in the process) and as the median of
``--reps`` runs:

- ``load_model``: the embedded SmolLM2-135M GGUF (98 MB, Q4_1) to a float32 model on the
  CPU. Cold: converted from the GGUF (no cache). Warm: the converted-weights cache
  (libs/model/weight_cache.py) is filled, and the tensors are memory-mapped from it;
- a decode worker, ``python -m services.decode``: spawn to its ready line (engine loaded,
  socket bound), cold (empty ``--cache-dir``) and warm;
- the router, ``python -m services.router``: spawn to its ready line (its tokenizer comes
  from the GGUF's metadata, or from the cache);
- the peer: llama.cpp loading the same GGUF (``llama_cpp.Llama``, memory-mapped), in a
  fresh process too; "missing" without ``pip install llama-cpp-python``.

    python -m bench.startup [--reps 3] [--out bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import table

_LOAD = """
import time, sys
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from pathlib import Path
from libs.model import load_model
from libs.model.attention import make_backend
t1 = time.perf_counter()
cache = None if sys.argv[1] == "none" else Path(sys.argv[1])
load_model(None, dtype=torch.float32, device=torch.device("cpu"), backend=make_backend("torch", torch.device("cpu")), cache_dir=cache)
print(f"{time.perf_counter() - t1:.4f} {t1 - t0:.4f}")
"""

_LLAMA_CPP = """
import time, sys
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
Llama(model_path=sys.argv[1], n_ctx=512, n_threads=1, verbose=False)
print(f"{time.perf_counter() - t1:.4f} {t1 - t0:.4f}")
"""

_READY = re.compile(r"ready at ")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def timed_script(script: str, *args: str) -> tuple[float, float]:
    """(seconds the measured call took, seconds of imports) from a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=_env(), check=True)
    load, imports = out.stdout.split()[-2:]
    return float(load), float(imports)


def time_to_ready(argv: list[str], timeout_s: float = 300.0) -> float:
    """Seconds from spawning ``argv`` to its ``ready at`` line; the process is then stopped."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if _READY.search(line):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                break
        raise RuntimeError(f"{argv[2]} never announced itself")
    finally:
        proc.terminate()
        proc.wait(30)


def median_of(reps: int, fn) -> float:
    return statistics.median(fn() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from libs.model import default_model_path

    gguf = str(default_model_path())
    work = Path(tempfile.mkdtemp(prefix="tidepool-startup-"))
    cache = work / "cache"
    try:
        figures: dict[str, float | None] = {}

        def fresh_cache() -> Path:
            shutil.rmtree(cache, ignore_errors=True)
            return cache

        figures["load_model cold"] = median_of(args.reps, lambda: timed_script(_LOAD, "none")[0])
        timed_script(_LOAD, str(fresh_cache()))  # fills the cache
        figures["load_model warm"] = median_of(args.reps, lambda: timed_script(_LOAD, str(cache))[0])
        figures["imports (torch, libs)"] = timed_script(_LOAD, str(cache))[1]

        def worker(cache_dir: Path) -> list[str]:
            return [sys.executable, "-m", "services.decode", "--port", "0", "--device", "cpu", "--threads", "1",
                    "--num-blocks", "64", "--redis-url", "redis://127.0.0.1:9/0", "--cache-dir", str(cache_dir)]

        def cold_worker() -> float:
            return time_to_ready(worker(fresh_cache()))

        figures["decode worker cold"] = median_of(args.reps, cold_worker)
        figures["decode worker warm"] = median_of(args.reps, lambda: time_to_ready(worker(cache)))

        def router(cache_dir: Path) -> list[str]:
            return [sys.executable, "-m", "services.router", "--port", "0", "--cache-dir", str(cache_dir)]

        figures["router cold"] = median_of(args.reps, lambda: time_to_ready(router(fresh_cache())))
        time_to_ready(router(cache))
        figures["router warm"] = median_of(args.reps, lambda: time_to_ready(router(cache)))
        try:
            figures["llama.cpp load"] = median_of(args.reps, lambda: timed_script(_LLAMA_CPP, gguf)[0])
        except subprocess.CalledProcessError:
            figures["llama.cpp load"] = None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    peer = figures["llama.cpp load"]
    rows = []
    for name, value in figures.items():
        ratio = "-"
        if name.endswith("warm") and value:
            cold = figures[name.replace("warm", "cold")]
            ratio = f"{cold / value:.1f}x faster than cold"
            if name == "load_model warm" and peer:
                ratio += f"; {value / peer:.1f}x llama.cpp's load"
        rows.append([name, "missing" if value is None else f"{value:.2f}", ratio])
    print(table(["start", "seconds (median)", "ratio"], rows))
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": platform.machine(), "cpus": os.cpu_count(),
                "loadavg": Path("/proc/loadavg").read_text().split()[:3], "reps": args.reps}
        Path(args.out).write_text(json.dumps({"meta": meta, "seconds": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
