"""Every Triton kernel the CPU tests ran in the interpreter also builds for the H100.

The interpreter runs code the compiler refuses (the speculative decoding rejection kernel
read a plain module global: every CPU test passed, and it did not compile on the GPU), so
during the test run tests/triton_launches.py records each kernel variant launched
(argument types with the GPU's specializations, ``tl.constexpr`` values, ``num_warps``)
and this test, which the
conftest moves to the end of the run, compiles a sample of them for sm_90 here, without a
GPU (tests/sm90_compile.py): per kernel the first variant launched of each combination
of its boolean ``tl.constexpr`` flags (each code path), the last, and the one with the
largest tiles. A compile error fails; spills are reported. (tests/unit/test_fp8_sm90_compile.py
checks the FP8 kernels' PTX in more detail.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests import sm90_compile, triton_launches

pytestmark = pytest.mark.skipif(not triton_launches.recording(), reason="records interpreter launches (CPU runs)")

PER_KERNEL = 8


def _tiles(job: dict) -> int:
    blocks = [v for k, v in job["constexprs"].items() if k.startswith("BLOCK") and isinstance(v, int) and not isinstance(v, bool)]
    return math.prod(blocks) if blocks else 0


def _flags(job: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in job["constexprs"].items() if isinstance(v, bool)))


def sample(jobs: list[dict]) -> list[dict]:
    """Per kernel: the first variant of each combination of flags, the last variant and the
    one with the largest tiles (at most ``PER_KERNEL``)."""
    by_kernel: dict[tuple[str, str], list[dict]] = {}
    for job in jobs:
        by_kernel.setdefault((job["module"], job["kernel"]), []).append(job)
    out = []
    for variants in by_kernel.values():
        first_of_flags: dict[tuple, dict] = {}
        for job in variants:
            first_of_flags.setdefault(_flags(job), job)
        picked = [*first_of_flags.values(), variants[-1], max(variants, key=_tiles)]
        out += list({id(j): j for j in picked}.values())[:PER_KERNEL]
    return out


def test_sample_takes_every_code_path_the_last_and_the_largest():
    jobs = [dict(module="kernels.a", kernel="k", constexprs={"BLOCK_M": b, "BLOCK_N": 16, "SPLIT": b > 40}) for b in (32, 128, 64, 16)]
    jobs.append(dict(module="kernels.b", kernel="k", constexprs={"FLAG": True}))
    picked = sample(jobs)
    assert [j["constexprs"].get("BLOCK_M") for j in picked] == [32, 128, 16, None]


def test_recorded_kernels_build_for_hopper():
    if not sm90_compile.tools_available():
        pytest.skip("Triton's NVIDIA tools (ptxas, cuobjdump) are not installed")
    jobs = list(triton_launches.LAUNCHES.values())
    if not jobs:
        pytest.skip("no kernel launches recorded (run with the kernel tests: the conftest runs this test last)")
    picked = sample(jobs)
    results = sm90_compile.compile_in_subprocess(picked, cwd=Path(__file__).resolve().parents[2], timeout=1200)
    kernels = {(j["module"], j["kernel"]) for j in picked}
    spills = [(j["kernel"], j["constexprs"], r["local"]) for j, r in zip(picked, results) if r.get("local")]
    print(f"{len(picked)} variants of {len(kernels)} kernels built for sm_90 ({len(jobs)} distinct launched); spills: {spills}")
    errors = [(f"{j['module']}.{j['kernel']}", j["constexprs"], r["error"]) for j, r in zip(picked, results) if "error" in r]
    assert not errors, errors
