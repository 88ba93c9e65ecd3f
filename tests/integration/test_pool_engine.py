"""A real model's KV blocks through real Redis: taken from the engine, encoded, put, got,
decoded and loaded into another engine, which then decodes exactly as without the pool."""

import asyncio

import pytest

from libs.blocks import block_keys
from libs.engine import EngineConfig, KVImport, LLM, SamplingParams
from libs.kvpool.codec import BlockCodec
from libs.kvpool.redis_pool import RedisPool

pytestmark = pytest.mark.integration


def test_real_kv_blocks_survive_the_pool(pool_config, reference_engine):
    loaded = reference_engine.loaded
    prefill = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=256, swap_max_blocks=4), loaded=loaded)
    decode = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=256, swap_max_blocks=4), loaded=loaded)
    tok = reference_engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Explain why the sky is blue, with an analogy about marbles. " * 2}])
    keys = block_keys(prefill.namespace, prompt)
    assert keys[-1].partial  # the tail block is partial: it travels too

    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    first = next(t for o in outs for c in o.outputs for t in c.new_token_ids)
    exported = outs[-1].exported_kv
    codec = BlockCodec(prefill.layout)
    values = [codec.encode(block, n) for block, n in exported.blocks()]
    exported.release()

    async def roundtrip():
        pool = RedisPool(pool_config)
        try:
            results = await pool.put_blocks(prefill.namespace, list(zip(keys, values)))
            assert results == [None] * len(keys)
            assert await pool.exists_prefix(prefill.namespace, keys) == len(keys)
            return await pool.get_blocks(decode.namespace, keys)  # decode computes the same keys
        finally:
            await pool.close()

    got = asyncio.run(roundtrip())
    assert [bytes(v) for v in values] == got
    bufs = []
    for i in range(0, len(got), 4):
        buf = decode.swapper.acquire(len(got[i : i + 4]))
        # Staging is reused and never cleared: the partial tail block's rows past its tokens
        # keep whatever was there. Poisoned, they must still not change a single token.
        buf.host.fill_(float("nan"))
        for j, (v, k) in enumerate(zip(got[i : i + 4], keys[i : i + 4])):
            assert BlockCodec(decode.layout).decode(v, buf.host[j], expected_tokens=k.num_tokens) == k.num_tokens
        bufs.append(buf)
    decode.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=16), output_prefix=[first], kv_import=KVImport(bufs, 0, len(prompt)))
    tokens = [first]
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens += [t for c in o.outputs for t in c.new_token_ids]
    assert decode.num_prompt_tokens_computed == 0  # nothing recomputed: all came from the pool
    assert tokens == reference_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].token_ids
