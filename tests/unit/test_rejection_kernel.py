"""The rejection sampler (kernels/rejection): its semantics on hand-built cases, the Triton
kernel against the torch reference on fresh random inputs (in the interpreter here, on the
GPU in tests/gpu), and the property that makes speculation lossless: emitted tokens are
distributed exactly as samples from the target ``p``, whatever the draft ``q`` (a
chi-square test over many seeded draws of a toy pair with known ``p`` and ``q``).
"""

from __future__ import annotations

import pytest
import torch

from kernels.rejection import PLACEHOLDER
from kernels.rejection import reference as ref

triton = pytest.importorskip("triton")
from kernels.rejection import triton_rejection as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities (bins with p > 0)."""
    n = observed.sum()
    keep = expected_probs > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    exp = expected_probs[keep].double() * n
    stat = ((observed[keep].double() - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def random_case(B: int, K: int, V: int, *, seed: int, with_q: bool, greedy_frac: float = 0.3, sharp: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(B, K + 1, V, generator=g) * sharp
    p = torch.softmax(target_logits, dim=-1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * sharp, dim=-1) if with_q else None
    # Drafts: half drawn near the target's argmax (so greedy rows accept some), half random.
    argmax = target_logits.argmax(dim=-1)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, argmax[:, :K], torch.randint(0, V, (B, K), generator=g))
    n = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)
    greedy = torch.rand(B, generator=g) < greedy_frac
    u = torch.rand(B, K, generator=g)
    e = torch.empty(B, V).exponential_(generator=g)
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (drafts, n, q, p, argmax, greedy, u, e)]


# -- semantics ------------------------------------------------------------------------------


def test_greedy_accepts_while_drafts_match_then_emits_the_argmax():
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7], [1, 6, 7]])
    n = torch.tensor([3, 3, 3])
    out = ref.rejection_sample(drafts, n, None, None, argmax, torch.ones(3, dtype=torch.bool), torch.zeros(3, 3), torch.ones(3, 10))
    assert out.tolist() == [[5, 6, 7, -1], [5, 6, 7, 8], [5, -1, -1, -1]]


def test_fewer_drafts_than_k_and_no_drafts():
    argmax = torch.tensor([[5, 6, 7], [4, 3, 2]])
    drafts = torch.tensor([[5, 0], [9, 9]])
    out = ref.rejection_sample(drafts, torch.tensor([1, 0]), None, None, argmax, torch.ones(2, dtype=torch.bool), torch.zeros(2, 2), torch.ones(2, 10))
    assert out.tolist() == [[5, 6, -1], [4, -1, -1]]


def test_random_path_accepts_when_p_equals_q_and_emits_a_bonus_from_p():
    V = 8
    p = torch.softmax(torch.randn(1, 3, V), dim=-1)
    q = p[:, :2].clone()
    drafts = torch.tensor([[3, 4]])
    noise = torch.ones(1, V)
    out = ref.rejection_sample(drafts, torch.tensor([2]), q, p, p.argmax(-1), torch.tensor([False]), torch.full((1, 2), 0.999), noise)
    # p/q == 1 >= u: both accepted; with unit noise the race picks p's mode at position 2.
    assert out.tolist() == [[3, 4, int(p[0, 2].argmax())]]


def test_random_path_rejects_a_draft_the_target_rules_out_and_never_re_emits_it():
    V = 6
    p = torch.zeros(1, 2, V)
    p[0, 0, 2], p[0, 0, 4] = 0.5, 0.5
    p[0, 1, 1] = 1.0
    for seed in range(20):
        e = torch.empty(1, V).exponential_(generator=torch.Generator().manual_seed(seed))
        out = ref.rejection_sample(torch.tensor([[3]]), torch.tensor([1]), None, p, p.argmax(-1), torch.tensor([False]), torch.rand(1, 1), e)
        assert out[0, 0].item() in (2, 4) and out[0, 1].item() == PLACEHOLDER


# -- kernel vs reference ----------------------------------------------------------------------


@pytest.mark.parametrize("with_q", [False, True], ids=["q-onehot", "q-dense"])
@pytest.mark.parametrize("K", [0, 1, 4])
def test_kernel_matches_reference(with_q, K):
    for seed in range(3):
        args = random_case(7, K, 300, seed=seed * 10 + K, with_q=with_q and K > 0, sharp=3.0)
        if K == 0:
            args[2] = None
        want = ref.rejection_sample(*args)
        got = tri.rejection_sample(*args)
        assert torch.equal(got.cpu(), want.cpu()), (seed, got, want)


def test_kernel_matches_reference_all_greedy_without_target_probs():
    drafts, n, _, p, argmax, _, u, e = random_case(9, 3, 200, seed=5, with_q=False)
    greedy = torch.ones(9, dtype=torch.bool, device=DEVICE)
    want = ref.rejection_sample(drafts, n, None, None, argmax, greedy, u, e)
    assert torch.equal(tri.rejection_sample(drafts, n, None, None, argmax, greedy, u, e).cpu(), want.cpu())


def test_kernel_ties_break_to_the_first_index_across_tiles():
    # Equal weights everywhere: the race with unit noise ties over the whole vocabulary,
    # which spans several of the kernel's tiles; torch.argmax picks the first index.
    V = 2500
    p = torch.full((2, 1, V), 1.0 / V, device=DEVICE)
    e = torch.ones(2, V, device=DEVICE)
    args = (torch.zeros(2, 0, dtype=torch.long, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE), None, p,
            torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.zeros(2, dtype=torch.bool, device=DEVICE),
            torch.zeros(2, 0, device=DEVICE), e)
    assert ref.rejection_sample(*args).tolist() == tri.rejection_sample(*args).tolist() == [[0], [0]]


# -- distribution -------------------------------------------------------------------------------


# The kernel equals the reference token for token (above); in the interpreter thousands of
# programs take seconds each, so its own distribution run is left to the GPU.
IMPLS = ["reference", "triton"] if DEVICE == "cuda" else ["reference"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("draft", ["dense-q", "onehot-q"])
def test_emitted_tokens_are_distributed_as_the_target(impl, draft):
    """A toy pair over 6 tokens: the target's p at both positions and a draft q that is
    quite unlike it. Drafts are drawn from q; every emitted first token must follow p[0],
    and every emitted second token (present when the first draft was accepted) p[1]."""
    sample = ref.rejection_sample if impl == "reference" else tri.rejection_sample
    p0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    p1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    q0 = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.10, 0.20])
    N, V, K = 20000, 6, 1
    g = torch.Generator().manual_seed(1234)
    p = torch.stack([p0, p1]).expand(N, 2, V).contiguous()
    if draft == "dense-q":
        drafts = torch.multinomial(q0, N, replacement=True, generator=g).view(N, 1)
        q = q0.expand(N, 1, V).contiguous()
    else:  # a deterministic proposer: always token 1 (q one-hot there)
        drafts = torch.full((N, 1), 1, dtype=torch.long)
        q = None
    u = torch.rand(N, K, generator=g)
    e = torch.empty(N, V).exponential_(generator=g)
    args = [drafts, torch.ones(N, dtype=torch.int32), q, p, p.argmax(-1), torch.zeros(N, dtype=torch.bool), u, e]
    out = sample(*[a.to(DEVICE) if a is not None else None for a in args]).cpu()
    first = torch.bincount(out[:, 0], minlength=V)
    assert chi2_pvalue(first, p0) > 1e-3, first
    # The second token is drawn with noise independent of the first token's value only
    # when the first was accepted; test it over those rows.
    accepted = out[:, 1] != PLACEHOLDER
    second = torch.bincount(out[accepted, 1], minlength=V)
    assert accepted.sum() > N // 5
    assert chi2_pvalue(second, p1) > 1e-3, second


def test_chi2_helper_rejects_a_wrong_distribution():
    """The test above can fail: the helper flags samples from q against p."""
    g = torch.Generator().manual_seed(0)
    q0 = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.10, 0.20])
    p0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    counts = torch.bincount(torch.multinomial(q0, 4000, replacement=True, generator=g), minlength=6)
    assert chi2_pvalue(counts, p0) < 1e-6
