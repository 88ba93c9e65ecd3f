"""The fused elementwise kernels (kernels/norm, kernels/rope, kernels/activation) on CUDA at
real model sizes against the torch references run on the same GPU, and each kernel captured
in a CUDA graph and replayed on new input contents.

Shapes: SmolLM2-135M (hidden 576, 9/3 heads x 64, intermediate 1536) and Llama-3-8B
(hidden 4096, 32/8 heads x 128, intermediate 14336), at decode (1, 7 tokens) and prefill
(2048 tokens) sizes.

What is exact: rotary in every dtype (the kernel rounds after each product and the sum
exactly where torch does, and is compiled without fused multiply-adds), and the fused norm's
new residual (one fp32 add, one rounding). The norm and the activation differ from torch
only by the fp32 sum order and the hardware's rsqrt and exp: within a tolerance, and for
16-bit outputs bit-equal almost everywhere.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

triton = pytest.importorskip("triton")

from kernels.activation import reference as act_ref  # noqa: E402
from kernels.activation import triton_activation as act_tri  # noqa: E402
from kernels.norm import reference as norm_ref  # noqa: E402
from kernels.norm import triton_norm as norm_tri  # noqa: E402
from kernels.rope import reference as rope_ref  # noqa: E402
from kernels.rope import triton_rope as rope_tri  # noqa: E402
from libs.model.config import ModelConfig  # noqa: E402
from libs.model.llama import RotaryEmbedding  # noqa: E402

SMOLLM2 = dict(hidden=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate=1536)
LLAMA3_8B = dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate=14336)
MODELS = [SMOLLM2, LLAMA3_8B]
MODEL_IDS = ["smollm2", "llama3-8b"]
TOKENS = [1, 7, 2048]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
MAX_POSITIONS = 8192
EPS = 1e-5
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


def _randn(shape, dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _norm_rows(num_tokens: int, hidden: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows at very different magnitudes (squares of 3e3 overflow fp16; 3e-3 meets eps)."""
    scales = torch.tensor([1.0, 3e3, 3e-3, 40.0, 0.5], device="cuda")
    rows = scales[torch.arange(num_tokens, device="cuda") % len(scales)].unsqueeze(1)
    return (torch.randn((num_tokens, hidden), generator=gen, device="cuda") * rows).to(dtype)


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within ``dtype``'s tolerance, and for 16-bit math bit-equal almost everywhere (a
    rounding step done differently would change a large share of the elements)."""
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if dtype != torch.float32 and got.numel():
        differ = (got != expected).float().mean().item()
        assert differ <= 0.01, f"{differ:.1%} of the elements differ: a rounding step differs"


def _tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own fp32 cos/sin tables (HF layout) on the GPU."""
    cfg = ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=head_dim, intermediate_size=head_dim,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS, rope_theta=500000.0,
    )
    rotary = RotaryEmbedding(cfg).cuda()
    return rotary.cos, rotary.sin


def _qkv(num_tokens: int, model: dict, dtype, gen: torch.Generator):
    """q, k, v as the model makes them: views of one fused projection output."""
    h, kv, d = model["num_heads"], model["num_kv_heads"], model["head_dim"]
    qkv = _randn((num_tokens, (h + 2 * kv) * d), dtype, gen, scale=2.0)
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    return qkv, q.view(num_tokens, h, d), k.view(num_tokens, kv, d), v.view(num_tokens, kv, d)


