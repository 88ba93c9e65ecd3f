"""The fused elementwise kernels (kernels/norm, kernels/rope, kernels/activation): Triton
against the torch references, and the references against the model's own modules.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; with CUDA the same tests run the real kernels.

Tolerances: the kernels round exactly where the references do, so what is left is the
order of the norm's fp32 sum and the hardware's exp and rsqrt. Rotary has neither and is
bit-exact, except in the interpreter for bf16, whose casts to bf16 truncate instead of
rounding (one bf16 step per rounding); fp16 and fp32 run through the same kernel code and
pin the arithmetic down exactly there.

The model tests show that swapping libs/model/llama.py's RMSNorm, residual adds, rotary and
MLP activation for these references changes no bit of its output.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from kernels import select  # noqa: E402
from kernels.activation import reference as act_ref  # noqa: E402
from kernels.activation import triton_activation as act_tri  # noqa: E402
from kernels.norm import reference as norm_ref  # noqa: E402
from kernels.norm import triton_norm as norm_tri  # noqa: E402
from kernels.rope import reference as rope_ref  # noqa: E402
from kernels.rope import triton_rope as rope_tri  # noqa: E402
from libs.model.config import ModelConfig  # noqa: E402
from libs.model.llama import MLP, RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
EPS = 1e-5

# Norm and activation: fp32 sum order, exp and rsqrt leave fp32 within ~1e-6 relative and
# flip a 16-bit rounding now and then (one step: 2^-8 relative for bf16, 2^-11 for fp16).
# The interpreter's truncating bf16 casts can be off by a step at each of two roundings.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=3e-2 if INTERPRETED else 1.6e-2),
}
# Rotary is exact but for bf16 in the interpreter: up to a step of each product and the sum.
ROPE_INTERPRETED_BF16 = dict(atol=5e-2, rtol=2e-2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _bit_exact(dtype: torch.dtype) -> bool:
    """Where rounding to ``dtype`` behaves as in torch (everywhere but bf16 interpreted)."""
    return not (INTERPRETED and dtype == torch.bfloat16)


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Close within the tolerance of ``dtype`` (the dtype the math rounds to, which an fp32
    weight may promote the output past) and, for 16-bit math, bit-equal almost everywhere:
    a sum order or an exp an ulp apart flips a 16-bit rounding only rarely, while a missing
    or extra rounding step changes a large share of the elements (by one step, which the
    tolerance alone would let through)."""
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if dtype != torch.float32 and _bit_exact(dtype) and got.numel():
        differ = (got != expected).float().mean().item()
        assert differ <= 0.01, f"{differ:.1%} of the elements differ: a rounding step differs"


# --------------------------------------------------------------------------- RMSNorm


