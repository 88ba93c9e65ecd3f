"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU, and report each
compiled variant's registers, local-memory (spill) bytes and shared memory.

The CPU tests run kernels in Triton's interpreter, which accepts code the compiler refuses
(a plain module global read inside a kernel, for one) and says nothing of register
pressure. Triton compiles for a named target without a device (its wheel ships ptxas and
cuobjdump), so a test can at least prove that a kernel variant builds for the H100 and does
not spill. It runs in its own process: the test process has ``TRITON_INTERPRET=1``, under
which ``@triton.jit`` functions are not compilable.

    python -m tests.sm90_compile < jobs.json

A job names the kernel (``module``, ``kernel``), its ``constexprs`` (a ``tl.dtype`` as
``{"dtype": name}``), ``num_warps`` (and ``num_stages``, ``enable_fp_fusion``), and the other arguments' Triton
types, either each in ``types`` (``{"x_ptr": "*bf16", "n": "i32"}``, as
tests/triton_launches.py records them, with ``divisible``: the arguments Triton would
specialize as multiples of 16) or by default: ``ptr`` for every ``*_ptr``, fp32 for the
names in ``floats``, i32 for the rest. It prints one ``{"regs": int, "local": int, "shared": int}``
(or ``{"error": str}``) per job, as a JSON list; jobs compile in parallel.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory a block may take on an H100 / H200


def tools_available() -> bool:
    """ptxas and cuobjdump ship in Triton's NVIDIA backend."""
    return all((_bin_dir() / tool).exists() for tool in ("ptxas", "cuobjdump"))


def _bin_dir() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _constant(value):
    import triton.language as tl

    return getattr(tl, value["dtype"]) if isinstance(value, dict) else value


def compile_job(job: dict) -> dict:
    try:
        return _compile(job)
    except Exception as e:  # noqa: BLE001 - reported per job (a stale job, a compiler refusal)
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def _compile(job: dict) -> dict:
    kernel = compile_kernel(job)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(_bin_dir() / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {"regs": int(line.split("REG:")[1].split()[0]), "local": int(line.split("LOCAL:")[1].split()[0]),
            "shared": kernel.metadata.shared}


def compile_kernel(job: dict):
    """One job (the module docstring's form) compiled for sm_90: Triton's compiled kernel,
    whose ``asm`` holds the PTX and the cubin."""
    fn = getattr(importlib.import_module(job["module"]), job["kernel"])
    constexprs = {k: _constant(v) for k, v in job["constexprs"].items()}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif "types" in job:
            signature[name] = job["types"][name]
        elif name.endswith("_ptr"):
            signature[name] = job.get("ptr_types", {}).get(name, job["ptr"])
        elif name in job.get("floats", ()):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    options = {"num_warps": job.get("num_warps") or 4}
    if job.get("num_stages"):
        options["num_stages"] = job["num_stages"]
    if job.get("enable_fp_fusion") is not None:
        options["enable_fp_fusion"] = job["enable_fp_fusion"]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in job.get("divisible", ())}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=options)


def _compiler_env(cwd: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(cwd), TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"), OMP_NUM_THREADS="1")
    return env


_WORKERS_ENV = "TIDEPOOL_SM90_WORKERS"  # compile processes of one run (default: one per core)


class BackgroundRun:
    """``python -m module`` without ``TRITON_INTERPRET``, started now at the lowest CPU
    priority (``nice 19``) and with one compile process, while the caller goes on: where
    the running tests leave a core idle (CI's two cores, beside a single-threaded
    interpreter test or the integration tests' services), a cold build costs little wall
    time. (With a process per core, one cold run's first service stack took 30 s to start
    against 17 without the build.)"""

    def __init__(self, module: str, cwd: Path, stdin: str = ""):
        self.module = module
        self._input = tempfile.TemporaryFile("w+")
        self._input.write(stdin)
        self._input.seek(0)
        # `nice` rather than a preexec_fn: the test process has threads by then (the session
        # engine's), and Python code between fork and exec is not safe beside them.
        nice = [tool, "-n", "19"] if (tool := shutil.which("nice")) else []
        self._proc = subprocess.Popen(
            [*nice, sys.executable, "-m", module], stdin=self._input, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=cwd, env={**_compiler_env(cwd), _WORKERS_ENV: "1"}, start_new_session=True,
        )

    def stdout(self, timeout: float = 600) -> str:
        """Its stdout, once it has ended. Raises with the end of its stderr if it failed."""
        try:
            out, err = self._proc.communicate(timeout=timeout)
        finally:
            self._input.close()
        if self._proc.returncode != 0:
            raise RuntimeError(f"python -m {self.module} failed:\n{err[-3000:]}")
        return out

    def cancel(self) -> None:
        """Stop it and its worker processes (a run that ends before the test reading it)."""
        import os
        import signal

        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.communicate()
        self._input.close()


_prestarted: dict[str, BackgroundRun] = {}


def prestart(module: str, cwd: Path) -> None:
    """Start ``python -m module`` in the background (:class:`BackgroundRun`) for a test that
    will call ``run_without_interpreter(module)`` later in the session (the conftest starts
    the ones marked ``sm90_prestart`` when the session starts)."""
    if module not in _prestarted:
        _prestarted[module] = BackgroundRun(module, cwd)


def cancel_prestarted() -> None:
    while _prestarted:
        _prestarted.popitem()[1].cancel()


def run_without_interpreter(module: str, cwd: Path, stdin: str = "", timeout: float = 600) -> str:
    """``python -m module`` in a fresh process without ``TRITON_INTERPRET`` (whose kernels
    are compilable), or the run :func:`prestart` began; its stdout. Raises with the end of
    its stderr if it fails."""
    if not stdin and module in _prestarted:
        return _prestarted.pop(module).stdout(timeout)
    proc = subprocess.run([sys.executable, "-m", module], input=stdin, capture_output=True, text=True, cwd=cwd, env=_compiler_env(cwd), timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def compile_in_subprocess(jobs: list[dict], cwd: Path, timeout: float = 600) -> list[dict]:
    """Run ``jobs`` in a fresh interpreter without ``TRITON_INTERPRET``."""
    return json.loads(run_without_interpreter("tests.sm90_compile", cwd, json.dumps(jobs), timeout))


def compile_in_background(jobs: list[dict], cwd: Path) -> BackgroundRun:
    """:func:`compile_in_subprocess` started in the background; ``json.loads`` of its
    ``stdout()`` is the results."""
    return BackgroundRun("tests.sm90_compile", cwd, json.dumps(jobs))


if __name__ == "__main__":
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = json.load(sys.stdin)
    workers = int(os.environ.get(_WORKERS_ENV) or os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), workers))) as pool:
        print(json.dumps(list(pool.map(compile_job, jobs))))
