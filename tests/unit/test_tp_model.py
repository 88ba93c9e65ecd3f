"""Tensor parallelism at the model level: the split rule, sharded loading, and TP=N greedy
output equal to TP=1 with gloo ranks on the CPU.

- ``TPShard.plan``: KV heads split in whole groups (evenly where N divides them, SmolLM2's
  3 heads over 2 ranks as 1 + 2), replicated when N exceeds them, every KV head written by
  exactly one rank; MLP and vocabulary split evenly (MLP cuts at multiples of 128 where
  possible); refusals (more ranks than heads, MoE, 4-bit GGUF weights, FP8 cuts inside a
  128-block) name the problem.
- FP8: a shard quantized alone has exactly the blocks of the TP=1 weight's shard.
- The real SmolLM2 at TP=2 and a tiny Qwen2 with 3 KV heads at TP=4 (replicated heads),
  each rank loading only its shard (tests/tp_worker.py): first-step logits within 2e-4 of
  TP=1's and 24 greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from libs.dist.groups import Group
from libs.engine import LLM, EngineConfig, SamplingParams
from libs.model.config import ModelConfig, MoEConfig
from libs.model.parallel import TPLayoutError, TPShard, split_range
from services.launch.processes import free_port
from tests import tp_worker
from tests.models import CHAT_PROMPTS, RAW_PROMPTS

pytestmark = pytest.mark.slow  # two-rank TP on the CPU: make test-slow runs it, make test not

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

N_GREEDY = 24


def cfg(heads: int, kv_heads: int, intermediate: int = 1536, vocab: int = 49152, **kw) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2", vocab_size=vocab, hidden_size=64 * heads, intermediate_size=intermediate, num_layers=2,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=64, max_position_embeddings=256, **kw,
    )


@pytest.mark.parametrize(
    "heads,kv_heads,tp,q_heads,kv",
    [
        (8, 4, 2, [(0, 4), (4, 8)], [(0, 2), (2, 4)]),  # Megatron's even split
        (9, 3, 2, [(0, 3), (3, 9)], [(0, 1), (1, 3)]),  # SmolLM2: whole groups, 1 + 2
        (6, 3, 4, [(0, 2), (2, 4), (4, 5), (5, 6)], [(0, 1), (1, 2), (2, 3), (2, 3)]),  # replicated
        (8, 2, 8, [(i, i + 1) for i in range(8)], [(i // 4, i // 4 + 1) for i in range(8)]),
    ],
)
def test_head_split(heads, kv_heads, tp, q_heads, kv):
    shards = [TPShard.plan(cfg(heads, kv_heads), tp, r) for r in range(tp)]
    assert [s.q_heads for s in shards] == q_heads
    assert [s.kv_heads for s in shards] == kv
    written = [h for s in shards for h in range(*s.kv_written)]
    assert sorted(written) == list(range(kv_heads))  # each KV head written by one rank
    for s in shards:  # every rank's local attention is plain GQA over whole groups
        assert s.num_heads % s.num_kv_heads == 0 and s.num_heads >= 1
        # its q heads use exactly its KV heads
        group = heads // kv_heads
        assert {h // group for h in range(*s.q_heads)} == set(range(*s.kv_heads))


def test_mlp_and_vocab_split():
    shards = [TPShard.plan(cfg(8, 4, intermediate=1280, vocab=49155), 4, r) for r in range(4)]
    assert [s.intermediate for s in shards] == [(0, 256), (256, 640), (640, 896), (896, 1280)]  # 128-aligned
    assert [s.vocab for s in shards] == [split_range(49155, 4, r) for r in range(4)]
    assert shards[0].vocab_sizes == [12288, 12289, 12289, 12289] and shards[0].vocab_per_rank == 12289
    assert TPShard.plan(cfg(8, 4, intermediate=96), 4, 1).intermediate == (24, 48)  # too small for 128s
    s = shards[1]
    assert s.slice("model.layers.0.self_attn.q_proj.weight") == (0, 2 * 64, 4 * 64)
    assert s.slice("model.layers.0.self_attn.k_proj.bias") == (0, 64, 128)
    assert s.slice("model.layers.0.self_attn.o_proj.weight") == (1, 128, 256)
    assert s.slice("model.layers.3.mlp.down_proj.weight") == (1, 256, 640)
    assert s.slice("model.embed_tokens.weight") == (0, *split_range(49155, 4, 1))
    assert s.slice("model.layers.0.input_layernorm.weight") is None


def test_splits_the_model_cannot_take_are_refused():
    with pytest.raises(TPLayoutError, match="exceeds the model's 4 attention heads"):
        TPShard.plan(cfg(4, 2), 8, 0)
    moe = cfg(4, 2, moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32))
    with pytest.raises(TPLayoutError, match="mixture-of-experts"):
        TPShard.plan(moe, 2, 0)


def test_loader_refusals_name_the_problem(tmp_path):
    """Refused before any collective: a group handle is never touched."""
    from libs.model import load_model
    from libs.model.attention import torch_backend

    pair = Group("tp", (0, 1), 0, None)
    with pytest.raises(TPLayoutError, match="quantized_weights .* tensor_parallel_size 1"):
        load_model(None, dtype=torch.float32, device=torch.device("cpu"), backend=torch_backend(), quantized_weights=True, tp=pair)
    with pytest.raises(TPLayoutError, match="fp8 with tensor_parallel_size 2 needs head_dim .* multiples of 128"):
        load_model(None, dtype=torch.float32, device=torch.device("cpu"), backend=torch_backend(), quantization="fp8", tp=pair)


def test_fp8_shards_have_the_tp1_blocks():
    from libs.model.fp8 import Fp8Weight

    torch.manual_seed(0)
    w = torch.randn(384, 512)
    full = Fp8Weight.quantize(w)
    for dim, (a, b) in ((0, (128, 384)), (1, (256, 512)), (1, (0, 128))):
        alone = Fp8Weight.quantize(w.narrow(dim, a, b - a))
        cut = full.narrow(dim, a, b)
        assert torch.equal(alone.q.view(torch.uint8), cut.q.view(torch.uint8)) and torch.equal(alone.scale, cut.scale)
        assert torch.equal(cut.dequantize(), full.dequantize().narrow(dim, a, b - a))
    odd = Fp8Weight.quantize(torch.randn(200, 130))  # padded: the last block is partial
    assert torch.equal(odd.narrow(0, 128, 200).dequantize(), odd.dequantize()[128:])
    with pytest.raises(ValueError, match="only along its 128-blocks"):
        full.narrow(0, 64, 192)


# -- TP=N against TP=1, one process per rank -------------------------------------------------


def run_ranks(world: int, model: str | None, prompts: list[list[int]], out: Path) -> list[dict]:
    mp.spawn(tp_worker.run, args=(world, free_port(), model, prompts, N_GREEDY, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_equal_to_tp1(ranks: list[dict], engine: LLM, prompts: list[list[int]]) -> None:
    ref_tokens = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N_GREEDY, ignore_eos=True))]
    ref_logits = [engine.first_step_logits(ids) for ids in prompts]
    for results in ranks:
        for got, ref in zip(results["logits"], ref_logits):
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 2e-4
        assert results["tokens"] == ref_tokens


def test_smollm2_tp2_equals_tp1(engine, smollm2_tokenizer, tmp_path):
    """SmolLM2-135M (9 query heads, 3 KV heads): rank 0 holds 1 KV head, rank 1 two."""
    prompts = [smollm2_tokenizer.encode_chat(CHAT_PROMPTS[0]), smollm2_tokenizer.encode(RAW_PROMPTS[1])]
    ranks = run_ranks(2, None, prompts, tmp_path)
    assert [(r["kv_heads"], r["cache_heads"], r["num_heads"]) for r in ranks] == [((0, 1), 1, 3), ((1, 3), 2, 6)]
    named = dict(engine.loaded.model.named_parameters())
    norms = sum(p.numel() for name, p in named.items() if "norm" in name)
    assert sum(r["params"] for r in ranks) == sum(p.numel() for p in named.values()) + norms  # only norms are held twice
    assert_equal_to_tp1(ranks, engine, prompts)


@pytest.fixture(scope="module")
def qwen2_3kv(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.checkpoints import save_tokenizer, write_checkpoint

    folder = tmp_path_factory.mktemp("qwen2-3kv")
    config = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                  max_position_embeddings=256, tie_word_embeddings=False)
    write_checkpoint("Qwen2Config", "Qwen2ForCausalLM", config, folder, save_tokenizer(tmp_path_factory.mktemp("tok")))
    return folder


def test_qwen2_3kv_tp4_replicates_kv_heads(qwen2_3kv, smollm2_tokenizer, tmp_path):
    """4 ranks over 3 KV heads: KV head 2 on ranks 2 and 3 (written by rank 2 only)."""
    prompts = [smollm2_tokenizer.encode_chat(CHAT_PROMPTS[1]), smollm2_tokenizer.encode(RAW_PROMPTS[3])]
    ranks = run_ranks(4, str(qwen2_3kv), prompts, tmp_path)
    assert [r["kv_heads"] for r in ranks] == [(0, 1), (1, 2), (2, 3), (2, 3)]
    assert [r["kv_written"] for r in ranks] == [(0, 1), (1, 2), (2, 3), (2, 2)]
    engine = LLM(EngineConfig(model=str(qwen2_3kv), device="cpu", dtype="float32", num_blocks=96))
    assert_equal_to_tp1(ranks, engine, prompts)
