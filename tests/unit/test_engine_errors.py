"""Bad input raises a clear, typed error before any work is queued.

Each case checks the error class (libs/engine/errors.py, ModelNotFoundError, or
ChatTemplateError), that the message names the problem, and that the engine is left
exactly as it was: no request, nothing waiting or running, every KV block free.
"""

from __future__ import annotations

import math

import pytest

from libs.engine import (
    DuplicateRequestError,
    EngineConfig,
    InvalidRequestError,
    InvalidSamplingParamsError,
    LLM,
    PromptTooLongError,
    SamplingParams,
    TokenOutOfRangeError,
)
from libs.engine.params import MAX_LOGPROBS, MAX_N
from libs.model import ChatTemplateError, ModelNotFoundError
from tests.models import tiny_engine

MAX_LEN = 128
OK = SamplingParams(temperature=0, max_tokens=4)

nan, inf = math.nan, math.inf
BAD_VALUES = {
    "n": [0, -1, MAX_N + 1, 1.5, True, "2", None, nan],
    "temperature": [nan, inf, -inf, -0.1, True, "1", None],
    "top_p": [0, 0.0, -0.1, 1.01, 2, nan, inf, True, "0.5", None],
    "top_k": [-2, -100, 1.5, True, "5", None, nan],
    "min_p": [-0.1, 1.1, nan, inf, True, "0.1", None],
    "presence_penalty": [2.1, -2.1, nan, inf, -inf, True, "0", None],
    "frequency_penalty": [2.1, -2.1, nan, inf, -inf, True, "0", None],
    "repetition_penalty": [0, -1, 10.5, nan, inf, True, "1", None],
    "seed": [1.5, True, "1", 2**64, -(2**63) - 1, nan],
    "max_tokens": [0, -1, 1.5, True, "16", nan, inf],
    "min_tokens": [-1, 1.5, True, "1", None, 17],  # 17 > the default max_tokens (16)
    "stop_token_ids": [[-1], [1.5], [True], ["a"], [None], "abc", 5, None],
    "ignore_eos": ["yes", 1, None, 0.0],
    "logprobs": [-1, MAX_LOGPROBS + 1, 1.5, True, "5", nan],
}


@pytest.fixture(scope="module")
def eng() -> LLM:
    return tiny_engine(num_blocks=64, max_model_len=MAX_LEN)


def assert_idle(eng: LLM) -> None:
    assert not eng.has_unfinished_requests()
    assert eng.num_waiting == 0 and eng.num_running == 0
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)


def _cases():
    for name, values in BAD_VALUES.items():
        for v in values:
            yield pytest.param(name, v, id=f"{name}={v!r}")


@pytest.mark.parametrize("name,value", list(_cases()))
def test_invalid_sampling_values(name, value):
    with pytest.raises(InvalidSamplingParamsError) as exc:
        SamplingParams(**{name: value})
    assert exc.value.param == name
    assert name in str(exc.value)
    assert isinstance(exc.value, InvalidRequestError) and isinstance(exc.value, ValueError)


def test_boundary_values_are_accepted():
    """The limits themselves are valid (so the checks above are not just rejecting everything)."""
    SamplingParams(n=MAX_N, temperature=0, top_p=1, top_k=0, min_p=1, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=10, seed=2**64 - 1, max_tokens=1, min_tokens=1, stop_token_ids=[0], logprobs=MAX_LOGPROBS)
    SamplingParams(top_k=-1, seed=-(2**63), logprobs=0, max_tokens=None, min_tokens=0, ignore_eos=True, stop_token_ids=(1, 2))


# -- requests against an engine ----------------------------------------------------------


def _raises(eng: LLM, error: type[Exception], words: list[str], fn, *args, **kwargs):
    with pytest.raises(error) as exc:
        fn(*args, **kwargs)
    assert type(exc.value) is error, f"{type(exc.value).__name__}: {exc.value}"
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))
    assert_idle(eng)
    return exc.value


@pytest.mark.parametrize("add", ["add_request", "generate"])
def test_prompt_longer_than_the_context(eng, add):
    prompt = [7] * MAX_LEN
    call = (lambda: eng.add_request("r", prompt, OK)) if add == "add_request" else (lambda: eng.generate([prompt], OK))
    e = _raises(eng, PromptTooLongError, [str(MAX_LEN), str(len(prompt))], call)
    assert e.param == "prompt"


def test_prompt_plus_max_tokens_longer_than_the_context(eng):
    e = _raises(eng, PromptTooLongError, [str(MAX_LEN), "100", "29"], eng.add_request, "r", [7] * 100, SamplingParams(max_tokens=29))
    assert e.param == "max_tokens"
    eng.validate([7] * 100, SamplingParams(max_tokens=28))  # exactly the context: fine


def test_request_larger_than_the_whole_kv_cache():
    # 50 + 47 = 97 tokens fit the context (128) but need 7 blocks of 16; the cache has 6.
    small = tiny_engine(num_blocks=6, max_model_len=MAX_LEN)
    e = _raises(small, PromptTooLongError, ["7 KV blocks", "holds 6"], small.add_request, "r", [7] * 50, SamplingParams(max_tokens=47))
    assert e.param == "max_tokens"
    small.validate([7] * 50, SamplingParams(max_tokens=46))


