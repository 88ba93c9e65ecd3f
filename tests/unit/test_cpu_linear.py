"""oneDNN packed linears (libs/model/cpu_linear.py): F.linear's result, row by row
independent of the batch, and swapped in for exactly the plain nn.Linear layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from libs.model import cpu_linear
from libs.model.attention import AttentionMetadata
from tests.models import tiny_loaded

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    got = cpu_linear.PackedLinear(lin)(x)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    # [..., in] inputs keep their leading shape
    torch.testing.assert_close(cpu_linear.PackedLinear(lin)(x.view(1, rows, 96)), got.view(1, rows, 200))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """A decode row and the same row inside a verify chunk agree bit for bit."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)
    packed = cpu_linear.pack(w)
    x = torch.randn(9, 576, generator=g)
    full = cpu_linear.packed_linear(x, packed)
    for m in (1, 2, 5):
        assert torch.equal(cpu_linear.packed_linear(x[:m], packed), full[:m])


def test_the_model_packs_its_plain_linears_and_computes_the_same():
    loaded = tiny_loaded()
    model = loaded.model
    T = 6
    ids = torch.randint(0, loaded.config.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    meta = _prefill_meta(T)
    cache = torch.zeros(4, len(model.layers), 2, 16, loaded.config.num_kv_heads, loaded.config.head_dim)
    model.bind_kv_cache(cache)
    ref = model.compute_logits(model(ids, torch.arange(T), meta))
    n = model.pack_linears()
    assert n == 4 * len(model.layers)  # qkv, o, gate_up, down
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert model.pack_linears() == 0  # packed layers are not packed again
    assert model.packed_head is not None
    got = model.compute_logits(model(ids, torch.arange(T), meta))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    assert not torch.equal(got, torch.zeros_like(got))


def _prefill_meta(T: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(T),
        block_tables=torch.zeros(1, 4, dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        num_decodes=0,
        num_prefill_tokens=T,
        max_seq_len=T,
    )