# --------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_norms_match_reference(model, num_tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden = model["hidden"]
    x = _norm_rows(num_tokens, hidden, dtype, gen)
    residual = _norm_rows(num_tokens, hidden, dtype, gen).flip(0)
    weight = _randn(hidden, dtype, gen)
    _assert_matches(norm_tri.rms_norm(x, weight, EPS), norm_ref.rms_norm(x, weight, EPS), dtype)
    got, got_residual = norm_tri.fused_add_rms_norm(x, residual, weight, EPS)
    expected, expected_residual = norm_ref.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(got_residual, expected_residual)
    _assert_matches(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_apply_rotary_is_bit_exact_in_place(model, num_tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    cos, sin = _tables(model["head_dim"])
    _, q, k, v = _qkv(num_tokens, model, dtype, gen)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, device="cuda")
    positions[0] = MAX_POSITIONS - 1
    v_before = v.clone()
    expected_q, expected_k = rope_ref.apply_rotary(q, k, positions, cos, sin)
    got_q, got_k = rope_tri.apply_rotary(q, k, positions, cos, sin)
    assert got_q is q and got_k is k
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_silu_and_mul_matches_reference(model, num_tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = _randn((num_tokens, 2 * model["intermediate"]), dtype, gen, scale=5.0)
    _assert_matches(act_tri.silu_and_mul(x), act_ref.silu_and_mul(x), dtype)


# --------------------------------------------------------------------------- CUDA graphs


def _replays_match(
    step: Callable[[], object],
    refill: Callable[[torch.Generator], None],
    expect: Callable[[], object],
    check: Callable[[object, object], None],
) -> None:
    """Capture ``step`` once (after a warm-up that compiles its kernel), then three times:
    write new contents into the static inputs (``refill``), compute the reference on them
    (``expect``, before the replay, which may rotate inputs in place), replay, and
    ``check`` the graph's outputs against it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        refill(gen)
        expected = expect()
        graph.replay()
        torch.cuda.synchronize()
        check(out, expected)


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_rms_norm_cuda_graph_replays_new_inputs(num_tokens):
    dtype, hidden = torch.bfloat16, SMOLLM2["hidden"]
    x = torch.zeros((num_tokens, hidden), dtype=dtype, device="cuda")
    weight = torch.zeros(hidden, dtype=dtype, device="cuda")

    def refill(gen):
        x.copy_(_norm_rows(num_tokens, hidden, dtype, gen))
        weight.copy_(_randn(hidden, dtype, gen))

    _replays_match(
        lambda: norm_tri.rms_norm(x, weight, EPS),
        refill,
        lambda: norm_ref.rms_norm(x, weight, EPS),
        lambda out, expected: _assert_matches(out, expected, dtype),
    )


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_fused_add_rms_norm_cuda_graph_replays_new_inputs(num_tokens):
    dtype, hidden = torch.bfloat16, SMOLLM2["hidden"]
    x = torch.zeros((num_tokens, hidden), dtype=dtype, device="cuda")
    residual = torch.zeros_like(x)
    weight = torch.zeros(hidden, dtype=dtype, device="cuda")

    def refill(gen):
        x.copy_(_norm_rows(num_tokens, hidden, dtype, gen))
        residual.copy_(_norm_rows(num_tokens, hidden, dtype, gen).flip(0))
        weight.copy_(_randn(hidden, dtype, gen))

    def check(out, expected):
        assert torch.equal(out[1], expected[1])
        _assert_matches(out[0], expected[0], dtype)

    _replays_match(
        lambda: norm_tri.fused_add_rms_norm(x, residual, weight, EPS),
        refill,
        lambda: norm_ref.fused_add_rms_norm(x, residual, weight, EPS),
        check,
    )


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_apply_rotary_cuda_graph_replays_new_inputs(num_tokens):
    dtype = torch.bfloat16
    cos, sin = _tables(SMOLLM2["head_dim"])
    qkv, q, k, v = _qkv(num_tokens, SMOLLM2, dtype, torch.Generator(device="cuda").manual_seed(0))
    positions = torch.zeros(num_tokens, dtype=torch.int64, device="cuda")
    v_written = torch.empty_like(v)

    def refill(gen):
        qkv.copy_(_randn(qkv.shape, dtype, gen, scale=2.0))
        positions.copy_(torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, device="cuda"))
        v_written.copy_(v)

    def check(out, expected):
        assert out[0] is q and out[1] is k  # rotated in place inside the static qkv buffer
        assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
        assert torch.equal(v, v_written)

    _replays_match(
        lambda: rope_tri.apply_rotary(q, k, positions, cos, sin),
        refill,
        lambda: rope_ref.apply_rotary(q.clone(), k.clone(), positions, cos, sin),
        check,
    )


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_silu_and_mul_cuda_graph_replays_new_inputs(num_tokens):
    dtype = torch.bfloat16
    x = torch.zeros((num_tokens, 2 * SMOLLM2["intermediate"]), dtype=dtype, device="cuda")

    def refill(gen):
        x.copy_(_randn(x.shape, dtype, gen, scale=5.0))

    _replays_match(
        lambda: act_tri.silu_and_mul(x),
        refill,
        lambda: act_ref.silu_and_mul(x),
        lambda out, expected: _assert_matches(out, expected, dtype),
    )
