"""Helpers for the end-to-end tests: talking to instances directly, reading their stats."""

from __future__ import annotations

import re
import time
import urllib.request

from libs.engine import SamplingParams

TRACE = {"tidepool": {"trace": True}}
# Long enough that the router sends them through prefill (short prompts skip it).
CHAT = [{"role": "user", "content": "Write two short sentences about the sea and the wind at night."}]
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the great lamp. The ships "
    "passing the rocks below trusted that light with their lives, and on the last night of the year he"
)


def metrics(url: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value} (samples only)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def engine_tokens(engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def trace_of(resp) -> dict:
    extra = resp.model_extra or {}
    return extra["tidepool"]["trace"]


def assert_went_through_pd(trace: dict) -> None:
    p = trace["prompts"][0]
    assert p["prefill"]["decision"] == "prefill", p["prefill"]
    totals = trace["totals"]
    assert totals["bytes_written"] > 0 and totals["blocks_written"] > 0  # prefill wrote the prompt's blocks
    assert totals["blocks_hit"] >= totals["blocks_written"]  # decode loaded them from the pool
    assert totals["bytes_read"] > 0 and not totals["blocks_missed"]
