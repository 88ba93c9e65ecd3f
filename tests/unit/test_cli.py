"""`tidepool generate` as a user runs it: a subprocess of the installed console script.

Each run that gets past argument checking loads the model (seconds), so those
runs are started together once per module, and the in-process session engine computes
what each must print.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libs.engine import SamplingParams
from tests.spec_expectations import expected_ngram

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of Japan is"
CHAT = "Name three colors."
MAX_TOKENS = 12
SEED = 1234
SPEC_CHAT = "List the days of the week, twice."  # runs past 24 tokens, repeating itself
SPEC_MAX = 24
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "min_acceptance_length": 0}

RUNS = {
    "json_greedy": ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"],
    "json_chat_seeded": ["--chat", CHAT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0.8", "--top-p", "0.9", "--seed", str(SEED), "--json"],
    "stream_seeded_async": ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--seed", str(SEED), "--async-scheduling", "on"],
    "too_long": ["--prompt", PROMPT, "--max-tokens", "100000"],
    "json_spec": ["--chat", SPEC_CHAT, "--max-tokens", str(SPEC_MAX), "--temperature", "0", "--json", "--speculative-config", json.dumps(SPEC_CONFIG)],
}
BAD_ARGS = {  # rejected before the model is loaded
    "top_p": (["--prompt", "x", "--top-p", "2"], "top_p"),
    "temperature": (["--prompt", "x", "--temperature", "-1"], "temperature"),
    "model": (["--prompt", "x", "--model", "/nope"], "/nope"),
    "max_tokens": (["--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    "speculative_config": (["--prompt", "x", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "eagle"),
    "spec_with_async": (["--prompt", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--async-scheduling", "on"], "cannot be combined"),
    "one_shot_on_cpu": (["--prompt", "x", "--tensor-parallel-size", "2", "--tp-all-reduce", "one_shot"], "one_shot needs CUDA"),
}


# One bad-argument case runs as a user's process; the others call the same entry point in
# this process (each process costs ~3 s of imports on 2 cores, before it rejects anything).
SUBPROCESS_BAD_ARGS = "top_p"


def command() -> list[str]:
    script = Path(sys.executable).parent / "tidepool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "libs.cli"]


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([*command(), "generate", "--device", "cpu", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def weight_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weight-cache")


@pytest.fixture(scope="module")
def runs(weight_cache) -> dict[str, tuple[int, str, str]]:
    """The first model run converts the GGUF into ``weight_cache`` (one bad-argument run,
    which loads nothing, beside it); the other model runs then start together and map it."""
    cache = ["--cache-dir", str(weight_cache)]
    first, *rest = RUNS
    waves = [{first: RUNS[first] + cache, SUBPROCESS_BAD_ARGS: BAD_ARGS[SUBPROCESS_BAD_ARGS][0]}, {name: RUNS[name] + cache for name in rest}]
    results = {}
    for wave in waves:
        procs = {name: start(args) for name, args in wave.items()}
        for name, p in procs.items():
            out, err = p.communicate(timeout=600)
            results[name] = (p.returncode, out, err)
    return results


def ok(runs, name) -> str:
    rc, out, err = runs[name]
    assert rc == 0, err
    return out


def test_json_greedy_equals_engine_generate(runs, engine):
    got = json.loads(ok(runs, "json_greedy"))
    assert set(got) == {"prompt_token_ids", "token_ids", "text"}
    ref = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert got["prompt_token_ids"] == engine.tokenizer.encode(PROMPT) == ref.prompt_token_ids
    assert got["token_ids"] == ref.token_ids
    assert got["text"] == ref.text and got["text"].strip()


def test_json_chat_seeded_sampling_equals_engine_generate(runs, engine):
    got = json.loads(ok(runs, "json_chat_seeded"))
    messages = [{"role": "user", "content": CHAT}]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=SEED, max_tokens=MAX_TOKENS)
    ref = engine.generate(messages=messages, params=params)[0]
    assert got["prompt_token_ids"] == engine.tokenizer.encode_chat(messages)  # the chat template was applied
    assert engine.tokenizer.decode(got["prompt_token_ids"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert got["token_ids"] == ref.token_ids
    assert got["text"] == ref.text
    # The seed is what makes it reproducible: another seed gives another sample.
    other = engine.generate(messages=messages, params=SamplingParams(temperature=0.8, top_p=0.9, seed=SEED + 1, max_tokens=MAX_TOKENS))[0]
    assert other.token_ids != got["token_ids"]


def test_json_with_speculation_equals_no_speculation_and_reports_its_counts(runs, engine):
    got = json.loads(ok(runs, "json_spec"))
    ref = engine.generate(messages=[{"role": "user", "content": SPEC_CHAT}], params=SamplingParams(temperature=0, max_tokens=SPEC_MAX))[0]
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
    assert len(ref.token_ids) == SPEC_MAX  # the replay below needs a run to max_tokens
    exp = expected_ngram(got["prompt_token_ids"], ref.token_ids, k=3, min_n=1, max_n=3, max_tokens=SPEC_MAX)
    assert got["spec_decode"] == {k: exp[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert exp["num_accepted_tokens"] > 0
    assert "spec_decode" not in json.loads(ok(runs, "json_greedy"))  # off by default


def test_streaming_with_async_scheduling_prints_the_same_sample(runs, engine):
    """Without ``--json`` the text streams to stdout, nothing to stderr; ``--async-scheduling
    on`` and a seed give the engine's sample."""
    out = ok(runs, "stream_seeded_async")
    ref = engine.generate(PROMPT, SamplingParams(seed=SEED, max_tokens=MAX_TOKENS))[0]
    assert out == ref.text + "\n"
    assert runs["stream_seeded_async"][2] == ""


def in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    """``tidepool generate ARGV`` through the console script's entry point, in this process."""
    from libs.cli import main

    rc = main(["generate", "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", ["too_long", *BAD_ARGS])
def test_bad_input_exits_2_with_one_line(runs, name, capsys):
    rc, out, err = runs[name] if name in runs else in_process(BAD_ARGS[name][0], capsys)
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tidepool: error: "), err
    assert "Traceback" not in err
    expected = BAD_ARGS[name][1] if name in BAD_ARGS else "maximum context length"
    assert expected in lines[0]


def test_model_runs_share_one_weight_cache_entry(runs, weight_cache):
    """``--cache-dir``: the first run stored the converted weights, whole (no temporary
    directory left behind); the runs after it found the entry and added none."""
    assert all(runs[name][0] == 0 for name in RUNS if name != "too_long")
    entries = list((weight_cache / "gguf").iterdir())
    assert len(entries) == 1, entries
    assert {p.name for p in entries[0].iterdir()} == {"model.safetensors", "meta.json"}
