"""Every Triton kernel the CPU tests ran in the interpreter also builds for the H100.

The interpreter runs code the compiler refuses (the speculative decoding rejection kernel
read a plain module global: every CPU test passed, and it did not compile on the GPU), so
during the test run tests/triton_launches.py records each kernel variant launched
(argument types with the GPU's specializations, ``tl.constexpr`` values, ``num_warps``)
and this test, which the
conftest moves to the end of the run, compiles a sample of them for sm_90 here, without a
GPU (tests/sm90_compile.py): per kernel the first variant launched of each combination
of its boolean ``tl.constexpr`` flags (each code path), the last, and the one with the
largest tiles. A compile error fails, and so does a variant that needs more shared memory
than a Hopper block has (it builds, but does not launch); spills are reported. (tests/unit/test_fp8_sm90_compile.py
checks the FP8 kernels' PTX in more detail.) In a run with the integration tests the build
starts in the background, at the lowest CPU priority, when they start (tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import sm90_compile, triton_launches
from tests.triton_launches import sample

pytestmark = pytest.mark.skipif(not triton_launches.recording(), reason="records interpreter launches (CPU runs)")


def test_sample_takes_every_code_path_the_last_and_the_largest():
    jobs = [dict(module="kernels.a", kernel="k", constexprs={"BLOCK_M": b, "BLOCK_N": 16, "SPLIT": b > 40}) for b in (32, 128, 64, 16)]
    jobs.append(dict(module="kernels.b", kernel="k", constexprs={"FLAG": True}))
    picked = sample(jobs)
    assert [j["constexprs"].get("BLOCK_M") for j in picked] == [32, 128, 16, None]


def test_recorded_kernels_build_for_hopper():
    if not sm90_compile.tools_available():
        pytest.skip("Triton's NVIDIA tools (ptxas, cuobjdump) are not installed")
    if not triton_launches.LAUNCHES:
        pytest.skip("no kernel launches recorded (run with the kernel tests: the conftest runs this test last)")
    built = triton_launches.build(Path(__file__).resolve().parents[2])
    kernels = {(j["module"], j["kernel"]) for j, _ in built}
    spills = [(j["kernel"], j["constexprs"], r["local"]) for j, r in built if r.get("local")]
    print(f"{len(built)} variants of {len(kernels)} kernels built for sm_90 ({len(triton_launches.LAUNCHES)} distinct launched); spills: {spills}")
    errors = [(f"{j['module']}.{j['kernel']}", j["constexprs"], r["error"]) for j, r in built if "error" in r]
    assert not errors, errors
    too_big = [(f"{j['module']}.{j['kernel']}", j["constexprs"], r["shared"]) for j, r in built if r["shared"] > sm90_compile.HOPPER_SHARED_BYTES]
    assert not too_big, too_big  # built, but it would not launch (as fp32 prefill attention once did on an H200)
