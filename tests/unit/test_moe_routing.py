"""Routing ops (libs/model/moe/routing.py): ``select_topk`` against transformers' own
routers, and ``FakeBalanceExpert``'s balance, determinism and distinct ids."""

from __future__ import annotations

import pytest
import torch

from libs.model.moe.routing import FakeBalanceExpert, Routing, select_topk

transformers = pytest.importorskip("transformers")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "family,renormalize",
    [("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True), ("qwen3_moe", False)],
)
def test_select_topk_equals_transformers_router(family, renormalize):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    experts, top_k, hidden = 16, 4, 32
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k)
        router = MixtralTopKRouter(cfg)
    else:
        cls, rcls = (transformers.Qwen2MoeConfig, Qwen2MoeTopKRouter) if family == "qwen2_moe" else (transformers.Qwen3MoeConfig, Qwen3MoeTopKRouter)
        cfg = cls(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=renormalize)
        router = rcls(cfg)
    g = _gen(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g))
    x = torch.randn(57, hidden, generator=g)
    logits, ref_weights, ref_ids = router(x)
    ours = select_topk(logits, top_k, renormalize=renormalize)
    assert ours.ids.dtype == torch.int32 and ours.weights.dtype == torch.float32
    assert torch.equal(ours.ids.long(), ref_ids)
    torch.testing.assert_close(ours.weights, ref_weights.float(), atol=0, rtol=0)
    if renormalize:
        torch.testing.assert_close(ours.weights.sum(-1), torch.ones(57), atol=1e-6, rtol=0)


def test_select_topk_sigmoid_and_errors():
    logits = torch.randn(9, 6, generator=_gen(2), dtype=torch.bfloat16)
    r = select_topk(logits, 2, scoring="sigmoid")
    scores = torch.sigmoid(logits.float())
    assert torch.equal(r.weights, scores.topk(2).values) and torch.equal(r.ids.long(), scores.topk(2).indices)
    r = select_topk(logits, 2, scoring="sigmoid", renormalize=True)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(9))
    with pytest.raises(ValueError, match="scoring"):
        select_topk(logits, 2, scoring="relu")
    with pytest.raises(ValueError, match="top_k"):
        select_topk(logits, 7)
    with pytest.raises(ValueError, match="tokens, experts"):
        select_topk(logits[0], 2)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 13, 64, 1000])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (6, 6), (5, 3)])
def test_fake_balance_is_balanced_within_one_and_distinct(num_tokens, num_experts, top_k):
    g = _gen(num_tokens)
    real = Routing(torch.rand(num_tokens, top_k, generator=g), torch.randint(0, num_experts, (num_tokens, top_k), generator=g, dtype=torch.int32))
    fake = FakeBalanceExpert(num_experts)(real)
    assert fake.ids.shape == real.ids.shape and fake.ids.dtype == torch.int32
    assert fake.weights is real.weights, "the router's weights are kept"
    counts = torch.bincount(fake.ids.flatten().long(), minlength=num_experts)
    assert int(counts.max() - counts.min()) <= 1, counts.tolist()
    for row in fake.ids.tolist():
        assert len(set(row)) == top_k, f"a token's experts repeat: {row}"


def test_fake_balance_is_deterministic_and_ignores_the_router():
    op = FakeBalanceExpert(16, offset=5)
    a = op(Routing(torch.rand(33, 4), torch.randint(0, 16, (33, 4), dtype=torch.int32)))
    b = op(Routing(torch.rand(33, 4), torch.randint(0, 16, (33, 4), dtype=torch.int32)))
    assert torch.equal(a.ids, b.ids)
    assert a.ids[0].tolist() == [5, 6, 7, 8]  # pair p -> (offset + p) mod E
    with pytest.raises(ValueError, match="distinct"):
        FakeBalanceExpert(3)(Routing(torch.rand(2, 4), torch.zeros(2, 4, dtype=torch.int32)))


@pytest.mark.parametrize("pairs", [1, 2, 3, 6, 7, 8, 13, 64, 100])
@pytest.mark.parametrize("num_experts,ranks", [(8, 2), (128, 2), (12, 4)])
def test_fake_balance_offsets_of_ep_ranks_keep_the_global_load_balanced(pairs, num_experts, ranks):
    """Each EP rank starts on its own experts (offset r * E / W): with equal batches the
    load over all experts stays within one pair."""
    counts = torch.zeros(num_experts, dtype=torch.long)
    for r in range(ranks):
        op = FakeBalanceExpert(num_experts, offset=r * num_experts // ranks)
        ids = op(Routing(torch.rand(pairs, 1), torch.zeros(pairs, 1, dtype=torch.int32))).ids
        counts += torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert int(counts.max() - counts.min()) <= 1, counts.tolist()
