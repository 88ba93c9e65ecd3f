"""Programmatic dependent launch (kernels/pdl): when it is on, and what the kernels that
take part compile to on Hopper.

The overlap itself needs a GPU (tests/gpu/test_decode_fusions_gpu.py runs the engine's
graphs with PDL on and off and compares tokens); here: PDL stays off on the CPU and under
``TIDEPOOL_PDL=0``, and on sm_90 each kernel's PTX waits for the previous grid and then
lets the next one start, with nothing read before the wait but the skinny GEMM's weight
slice where one step covers K (weights: the only data no kernel of a step writes) and
decode attention's step metadata and cached keys (written two or more launches before it).
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


@pytest.mark.parametrize(("mode", "swap_ab", "normal"), [("", True, False), ("1", True, True), ("0", False, False)])
def test_fp8_kernels_take_pdl_with_the_swap_ab_plan_unless_forced(monkeypatch, mode, swap_ab, normal):
    """kernels/fp8's GEMM and quantizer: PDL with the swap-AB plan by default (measured
    faster in decode at batch 1-16, slower with the normal plan at batch 64);
    ``TIDEPOOL_PDL_FP8`` forces it on or off; the global switch and a GPU without PDL
    still win."""
    from kernels.fp8.triton_quant import FP8_PDL_ENV, fp8_pdl_launch

    on, off = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setenv(FP8_PDL_ENV, mode)
    assert fp8_pdl_launch("cuda:0", True) == (on if swap_ab else off)
    assert fp8_pdl_launch("cuda:0", False) == (on if normal else off)
    monkeypatch.setenv(pdl.ENV, "0")
    assert fp8_pdl_launch("cuda:0", True) == off
    monkeypatch.delenv(pdl.ENV)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)
    assert fp8_pdl_launch("cuda:0", True) == off


def test_fp8_pdl_rejects_an_unknown_mode(monkeypatch):
    from kernels.fp8.triton_quant import FP8_PDL_ENV, fp8_pdl_launch

    monkeypatch.setenv(FP8_PDL_ENV, "yes")
    with pytest.raises(ValueError, match=FP8_PDL_ENV):
        fp8_pdl_launch("cuda:0", True)


@pytest.mark.skipif(not tools_available(), reason="this Triton has no NVIDIA backend / ptxas")
@pytest.mark.sm90_prestart("tests.pdl_sm90_compile")
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
        elif name.startswith("decode pdl"):  # the step's metadata and its first tile of cached keys
            assert s["loads_before_wait"] > 0, (name, s)
        else:  # a loop over K, the GEMM on tensor cores, the other kernels: nothing read before the wait
            assert s["loads_before_wait"] == 0, (name, s)
