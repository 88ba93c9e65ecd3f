"""`tidepool generate` as a user runs it: a subprocess of the installed console script.

Each run that gets past argument checking loads the model (seconds), so the four such
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

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of Japan is"
CHAT = "Name three colors."
MAX_TOKENS = 12
SEED = 1234

RUNS = {
    "json_greedy": ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"],
    "json_chat_seeded": ["--chat", CHAT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0.8", "--top-p", "0.9", "--seed", str(SEED), "--json"],
    "stream_greedy": ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"],
    "stream_seeded_async": ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--seed", str(SEED), "--async-scheduling", "on"],
    "too_long": ["--prompt", PROMPT, "--max-tokens", "100000"],
}
BAD_ARGS = {  # rejected before the model is loaded
    "top_p": (["--prompt", "x", "--top-p", "2"], "top_p"),
    "temperature": (["--prompt", "x", "--temperature", "-1"], "temperature"),
    "model": (["--prompt", "x", "--model", "/nope"], "/nope"),
    "max_tokens": (["--prompt", "x", "--max-tokens", "0"], "max_tokens"),
}


def command() -> list[str]:
    script = Path(sys.executable).parent / "tidepool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "libs.cli"]


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([*command(), "generate", "--device", "cpu", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, str, str]]:
    procs = {name: start(args) for name, args in {**RUNS, **{k: v[0] for k, v in BAD_ARGS.items()}}.items()}
    results = {}
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


def test_streaming_prints_the_same_text(runs, engine):
    out = ok(runs, "stream_greedy")
    ref = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert out == ref.text + "\n"
    assert runs["stream_greedy"][2] == ""  # nothing on stderr


def test_async_scheduling_flag_streams_the_same_sample(runs, engine):
    out = ok(runs, "stream_seeded_async")
    ref = engine.generate(PROMPT, SamplingParams(seed=SEED, max_tokens=MAX_TOKENS))[0]
    assert out == ref.text + "\n"


@pytest.mark.parametrize("name", ["too_long", *BAD_ARGS])
def test_bad_input_exits_2_with_one_line(runs, name):
    rc, out, err = runs[name]
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tidepool: error: "), err
    assert "Traceback" not in err
    expected = BAD_ARGS[name][1] if name in BAD_ARGS else "maximum context length"
    assert expected in lines[0]