@pytest.mark.parametrize("prompt", [[], ""], ids=["ids", "text"])
def test_empty_prompt(eng, prompt):
    e = _raises(eng, InvalidRequestError, ["at least one token"], eng.generate, [prompt], OK)
    assert e.param == "prompt"


@pytest.mark.parametrize("bad", [49152, 10**9, -1, 1.5, "a", True, None], ids=repr)
def test_token_id_outside_the_vocabulary(eng, bad):
    e = _raises(eng, TokenOutOfRangeError, [repr(bad), "49152"], eng.add_request, "r", [5, bad, 6], OK)
    assert e.param == "prompt"


def test_stop_token_id_outside_the_vocabulary(eng):
    e = _raises(eng, TokenOutOfRangeError, ["49152"], eng.add_request, "r", [5, 6], SamplingParams(stop_token_ids=[3, 49152]))
    assert e.param == "stop_token_ids"


def test_output_prefix_is_validated_with_the_prompt(eng):
    _raises(eng, TokenOutOfRangeError, ["-5"], eng.add_request, "r", [5, 6], OK, output_prefix=[-5])


def test_output_prefix_counts_toward_max_tokens_not_on_top(eng):
    """Decode continues after prefill's first token: prompt + max_tokens == context is
    valid at prefill, so it must stay valid with the first token as output prefix."""
    prompt, p = [7] * 60, SamplingParams(temperature=0, max_tokens=68, ignore_eos=True)
    eng.validate(prompt, p)
    eng.add_request("continue", prompt, p, output_prefix=[9])
    while eng.has_unfinished_requests():
        eng.step()
    assert_idle(eng)


def test_duplicate_request_id(eng):
    eng.add_request("dup", [5, 6, 7], OK)
    with pytest.raises(DuplicateRequestError, match="dup"):
        eng.add_request("dup", [8, 9], OK)
    assert eng.num_waiting == 1  # only the first one
    eng.abort_request("dup")
    eng.step()
    assert_idle(eng)


def test_n_above_one_with_an_output_prefix(eng):
    e = _raises(eng, InvalidRequestError, ["n must be 1"], eng.add_request, "r", [5, 6], SamplingParams(n=2), output_prefix=[7])
    assert e.param == "n"


def test_params_of_the_wrong_type(eng):
    _raises(eng, InvalidRequestError, ["SamplingParams"], eng.add_request, "r", [5, 6], {"temperature": 0})


def test_one_bad_prompt_queues_none_of_the_batch(eng):
    good = [5, 6, 7]
    _raises(eng, PromptTooLongError, [], eng.generate, [good, good, [7] * MAX_LEN], OK)
    _raises(eng, TokenOutOfRangeError, [], eng.generate, [good, [1, -3]], OK)
    _raises(eng, InvalidRequestError, ["one per prompt"], eng.generate, [good, good], [OK])


@pytest.mark.parametrize("prompts", [5, 3.5, [None], [{"text": "x"}]], ids=repr)
def test_prompt_of_the_wrong_type(eng, prompts):
    _raises(eng, InvalidRequestError, ["prompt"], eng.generate, prompts, OK)


def test_prompts_and_messages_are_exclusive(eng):
    _raises(eng, InvalidRequestError, ["exactly one"], eng.generate, ["hi"], OK, messages=[{"role": "user", "content": "x"}])
    _raises(eng, InvalidRequestError, ["exactly one"], eng.generate, None, OK)


@pytest.mark.parametrize(
    "messages,words",
    [
        ([], ["empty"]),
        ([{"content": "no role"}], ["messages[0].role"]),
        ([{"role": "user", "content": "ok"}, "not a dict"], ["messages[1]"]),
        ([{"role": "user", "content": 5}], ["messages[0].content"]),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ["messages[0].content[0]"]),
    ],
    ids=["empty", "no-role", "not-a-dict", "content-int", "image-part"],
)
def test_bad_chat_messages(eng, messages, words):
    _raises(eng, ChatTemplateError, words, eng.generate, messages=[messages] if messages else [[]], params=OK)


def test_chat_template_raise_exception_is_a_chat_template_error(eng):
    """SmolLM2's template is permissive; a template that calls raise_exception must
    surface as ChatTemplateError, not as a jinja error."""
    from dataclasses import replace

    strict = replace(eng.tokenizer, chat_template="{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}x")
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        strict.encode_chat([{"role": "assistant", "content": "hi"}])
    broken = replace(eng.tokenizer, chat_template="{{ messages[0].content.no_such_method() }}")
    with pytest.raises(ChatTemplateError):
        broken.encode_chat([{"role": "user", "content": "hi"}])


# -- model paths --------------------------------------------------------------------------


def test_unknown_model_path():
    with pytest.raises(ModelNotFoundError, match="/nope"):
        LLM(EngineConfig(model="/nope", device="cpu"))


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(EngineConfig(model=str(tmp_path), device="cpu"))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="gguf"):
        LLM(EngineConfig(model=str(f), device="cpu"))


@pytest.mark.parametrize("missing", ["*.safetensors", "tokenizer.json"])
def test_folder_missing_weights_or_tokenizer(tmp_path, missing):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    if missing != "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text("{}")
    else:
        (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=missing.replace("*", r"\*")):
        LLM(EngineConfig(model=str(tmp_path), device="cpu"))
