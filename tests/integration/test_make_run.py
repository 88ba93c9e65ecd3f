"""``make run``'s launcher: starts Redis and the four services, prints the URL once a request
would succeed, restarts a worker that is killed (a stream in flight on it goes on, on the
restarted instance), and Ctrl-C stops every process it started (no orphans)."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.launch.processes import free_port

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


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


def child_running(parent: int, module: str) -> int | None:
    """The pid of ``parent``'s live child running ``python -m <module>``."""
    for pid in children_of(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and alive(pid):
            return pid
    return None


@pytest.mark.slow  # ~40 s of real launches: make test-slow
def test_launcher_waits_for_ready_restarts_a_killed_worker_and_ctrl_c_leaves_no_orphans(tmp_path):
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
        # The URL is printed only once the router is ready (a decode has registered).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            assert r.status == 200
        kids = children_of(proc.pid)
        assert len(kids) == 5  # redis, cache_store, router, prefill, decode
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=CHAT, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        expected = client.chat.completions.create(**ask).choices[0].message.content
        assert expected

        # SIGKILL the only decode while it streams: the launcher restarts it, the router
        # resumes the stream on it, and the client sees one unbroken, identical completion.
        decode = child_running(proc.pid, "services.decode")
        assert decode is not None
        stream = client.chat.completions.create(**ask, stream=True)
        text = []
        for i, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if i == 4:
                os.kill(decode, signal.SIGKILL)
        assert "".join(text) == expected
        assert proc.poll() is None, "the launcher stopped when a worker died"
        restarted = child_running(proc.pid, "services.decode")
        assert restarted is not None and restarted != decode
        again = client.chat.completions.create(**{**ask, "max_tokens": 8})
        assert again.choices[0].message.content == expected[: len(again.choices[0].message.content)]

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "decode-0 exited (SIGKILL)" in out and "decode-0 is back" in out, out
        time.sleep(0.5)
        assert not [k for k in kids | {restarted} if alive(k)], "orphans left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
