"""Programmatic dependent launch (kernels/pdl): when it is on, and what the kernels that
take part compile to on Hopper.

The overlap itself needs a GPU (tests/gpu/test_decode_fusions_gpu.py runs the engine's
graphs with PDL on and off and compares tokens); here: PDL stays off on the CPU and under
``TIDEPOOL_PDL=0``, and on sm_90 each kernel's PTX waits for the previous grid and then
lets the next one start, with nothing read before the wait but the skinny GEMM's weight
slice where one step covers K (weights: the only data no kernel of a step writes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels import pdl
from tests.sm90_compile import run_without_interpreter, tools_available

ROOT = Path(__file__).resolve().parents[2]


def test_pdl_is_off_on_the_cpu():
    assert not pdl.pdl_enabled("cpu") and not pdl.pdl_enabled(None)
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}


def test_pdl_follows_the_capability_and_the_switch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)  # device 0 "Hopper", device 1 older
    assert pdl.pdl_launch("cuda:0") == {"PDL": True, "launch_pdl": True}
    assert not pdl.pdl_enabled("cuda:1")
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.pdl_launch("cuda:0") == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no grid dependency control
    assert not pdl.pdl_enabled("cuda:0")


def test_a_kernel_not_yet_measured_with_pdl_opts_in(monkeypatch):
    """kernels/fp8's GEMM and quantizer: PDL only with ``TIDEPOOL_PDL_FP8=1`` as well."""
    from kernels.fp8.triton_quant import FP8_PDL_ENV

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.delenv(FP8_PDL_ENV, raising=False)
    assert pdl.pdl_launch("cuda:0", opt_in=FP8_PDL_ENV) == {"PDL": False}
    monkeypatch.setenv(FP8_PDL_ENV, "1")
    assert pdl.pdl_launch("cuda:0", opt_in=FP8_PDL_ENV) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.ENV, "0")  # the global switch still turns it off
    assert pdl.pdl_launch("cuda:0", opt_in=FP8_PDL_ENV) == {"PDL": False}


@pytest.mark.skipif(not tools_available(), reason="this Triton has no NVIDIA backend / ptxas")
def test_kernels_wait_for_the_previous_grid_before_reading_what_it_wrote():
    got = json.loads(run_without_interpreter("tests.pdl_sm90_compile", ROOT, timeout=300).strip().splitlines()[-1])
    assert "skinny fp8 pdl=True" in got and "fp8 gemm pdl=True" in got and "fp8 quant pdl=True" in got
    for name, s in got.items():
        if name.endswith("pdl=False"):
            assert s["wait"] == 0 and s["launch_dependents"] == 0, (name, s)
            continue
        assert s["wait"] == 1 and s["launch_dependents"] == 1, (name, s)
        if name.startswith(("skinny pdl", "skinny norm pdl", "skinny fp8 pdl")):
            assert s["loads_before_wait"] > 0, (name, s)  # one step covers K: the weight slice is on its way
        else:  # a loop over K, the GEMM on tensor cores, the other kernels: nothing read before the wait
            assert s["loads_before_wait"] == 0, (name, s)
