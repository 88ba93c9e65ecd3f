"""The decode-step fusions of issue 10 in the engine, bfloat16 through its CUDA graphs,
each against the same engine without it: greedy tokens equal, logprobs close.

- the Triton skinny GEMM serving every decode batch (``TIDEPOOL_SKINNY_MAX_M=64``; norms
  and the activation folded in) against cuBLAS and the separate norm and activation
  kernels (kernels/gemv);
- the same with FP8 weights (``TIDEPOOL_FP8_SKINNY_MAX_M=8``: the e4m3 weight read by the
  skinny GEMM) against kernels/fp8's block-scaled GEMMs;
- decode attention with rotary and the KV store folded in (``rotary_decode_attention``,
  ``TIDEPOOL_FUSED_DECODE``) against ``rotary_store_kv`` then the decode kernel.

The kernels themselves are compared with their references in tests/unit (which run here
on the GPU too)."""

import pytest
import torch

from kernels.gemv import threshold
from libs.engine import SamplingParams
from tests.gemv_calls import count_skinny_calls
from tests.gpu.test_engine_gpu import SMALL, hf_greedy, make, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def bf16_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.common import ours_from_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMALL)).cuda().float().eval()
    with torch.no_grad():  # peaked logits: greedy comparisons are not decided by bf16 rounding
        hf.model.embed_tokens.weight.normal_(0, 1.0)
    return hf, ours_from_hf(hf, torch.device("cuda"), torch.bfloat16)


def runs_under(loaded, monkeypatch, env: str, values: list[str], ps, params) -> dict:
    """The bf16 engine's outputs for ``ps`` with ``env`` set to each of ``values``, decoding
    through its CUDA graphs."""
    runs = {}
    for value in values:
        monkeypatch.setenv(env, value)
        eng = make(loaded, dtype="bfloat16")
        runs[value] = eng.generate(ps, params)
        assert eng.runner.graphs.replays["decode"] > 0
        eng.close()
    return runs


def test_decode_through_the_skinny_gemm_equals_cublas_and_transformers(bf16_models, monkeypatch):
    hf, loaded = bf16_models
    calls = count_skinny_calls(monkeypatch)
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    runs = runs_under(loaded, monkeypatch, threshold.ENV, ["0"], ps, params)
    assert calls == {"plain": 0, "silu_mul": 0, "norm": 0, "fp8": 0}
    runs.update(runs_under(loaded, monkeypatch, threshold.ENV, ["64"], ps, params))
    # every layer's four projections (qkv and gate/up with their norms, down with the
    # activation) and the LM head went through the kernel (captured graphs included)
    layers = SMALL["num_hidden_layers"]
    assert calls["norm"] >= 2 * layers and calls["silu_mul"] >= layers and calls["plain"] >= layers + 1
    assert runs["0"][0].token_ids[:4] == hf_greedy(hf, ps[0], 4)  # and bf16 is still the model
    for cublas, skinny in zip(runs["0"], runs["64"]):
        assert skinny.token_ids == cublas.token_ids
        a = torch.tensor([lp.top_logprobs for lp in cublas.logprobs])
        b = torch.tensor([lp.top_logprobs for lp in skinny.logprobs])
        assert torch.allclose(a, b, atol=5e-2, rtol=0), (a - b).abs().max()


def test_fp8_decode_through_the_skinny_gemm_equals_the_fp8_gemms(bf16_models, monkeypatch):
    """FP8 weights (quantized at load): every decode batch of at most 8 through the skinny
    GEMM with the e4m3 weight (``TIDEPOOL_FP8_SKINNY_MAX_M=8``; norms and the activation
    folded in) against kernels/fp8's block-scaled GEMMs (``=0``). Both quantize the
    activations the same way; only fp32 summation order differs."""
    from bench.common import ours_from_hf
    from libs.model.fp8 import quantize_projections

    hf, _ = bf16_models
    loaded = ours_from_hf(hf, torch.device("cuda"), torch.bfloat16)
    quantize_projections(loaded.model, torch.device("cuda"))
    calls = count_skinny_calls(monkeypatch)
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    monkeypatch.setenv(threshold.ENV, "0")  # the LM head (bf16) on cuBLAS: only FP8 layers count
    runs = runs_under(loaded, monkeypatch, threshold.FP8_ENV, ["0"], ps, params)
    assert calls["fp8"] == 0
    runs.update(runs_under(loaded, monkeypatch, threshold.FP8_ENV, ["8"], ps, params))
    layers = SMALL["num_hidden_layers"]
    assert calls["norm"] >= 2 * layers and calls["silu_mul"] >= layers and calls["plain"] >= layers
    assert calls["fp8"] == calls["norm"] + calls["silu_mul"] + calls["plain"]
    for gemm, skinny in zip(runs["0"], runs["8"]):
        assert skinny.token_ids == gemm.token_ids
        a = torch.tensor([lp.top_logprobs for lp in gemm.logprobs])
        b = torch.tensor([lp.top_logprobs for lp in skinny.logprobs])
        # the peaked logits reach -200, where one bf16 step of the logit is 1.0: a sum in
        # another order may land one step away (2**-8 relative)
        assert torch.allclose(a, b, atol=5e-2, rtol=2.0**-7), (a - b).abs().max()


def test_decode_with_rotary_and_kv_store_in_the_attention_kernel_equals_unfused(bf16_models):
    from kernels.attention import triton_attention
    from libs.model.attention import triton_backend

    _, loaded = bf16_models
    layers = loaded.model.layers
    calls = {"fused": 0}
    real = triton_attention.rotary_decode_attention

    def counting(*args):
        calls["fused"] += 1
        return real(*args)

    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    runs = {}
    try:
        for fused in (False, True):
            backend = triton_backend(fused_decode=fused)
            if fused:
                backend._rotary_decode = counting
            for layer in layers:
                layer.self_attn.backend = backend
            eng = make(loaded, dtype="bfloat16")
            runs[fused] = eng.generate(ps, params)
            assert eng.runner.graphs.replays["decode"] > 0
            eng.close()
    finally:
        for layer in layers:
            layer.self_attn.backend = triton_backend(fused_decode=False)
    assert calls["fused"] >= len(layers)  # captured into the decode graphs (and eager steps)
    for plain, fused in zip(runs[False], runs[True]):
        assert fused.token_ids == plain.token_ids
        a = torch.tensor([lp.top_logprobs for lp in plain.logprobs])
        b = torch.tensor([lp.top_logprobs for lp in fused.logprobs])
        assert torch.allclose(a, b, atol=5e-2, rtol=0), (a - b).abs().max()
