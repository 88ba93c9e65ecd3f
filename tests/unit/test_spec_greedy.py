"""Speculative decoding on the real SmolLM2-135M (CPU, float32): greedy output with each
proposer is token for token the output without speculation, on the engine-core tests'
prompts (tests/unit/test_engine_correctness.py), alone and in a mixed batch; n-gram
acceptance on a prompt that repeats itself is exactly what replaying the lookup over the
plain output predicts. Outputs are kept short: this is the expensive part of the suite."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from libs.engine import EngineConfig, LLM, SamplingParams
from libs.engine.spec.draft_model import load_draft, write_truncated_checkpoint
from libs.engine.spec.vocab import DraftVocab, count_tokens
from libs.model.attention import torch_backend
from tests.models import RAW_PROMPTS
from tests.spec_expectations import expected_ngram, metrics_match

N = 12
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return write_truncated_checkpoint(None, 4, tmp_path_factory.mktemp("draft") / "smollm2-4l")


@pytest.fixture(scope="module")
def vocab_file(engine, tmp_path_factory) -> Path:
    """A pruned vocabulary counted over this repository's documentation."""
    texts = [p.read_text() for p in [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]]
    counts = count_tokens(texts, lambda t: engine.tokenizer.encode(t, add_special_tokens=False), engine.vocab_size)
    path = tmp_path_factory.mktemp("vocab") / "vocab.safetensors"
    DraftVocab.from_counts(counts, 8192, always=engine.tokenizer.eos_token_ids).save(path)
    return path


@pytest.fixture(scope="module")
def prompts(core_prompts) -> list[list[int]]:
    return core_prompts


@pytest.fixture(scope="module")
def reference(engine, prompts) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))]


def spec_llm(engine, cfg: dict) -> LLM:
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=256, max_num_seqs=32, speculative_config=json.dumps(cfg))
    return LLM(config, loaded=engine.loaded)


PROPOSERS = {
    "ngram": lambda d, v: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "self_draft+pruned_vocab": lambda d, v: {"method": "self_draft", "num_draft_layers": 8, "num_speculative_tokens": 3, "draft_vocab": str(v), "min_acceptance_length": 0},
    "draft_model": lambda d, v: {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3, "min_acceptance_length": 0},
}


@pytest.mark.parametrize(
    "name",
    # make test runs the n-gram proposer; the two model proposers (~14 s each) run in make test-slow
    [pytest.param(name, marks=() if name == "ngram" else pytest.mark.slow) for name in PROPOSERS],
)
def test_greedy_equals_no_speculation_alone_and_in_a_mixed_batch(engine, prompts, reference, draft_dir, vocab_file, name):
    eng = spec_llm(engine, PROPOSERS[name](draft_dir, vocab_file))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
        sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=N + 5, ignore_eos=True) for s in (1, 2)]
        # Mixed: every prompt greedy, plus two sampled requests, in one batch.
        got = eng.generate(prompts + prompts[:2], [greedy] * len(prompts) + sampled)
        for i, (ids, want) in enumerate(zip(prompts, reference)):
            assert got[i].token_ids == want, (name, engine.tokenizer.decode(ids))
        # Alone: a raw prompt and a chat prompt, each by itself.
        for i in (2, len(RAW_PROMPTS)):
            assert eng.generate([prompts[i]], greedy)[0].token_ids == reference[i]
        m = eng.spec.metrics
        assert m.num_drafts > 0 and m.num_draft_tokens >= m.num_drafts
        if name != "self_draft+pruned_vocab":  # an untrained early exit may never be right
            assert m.num_accepted_tokens > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.close()


def test_ngram_acceptance_on_a_self_repeating_prompt_is_exactly_the_replayed_lookup(engine):
    """Greedy n-gram drafts are accepted exactly where they equal plain decoding's tokens."""
    prompt = engine.tokenizer.encode("red green blue yellow, red green blue yellow, red green blue yellow, red green")
    M = 32
    ref = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=M, ignore_eos=True))[0].token_ids
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "min_acceptance_length": 0}
    eng = spec_llm(engine, cfg)
    try:
        steps0 = eng.num_steps
        got = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=M, ignore_eos=True))[0].token_ids
        assert got == ref
        exp = expected_ngram(prompt, ref, k=4, min_n=2, max_n=4, max_tokens=M)
        snap = eng.spec.metrics.snapshot()
        assert metrics_match(snap, exp), (snap, exp)
        assert snap["mean_acceptance_length"] == pytest.approx(1 + exp["num_accepted_tokens"] / exp["num_drafts"])
        assert snap["mean_acceptance_length"] > 2.5  # the workload really is one that pays
        assert eng.num_steps - steps0 < M // 2
    finally:
        eng.close()


def test_a_draft_with_another_tokenizer_is_refused_at_load(engine, draft_dir, tmp_path):
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    for f in draft_dir.iterdir():
        if f.name != "tokenizer.json":
            (bad / f.name).symlink_to(f)
    tok = json.loads((draft_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "Ġworld"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different meaning
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizer"):
        load_draft(str(bad), engine.loaded, torch_backend())
    draft = load_draft(str(draft_dir), engine.loaded, torch_backend())  # the untouched one loads
    assert draft.config.num_layers == 4 and draft.dtype == torch.float32
    shutil.rmtree(bad)


def test_quantized_decode_verifies_on_the_4bit_path(prompts):
    """With the GGUF's 4-bit decode weights (``quantized_weights``), verification rows are
    generated tokens: every 4-bit layer must run them on its 4-bit path, as it runs decode
    rows, not on the exact prompt path. (Token equality with plain 4-bit decoding is not
    asserted: the verify rows' attention is the prefill kernel, whose fp32 rounding differs
    from the decode kernel's in the last bits, and the 4-bit path rounds activations to
    bfloat16, which can turn that into a different near-tie.)"""
    from libs.model.quantized import Int4Linear

    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "min_acceptance_length": 0}
    q = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=128, quantized_weights=True, speculative_config=json.dumps(cfg)))
    model = q.loaded.model
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    seen = []
    pre = model.register_forward_pre_hook(lambda mod, args: seen.append([args[2].num_decodes, args[2].num_verify_tokens]))
    post = layer.register_forward_hook(lambda mod, args, out: seen[-1].append(mod.decode_rows))
    try:
        ids = q.tokenizer.encode("red green blue, red green blue, red green blue, red")
        q.generate([ids, prompts[0]], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    finally:
        pre.remove()
        post.remove()
    verifying = [s for s in seen if s[1] > 0]
    assert verifying and q.spec.metrics.num_accepted_tokens > 0
    assert all(rows == nd + nv for nd, nv, rows in verifying)
