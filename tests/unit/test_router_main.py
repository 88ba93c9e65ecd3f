"""``python -m services.router`` as a launcher starts it: settings, the ready line, a request
through a fake decode, a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

import openai
import pytest

from services.common import build_parser, env_name, flag_name, parse_settings
from services.router.settings import RouterSettings
from tests.fake_workers import FakeDecode
from tests.router_harness import fake_model, script_text

REPO = Path(__file__).resolve().parents[2]


def test_help_documents_every_setting() -> None:
    text = build_parser(RouterSettings, "python -m services.router").format_help()
    for f in dataclasses.fields(RouterSettings):
        assert flag_name(f.name) in text and env_name(f.name) in text, f.name


def test_settings_reject_nonsense() -> None:
    assert parse_settings(RouterSettings, ["--decode-retries", "0"], {}).decode_retries == 0
    for argv in (["--heartbeat-timeout-s", "0"], ["--decode-retries", "-1"], ["--retry-wait-s", "-1"], ["--port", "70000"]):
        with pytest.raises(SystemExit):
            parse_settings(RouterSettings, argv, {})


async def test_module_serves_until_sigterm() -> None:
    env = {**os.environ, "TIDEPOOL_SERVED_MODEL_NAME": "smol", "TIDEPOOL_LOG_LEVEL": "warning"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.router", "--port", "0", "--heartbeat-timeout-s", "3",
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    decode = FakeDecode(role="decode", model=fake_model(), model_name="SmolLM2-135M-Instruct", instance_id="d0")
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        assert line.startswith("tidepool router ready at http://127.0.0.1:"), line
        url = line.split()[-1]
        await decode.start()
        await decode.join(url)  # registers under the model's own name; clients use the served one
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["smol"]
        r = await client.completions.create(model="smol", prompt="Hello", max_tokens=4)
        assert r.choices[0].text == script_text(0, 4)
        await client.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await decode.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