def _norm_rows(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows at very different magnitudes: the norm must see fp32 sums of squares
    (squares of 3e3 overflow fp16, of 3e-3 lose bf16 precision)."""
    x = torch.randn((num_tokens, hidden), generator=_gen(seed))
    scales = torch.tensor([1.0, 3e3, 3e-3, 40.0, 0.5])
    x *= scales[torch.arange(num_tokens) % len(scales)].unsqueeze(1)
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [576, 1000, 8192], ids=["h576", "h1000", "h8192"])
@pytest.mark.parametrize("num_tokens", [0, 1, 5], ids=["T0", "T1", "T5"])
def test_rms_norm_matches_reference(num_tokens, hidden, dtype):
    x = _norm_rows(num_tokens, hidden, dtype, seed=hidden + num_tokens)
    weight = _randn(hidden, dtype, seed=1)
    expected = norm_ref.rms_norm(x, weight, EPS)
    got = norm_tri.rms_norm(x, weight, EPS)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    _assert_matches(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [576, 1000], ids=["h576", "h1000"])
@pytest.mark.parametrize("num_tokens", [0, 1, 5], ids=["T0", "T1", "T5"])
def test_fused_add_rms_norm_matches_reference(num_tokens, hidden, dtype):
    x = _norm_rows(num_tokens, hidden, dtype, seed=hidden)
    residual = _norm_rows(num_tokens, hidden, dtype, seed=hidden + 1).flip(0)
    weight = _randn(hidden, dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    expected, expected_residual = norm_ref.fused_add_rms_norm(x, residual, weight, EPS)
    got, got_residual = norm_tri.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # not in place
    assert got_residual.dtype == dtype and got.dtype == expected.dtype
    if _bit_exact(dtype):
        assert torch.equal(got_residual, expected_residual)  # one fp32 add, one rounding
    else:
        torch.testing.assert_close(got_residual, expected_residual, **TOLERANCE[dtype])
    _assert_matches(got, expected, dtype)


def test_norms_read_strided_rows_and_promote_like_torch():
    # Rows that are column slices of a wider buffer (a fused projection's output), and an
    # fp16 stream with an fp32 weight: the output is fp32, as ``weight * x.to(fp16)`` is, and
    # still the product of the fp32 weight and the fp16-rounded normalised row.
    wide = _randn((6, 1500), torch.float16, seed=3, scale=5.0)
    x, residual = wide[:, :700], wide[:, 750:1450]
    weight = _randn(700, torch.float32, seed=4)
    expected = norm_ref.rms_norm(x, weight, EPS)
    got = norm_tri.rms_norm(x, weight, EPS)
    assert got.dtype == expected.dtype == torch.float32
    _assert_matches(got, expected, torch.float16)
    expected, expected_residual = norm_ref.fused_add_rms_norm(x, residual, weight, EPS)
    got, got_residual = norm_tri.fused_add_rms_norm(x, residual, weight, EPS)
    assert got.dtype == torch.float32 and got_residual.dtype == torch.float16
    assert torch.equal(got_residual, expected_residual)
    _assert_matches(got, expected, torch.float16)


def test_rms_norm_rejects_rows_too_wide_for_one_program():
    x = torch.zeros((1, norm_tri.MAX_HIDDEN + 1), device=DEVICE)
    with pytest.raises(ValueError, match="registers"):
        norm_tri.rms_norm(x, torch.ones(norm_tri.MAX_HIDDEN + 1, device=DEVICE), EPS)


# --------------------------------------------------------------------------- rotary


@functools.lru_cache(maxsize=None)
def _rotary(head_dim: int) -> RotaryEmbedding:
    """The model's own tables (HF layout, fp32) for ``head_dim``, on the test device."""
    cfg = ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=head_dim, intermediate_size=head_dim,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim, max_position_embeddings=4096,
    )
    return RotaryEmbedding(cfg).to(DEVICE)


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """q, k, v as the model makes them: views of one fused projection output."""
    qkv = _randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, seed, scale=2.0)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    return (qkv, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def _positions(num_tokens: int, seed: int) -> torch.Tensor:
    """Out of order, repeats allowed, the last table row included."""
    pos = torch.randint(0, 4096, (num_tokens,), generator=_gen(seed))
    if num_tokens:
        pos[0] = 4095
    return pos.to(DEVICE)


# (num_heads, num_kv_heads, head_dim): SmolLM2's 9/3 x 64, MQA, MHA x 128, and 80, whose
# half (40) is not a power of two.
ROPE_SHAPES = [(9, 3, 64), (4, 1, 32), (4, 4, 128), (6, 2, 80)]
ROPE_SHAPE_IDS = ["gqa9-3-d64", "mqa4-1-d32", "mha4-4-d128", "gqa6-2-d80"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=ROPE_SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [0, 1, 13], ids=["T0", "T1", "T13"])
def test_apply_rotary_matches_reference_in_place(num_tokens, shape, dtype):
    num_heads, num_kv_heads, head_dim = shape
    qkv, q, k, v = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim + num_tokens)
    positions = _positions(num_tokens, seed=num_tokens)
    rotary = _rotary(head_dim)
    v_before = v.clone()
    expected_q, expected_k = rope_ref.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    got_q, got_k = rope_tri.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    # In place: the kernel returns the views it was given, rotated inside the fused buffer.
    assert got_q is q and got_k is k
    assert torch.equal(v, v_before)
    if _bit_exact(dtype):
        assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    else:
        torch.testing.assert_close(got_q, expected_q, **ROPE_INTERPRETED_BF16)
        torch.testing.assert_close(got_k, expected_k, **ROPE_INTERPRETED_BF16)



