"""The GGUF 4-bit path (EngineConfig.quantized_weights, libs/model/quantized.py)."""

import functools

import gguf
import numpy as np
import pytest
import torch

from libs.engine import EngineConfig, LLM, SamplingParams
from libs.model import default_model_path
from libs.model.quantized import Int4Linear, Int8Linear, read_q4
from tests.models import CHAT_PROMPTS, RAW_PROMPTS


@functools.cache
def _reader() -> gguf.GGUFReader:
    """gguf's own reader of the embedded model, built once (~4 s each time on 2 cores)."""
    return gguf.GGUFReader(str(default_model_path()))


def gguf_tensor(name: str):
    return next(t for t in _reader().tensors if t.name == name)


def test_q4_1_unpacks_exactly_as_gguf_dequantizes():
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight"):
        t = gguf_tensor(name)
        assert t.tensor_type.name == "Q4_1"
        dense = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        w = read_q4(t.data, "Q4_1", tuple(dense.shape))
        assert torch.equal(w.dequantize(), dense)


def test_q4_0_unpacks_exactly_as_gguf_dequantizes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).astype(np.float32))
    assert torch.equal(read_q4(raw, "Q4_0", (48, 256)).dequantize(), dense)


def test_int4_linear_splits_decode_and_prompt_rows():
    torch.manual_seed(0)
    t = gguf_tensor("blk.1.ffn_gate.weight")
    w = read_q4(t.data, "Q4_1", (int(t.shape[1]), int(t.shape[0])))
    lin, dense = Int4Linear(w), w.dequantize()
    x = torch.randn(7, dense.shape[1])
    ref = x @ dense.t()
    lin.decode_rows = 3
    y = lin(x)
    assert torch.equal(y[3:], torch.nn.functional.linear(x[3:], dense))  # prompt rows: exact
    rel = (y[:3] - ref[:3]).norm() / ref[:3].norm()
    assert 0 < rel < 0.01  # decode rows: 4-bit weights, bfloat16 activations
    lin.decode_rows = 0
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dense))


def test_int8_head_is_close_and_exact_for_prompt_rows():
    torch.manual_seed(0)
    w = torch.randn(1000, 64)
    head = Int8Linear(w)
    x = torch.randn(5, 64)
    head.decode_rows = 2
    y = head(x)
    assert torch.equal(y[2:], x[2:] @ w.t())
    assert ((y[:2] - x[:2] @ w.t()).norm() / (x[:2] @ w.t()).norm()) < 0.01


@pytest.fixture(scope="module")
def q4_engine():
    torch.set_num_threads(2)
    return LLM(EngineConfig(device="cpu", num_blocks=512, quantized_weights=True))


def test_prompt_logits_are_the_exact_models(q4_engine, engine):
    """Prompt tokens run on the dequantized weights: the first step's logits (a prefill)
    are the float32 model's, bit for bit."""
    # Prompts no other test uses: a prefix-cache hit would compute the logits a different
    # (equally valid) way and the comparison would not be like for like.
    tok = engine.tokenizer
    for ids in [tok.encode("Quantized check: " + RAW_PROMPTS[1]), tok.encode_chat([{"role": "user", "content": "Quantized check: name a river."}])]:
        assert torch.equal(q4_engine.first_step_logits(ids), engine.first_step_logits(ids))


def test_quantized_decoding_is_sensible_and_batch_invariant(q4_engine):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    answer = q4_engine.generate(messages=CHAT_PROMPTS[0], params=greedy)[0]
    assert "Paris" in answer.text
    prompts = [q4_engine.tokenizer.encode(p) for p in RAW_PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = q4_engine.generate(prompts, params)
    for ids, r in zip(prompts, together):
        assert q4_engine.generate([ids], params)[0].token_ids == r.token_ids


def test_quantized_kv_never_shares_a_namespace_with_exact_kv(q4_engine, engine):
    assert q4_engine.namespace.digest != engine.namespace.digest
    assert q4_engine.loaded.fingerprint.dtype.endswith("+q4")
    assert isinstance(q4_engine.loaded.model.layers[0].mlp.down_proj, Int4Linear)


def test_quantized_weights_need_a_gguf_on_the_cpu(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models import hf_gguf_tokenizer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    hf_gguf_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Hugging Face folder has no 4-bit weights"):
        LLM(EngineConfig(device="cpu", model=str(tmp_path), quantized_weights=True))
    with pytest.raises(ValueError, match="CPU kernels"):
        LLM(EngineConfig(device="cuda", quantized_weights=True))
