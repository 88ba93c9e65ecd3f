"""``--speculative-config``: vLLM's JSON shape in, a validated config out, and a clear error
(naming the key) for anything else, on the engine, the decode service and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from libs.engine import EngineConfig

from libs.engine.spec.config import SpeculativeConfig, parse_speculative_config
from services.common import parse_settings
from services.worker.settings import WorkerSettings


def test_off_by_default():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("") is None
    assert parse_speculative_config("  ") is None


def test_vllm_ngram_example():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert (cfg.method, cfg.k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 4)
    assert cfg.forced_acceptance is None


@pytest.mark.parametrize(
    "given, lo, hi",
    [({}, 5, 5), ({"prompt_lookup_max": 3}, 3, 3), ({"prompt_lookup_min": 2}, 2, 2), ({"method": "[ngram]"}, 5, 5)],
)
def test_ngram_lookup_defaults_follow_vllm(given, lo, hi):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (cfg.method, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", lo, hi)


def test_model_alone_means_a_draft_model():
    cfg = parse_speculative_config({"model": "/models/draft", "num_speculative_tokens": 3})
    assert cfg.method == "draft_model" and cfg.model == "/models/draft"


def test_self_draft_and_round_trip():
    cfg = parse_speculative_config({"method": "self_draft", "num_draft_layers": 6, "num_speculative_tokens": 3, "draft_vocab": "v.safetensors"})
    assert cfg.uses_draft_model and cfg.num_draft_layers == 6
    assert parse_speculative_config(cfg.to_json()) == cfg
    assert parse_speculative_config(cfg) is cfg


@pytest.mark.parametrize("rate, k, accepted", [(0.0, 4, 0), (1.0, 4, 4), (0.5, 4, 2), (0.5, 3, 2), (0.5, 1, 1), (0.25, 3, 1)])
def test_forced_accepts_round_half_up(rate, k, accepted):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 8, "forced_acceptance": rate})
    assert cfg.forced_accepts(k) == accepted


@pytest.mark.parametrize(
    "value, words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"num_speculative_tokens": 2}, "method is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be in"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model does not apply to method ngram"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "applies to method ngram only"),
        ({"method": "self_draft", "num_speculative_tokens": 2}, "num_draft_layers"),
        ({"method": "self_draft", "num_speculative_tokens": 2, "num_draft_layers": 0}, "num_draft_layers"),
        ({"method": "self_draft", "num_speculative_tokens": 2, "num_draft_layers": 2, "model": "x"}, "model does not apply"),
        ({"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance": 1.5}, "forced_acceptance"),
        ({"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance": float("nan")}, "forced_acceptance must be a number"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_window": 0}, "acceptance_window"),
        ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_length": 9}, "min_acceptance_length"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown key(s) 'speculative_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "async_prepare": "yes"}, "async_prepare must be auto, on or off"),
    ],
)
def test_bad_configs_name_the_problem(value, words):
    with pytest.raises(ValueError, match=None) as e:
        parse_speculative_config(value)
    assert words in str(e.value)


def test_decode_service_flag_and_env():
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    assert parse_settings(WorkerSettings, ["--speculative-config", text], {}).speculative_config == text
    assert parse_settings(WorkerSettings, [], {"TIDEPOOL_SPECULATIVE_CONFIG": text}).speculative_config == text
    assert parse_settings(WorkerSettings, [], {}).speculative_config is None


def test_decode_service_rejects_a_bad_config_at_start_up(capsys):
    with pytest.raises(SystemExit) as e:
        parse_settings(WorkerSettings, ["--speculative-config", '{"method": "ngram"}'], {})
    assert e.value.code == 2
    assert "num_speculative_tokens is required" in capsys.readouterr().err


def test_config_is_frozen():
    cfg = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=1)
    with pytest.raises(AttributeError):
        cfg.method = "x"  # type: ignore[misc]


def test_async_prepare_resolves_per_device():
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert parse_speculative_config(base).resolve_async_prepare("cuda") and not parse_speculative_config(base).resolve_async_prepare("cpu")
    assert parse_speculative_config({**base, "async_prepare": "on"}).resolve_async_prepare("cpu")
    assert not parse_speculative_config({**base, "async_prepare": "off"}).resolve_async_prepare("cuda")


def test_speculation_needs_synchronous_scheduling():
    """Refused where it is asked for together; "auto" resolves to off with speculation."""
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(speculative_config=text, async_scheduling="on").resolve_async_scheduling(cpu)
    for device in (cpu, cuda):
        assert EngineConfig(speculative_config=text).resolve_async_scheduling(device) is False
    assert EngineConfig(async_scheduling="on").resolve_async_scheduling(cpu) is True


def test_decode_service_refuses_speculation_with_async_scheduling(capsys):
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(SystemExit) as e:
        parse_settings(WorkerSettings, ["--speculative-config", text, "--async-scheduling", "on"], {})
    assert e.value.code == 2 and "async_scheduling" in capsys.readouterr().err
    assert parse_settings(WorkerSettings, ["--speculative-config", text, "--async-scheduling", "off"], {}).async_scheduling == "off"


def test_speculation_refused_with_tensor_parallelism():
    """The TP runner mirrors forwards, not proposers or KV rollback: the pair is refused."""
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(speculative_config=text, tensor_parallel_size=2)
    assert EngineConfig(speculative_config=text).tensor_parallel_size == 1
    assert EngineConfig(tensor_parallel_size=2).speculative_config is None