@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=ROPE_SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [0, 1, 13], ids=["T0", "T1", "T13"])
def test_rotary_store_kv_equals_rotary_then_store(num_tokens, shape, dtype):
    """The fused kernel (the model's CUDA path) rotates q and k in place exactly as
    apply_rotary does and writes exactly the slots store_kv writes, padding skipped."""
    from kernels.attention import reference as attn_ref
    from kernels.attention import triton_attention as attn_tri

    num_heads, num_kv_heads, head_dim = shape
    block_size, num_blocks = 16, 4
    qkv, q, k, v = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim + num_tokens + 1)
    positions = _positions(num_tokens, seed=num_tokens + 1)
    rotary = _rotary(head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=_gen(num_tokens))[:num_tokens].to(DEVICE)
    if num_tokens > 1:
        slots[1] = -1  # padding: rotated, never stored
    # The engine's block-major cache: per-layer K and V are strided views.
    cache = _randn((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), dtype, seed=9)
    expected_cache = cache.clone()
    ref_q, ref_k = attn_ref.rotary_store_kv(q.clone(), k.clone(), v, positions, rotary.cos, rotary.sin,
                                            expected_cache[:, 1, 0], expected_cache[:, 1, 1], slots)
    # The reference is the composition of the two references.
    q2, k2 = rope_ref.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    assert torch.equal(ref_q, q2) and torch.equal(ref_k, k2)
    got_q, got_k = attn_tri.rotary_store_kv(q, k, v, positions, rotary.cos, rotary.sin, cache[:, 1, 0], cache[:, 1, 1], slots)
    assert got_q is q and got_k is k  # in place, inside the fused buffer
    if _bit_exact(dtype):
        assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k) and torch.equal(cache, expected_cache)
    else:
        torch.testing.assert_close(got_q, ref_q, **ROPE_INTERPRETED_BF16)
        torch.testing.assert_close(got_k, ref_k, **ROPE_INTERPRETED_BF16)
        torch.testing.assert_close(cache, expected_cache, **ROPE_INTERPRETED_BF16)
    # Layer 0 untouched, and the padded token's slot was not written.
    assert torch.equal(cache[:, 0], expected_cache[:, 0])


def test_apply_rotary_uses_both_halves_of_the_tables():
    # HF tables repeat their first half; tables whose halves differ show that each half of
    # a head rotates with its own half of the row, as in the reference.
    num_tokens, head_dim = 5, 32
    _, q, k, _ = _qkv(num_tokens, 2, 1, head_dim, torch.float32, seed=5)
    cos = _randn((64, head_dim), torch.float32, seed=6)
    sin = _randn((64, head_dim), torch.float32, seed=7)
    positions = torch.tensor([63, 0, 17, 17, 2], device=DEVICE)
    expected = rope_ref.apply_rotary(q, k, positions, cos, sin)
    got = rope_tri.apply_rotary(q, k, positions, cos, sin)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_apply_rotary_rejects_mismatched_shapes():
    _, q, k, _ = _qkv(3, 2, 1, 16, torch.float32, seed=8)
    rotary = _rotary(32)
    with pytest.raises(ValueError, match="cos must be"):
        rope_tri.apply_rotary(q, k, _positions(3, seed=0), rotary.cos, rotary.sin)
    with pytest.raises(ValueError, match="positions"):
        rope_tri.apply_rotary(q, k, _positions(2, seed=0), rotary.cos[:, :16], rotary.sin[:, :16])


# --------------------------------------------------------------------------- silu * up


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("intermediate", [1536, 2500], ids=["I1536", "I2500"])
@pytest.mark.parametrize("num_tokens", [0, 1, 6], ids=["T0", "T1", "T6"])
def test_silu_and_mul_matches_reference(num_tokens, intermediate, dtype):
    # 2500 spans three column blocks, the last partial. Gates up to about +-20 reach both
    # tails of the sigmoid.
    x = _randn((num_tokens, 2 * intermediate), dtype, seed=intermediate + num_tokens, scale=5.0)
    expected = act_ref.silu_and_mul(x)
    got = act_tri.silu_and_mul(x)
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype
    _assert_matches(got, expected, dtype)


def test_silu_and_mul_reads_strided_rows():
    wide = _randn((4, 3 * 700), torch.float32, seed=9, scale=3.0)
    x = wide[:, 100:1500]  # row stride 2100, gate and up 700 columns each
    torch.testing.assert_close(act_tri.silu_and_mul(x), act_ref.silu_and_mul(x), **TOLERANCE[torch.float32])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        act_tri.silu_and_mul(torch.zeros((2, 7), device=DEVICE))


