"""``make run``'s launcher: starts Redis and the four services, prints the URL, serves the
OpenAI API, and Ctrl-C stops every process it started (no orphans)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.launch.processes import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_launcher_serves_and_ctrl_c_leaves_no_orphans(tmp_path):
    from openai import OpenAI

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.launch", "--port", str(port), "--device", "cpu", "--threads", "1", "--log-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        url, lines, deadline = None, [], time.monotonic() + 240
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            if "Tidepool is up:" in line:
                url = line.split("Tidepool is up:")[1].split()[0]
            assert time.monotonic() < deadline, "".join(lines)
        assert url == f"http://127.0.0.1:{port}/v1"
        kids = children_of(proc.pid)
        assert len(kids) == 5  # redis, cache_store, router, prefill, decode
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
        assert resp.choices[0].message.content
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert not [k for k in kids if alive(k)], "orphans left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
