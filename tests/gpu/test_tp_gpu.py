"""Tensor parallelism on two GPUs (NCCL, one GPU per rank: run on ``nvidia-h200-x2``), the
CPU tests' twins (tests/unit/test_tp_model.py, test_tp_engine.py, test_tp_async.py), on a
random Qwen2 checkpoint written to disk (a TP engine's ranks load their own shards; the
GGUF does not travel to lent machines: the tokenizer comes from ``TIDEPOOL_TOKENIZER_DIR``
there, tests/models.py). Its 3 KV heads split unevenly (1 + 2) over the two ranks:

- the one-shot all-reduce (libs/dist/one_shot.py) sums as NCCL does, eagerly and in a
  CUDA graph, and leaves to NCCL what does not fit it;
- model level: two ranks (``torch.multiprocessing``), each loading its shard and running
  its own engine, eager and on CUDA graphs, with NCCL's all-reduce and the one-shot, give
  TP=1's first-step logits and greedy tokens;
- the instance: a TP=2 engine (this process is rank 0 on ``cuda:0``, it starts rank 1 on
  ``cuda:1``) with CUDA graphs captured on both ranks, synchronous and with async
  scheduling, equals the TP=1 engine token for token (greedy with chunked prefill, and
  seeded ``n=2``), replaying graphs on both ranks;
- the handoff through whole-block pool values, TP=2 -> TP=1 and TP=1 -> TP=2, continues
  exactly like TP=1.

float32 throughout, so TP's other summation order cannot flip a greedy choice.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from libs.dist import one_shot
from libs.engine import LLM, EngineConfig
from services.launch.processes import free_port
from tests import tp_worker
from tests.models import RAW_PROMPTS
from tests.unit.test_tp_engine import GREEDY, LONG, N, SEEDED, assert_same_tokens, export_values, import_and_continue, tp_config

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from tests.checkpoints import save_tokenizer, write_checkpoint

    folder = tmp_path_factory.mktemp("qwen2-3kv-gpu")
    config = dict(hidden_size=384, intermediate_size=768, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    write_checkpoint("Qwen2Config", "Qwen2ForCausalLM", config, folder, save_tokenizer(tmp_path_factory.mktemp("tok")))
    return str(folder)


def config(checkpoint: str, **kw) -> EngineConfig:
    base = {"model": checkpoint, "device": "cuda", "num_blocks": 512, "max_model_len": 2048, "tp_timeout_s": 60, "num_threads": None}
    return tp_config(**{**base, **kw})


def raw_prompts(tok) -> list[list[int]]:
    """A prompt of two chunks batched with two short ones (no chat template needed)."""
    return [tok.encode(LONG), tok.encode(RAW_PROMPTS[0]), tok.encode(RAW_PROMPTS[3])]


@pytest.fixture(scope="module")
def tp1(checkpoint):
    eng = LLM(config(checkpoint, tensor_parallel_size=1))
    yield eng
    eng.close()


def test_one_shot_all_reduce_sums_as_nccl(tmp_path):
    """Two ranks sum their own random values both ways. Each of the two bf16 (float32)
    sums is rounded once from the exact a + b either way, so they agree to the last bit;
    the test allows one bf16 ulp in [4, 8) (sums of two randn values stay below 8)."""
    mp.spawn(tp_worker.all_reduce_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        seen = torch.load(tmp_path / f"rank{r}.pt")
        assert [s["one_shot"] for s in seen] == [True, True, True, False] * 2 + [True] * 3  # the last size of each dtype: NCCL
        for s in seen:
            assert s["diff"] <= 2**-5, s
            assert s["input_kept"] in (True, None), s


@pytest.mark.parametrize(("graphs", "all_reduce"), [(False, "nccl"), (True, "nccl"), (False, "one_shot"), (True, "one_shot")],
                         ids=["eager", "graphs", "eager-one_shot", "graphs-one_shot"])
def test_model_level_tp2_equals_tp1(checkpoint, tp1, tmp_path, graphs, all_reduce):
    """Eager first: NCCL's collectives alone, then captured in the ranks' CUDA graphs; then
    both with the one-shot all-reduce. The graphs case once hung at the end, in
    ``destroy_process_group``, while the engine's graphs still held NCCL's resources:
    ``LLMEngine.close`` now destroys them first (bench/RESULTS.md, "Tensor parallelism")."""
    tok = tp1.tokenizer
    prompts = [tok.encode(RAW_PROMPTS[2]), tok.encode(RAW_PROMPTS[1])]
    args = (2, free_port(), checkpoint, prompts, N, str(tmp_path), "cuda", "float32", graphs, all_reduce)
    mp.spawn(tp_worker.run, args=args, nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = tp1.generate(prompts, GREEDY)
    for results in ranks:
        assert results["one_shot"] == (all_reduce == "one_shot")
        assert results["tokens"] == [o.token_ids for o in ref]
        for got, ids in zip(results["logits"], prompts):
            assert (got - tp1.first_step_logits(ids).cpu()).abs().max().item() < 1e-3


@pytest.mark.parametrize("scheduling", ["off", "on"])
def test_engine_tp2_on_graphs_equals_tp1(checkpoint, tp1, scheduling):
    """The default all-reduce ("auto") is the one-shot for every size it fits, in the first
    TP instance of this process; a later one (here: the second case) uses NCCL, as its
    fresh ranks' symmetric-memory rendezvous would not pair up with this process's
    (libs/dist/one_shot.py)."""
    first = one_shot.rendezvous_count() == 0
    eng = LLM(config(checkpoint, tensor_parallel_size=2, async_scheduling=scheduling))
    try:
        assert eng.runner.graphs is not None and eng.runner.cache.shape[4] == 1  # one of the 3 KV heads here
        assert (eng.tp.group.one_shot is not None) == first
        tok = eng.tokenizer
        assert_same_tokens(eng, tp1, raw_prompts(tok), GREEDY)
        assert_same_tokens(eng, tp1, [tok.encode(RAW_PROMPTS[4])], SEEDED)
        assert eng.runner.graphs.replays["decode"] > 0 and eng.runner.graphs.replays["prefill"] > 0
        assert eng.tp.failure is None
    finally:
        eng.close()


def test_handoff_tp2_to_tp1_and_back(checkpoint, tp1):
    eng = LLM(config(checkpoint, tensor_parallel_size=2))
    try:
        tok = eng.tokenizer
        p1 = tok.encode(" ".join(reversed(RAW_PROMPTS)))
        p2 = tok.encode(" ".join(RAW_PROMPTS[4:] + RAW_PROMPTS[:4]))
        first, values = export_values(eng, p1)
        tokens, imported = import_and_continue(tp1, p1, first, values)
        assert imported == len(p1) and tokens[:N] == tp1.generate([p1], GREEDY)[0].token_ids
        first, values = export_values(tp1, p2)
        tokens, imported = import_and_continue(eng, p2, first, values)
        assert imported == len(p2) and tokens[:N] == tp1.generate([p2], GREEDY)[0].token_ids
    finally:
        eng.close()