# --------------------------------------------------------------------------- dispatch


def test_ops_for_picks_triton_on_cuda_and_the_references_elsewhere():
    cpu = select.ops_for("cpu")
    assert cpu is select.reference_ops() and cpu.rms_norm is norm_ref.rms_norm
    assert cpu.apply_rotary is rope_ref.apply_rotary and cpu.silu_and_mul is act_ref.silu_and_mul
    cuda = select.ops_for(torch.device("cuda", 0))
    assert cuda is select.triton_ops() and cuda.fused_add_rms_norm is norm_tri.fused_add_rms_norm
    assert cuda.apply_rotary is rope_tri.apply_rotary and cuda.silu_and_mul is act_tri.silu_and_mul


def test_triton_ops_have_the_reference_signatures():
    ref, tri = vars(select.reference_ops()), vars(select.triton_ops())
    assert ref.keys() == tri.keys() == {"rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul"}
    for name in ref:
        assert inspect.signature(ref[name]) == inspect.signature(tri[name]), name


# --------------------------------------------------------------------------- the model


def _model_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=96, intermediate_size=160, num_layers=3,
        num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    )


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_reference_is_the_model_norm(dtype):
    norm = _randomize(RMSNorm(576, EPS), seed=10).to(dtype)
    x = _norm_rows(7, 576, dtype, seed=11).cpu()
    with torch.no_grad():
        assert torch.equal(norm_ref.rms_norm(x, norm.weight, EPS), norm(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_reference_is_the_model_rotary(dtype):
    rotary = RotaryEmbedding(_model_config())
    _, q, k, _ = _qkv(9, 6, 2, 16, dtype, seed=12)
    q, k = q.cpu(), k.cpu()
    positions = torch.randint(0, 512, (9,), generator=_gen(13))
    expected_q, expected_k = rotary(positions, q, k)
    got_q, got_k = rope_ref.apply_rotary(q, k, positions, rotary.cos, rotary.sin)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_reference_is_the_model_mlp(dtype):
    mlp = _randomize(MLP(_model_config()), seed=14).to(dtype)
    x = torch.randn((5, 96), generator=_gen(15)).to(dtype)
    with torch.no_grad():
        assert torch.equal(mlp.down_proj(act_ref.silu_and_mul(mlp.gate_up_proj(x))), mlp(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_residual_stream_reproduces_the_model_layers(dtype):
    """Three decoder layers and the final norm, written as libs/model/llama.py's
    ``DecoderLayer`` and ``LlamaModel`` compose them (``h = h + attn(norm(h))``,
    ``h = h + mlp(norm(h))``, ``norm(h)``), against the fused formulation the model switches
    to: ``rms_norm`` once, then ``fused_add_rms_norm`` at every residual add. The attention
    is a stand-in projection: any function of the normed input will do."""
    cfg = _model_config()
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    layers = []
    for i in range(cfg.num_layers):
        layer = nn.ModuleDict(dict(
            input_layernorm=RMSNorm(hidden, eps), attn=nn.Linear(hidden, hidden, bias=False),
            post_attention_layernorm=RMSNorm(hidden, eps), mlp=MLP(cfg),
        ))
        layers.append(_randomize(layer, seed=16 + i).to(dtype))
    final_norm = _randomize(RMSNorm(hidden, eps), seed=20).to(dtype)
    h0 = torch.randn((4, hidden), generator=_gen(21)).to(dtype)
    ops = select.reference_ops()

    with torch.no_grad():
        h = h0
        for layer in layers:
            h = h + layer.attn(layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        expected = final_norm(h)

        h, residual = h0, None
        for layer in layers:
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.input_layernorm.weight, eps)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, layer.input_layernorm.weight, eps)
            attn_out = layer.attn(x)
            x, residual = ops.fused_add_rms_norm(attn_out, residual, layer.post_attention_layernorm.weight, eps)
            h = layer.mlp.down_proj(ops.silu_and_mul(layer.mlp.gate_up_proj(x)))
        got, _ = ops.fused_add_rms_norm(h, residual, final_norm.weight, eps)
    assert torch.equal(got, expected)
