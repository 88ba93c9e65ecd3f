"""services/common: settings parsing, the app's ops endpoints and error handling, the runner."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter

from services.common import (
    METRICS_REGISTRY,
    BaseSettings,
    configure_torch_threads,
    create_app,
    parse_settings,
    setting,
    torch_child_env,
)
from services.common.gc_heap import GcPauses, freeze_startup_heap
from tests.integration.pd_helpers import metrics

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class DemoSettings(BaseSettings):
    """Demo service settings."""

    redis_url: str = setting("redis://127.0.0.1:6379", help="where the pool lives")
    budget_bytes: int = setting(1024, help="pool byte budget")
    ratio: float = setting(0.5, help="fill ratio in %")
    reaper: bool = setting(True, help="run the lease reaper")
    seed: int | None = setting(None, help="random seed")
    mode: Literal["lru", "fifo"] = setting("lru", help="eviction policy")
    peers: tuple[str, ...] = setting((), help="peer URLs")


@dataclass(frozen=True, kw_only=True)
class RequiredSettings(BaseSettings):
    """Settings with a required knob."""

    model: str = setting(help="model path")


# --- settings ---------------------------------------------------------------------------


def test_defaults_without_cli_or_env() -> None:
    s = parse_settings(DemoSettings, [], {})
    assert s == DemoSettings()
    assert (s.host, s.port, s.log_level) == ("127.0.0.1", 8000, "info")


def test_precedence_cli_over_env_over_default() -> None:
    env = {"TIDEPOOL_REDIS_URL": "redis://env", "TIDEPOOL_BUDGET_BYTES": "7"}
    s = parse_settings(DemoSettings, ["--redis-url", "redis://cli"], env)
    assert s.redis_url == "redis://cli"  # CLI beats env
    assert s.budget_bytes == 7  # env beats default
    assert s.ratio == 0.5  # default


def test_unrelated_env_is_ignored() -> None:
    s = parse_settings(DemoSettings, [], {"REDIS_URL": "x", "TIDEPOOL_UNKNOWN": "y"})
    assert s.redis_url == "redis://127.0.0.1:6379"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--budget-bytes", "42"], {}, {"budget_bytes": 42}),
        (["--ratio", "0.25"], {}, {"ratio": 0.25}),
        ([], {"TIDEPOOL_RATIO": "1e-3"}, {"ratio": 1e-3}),
        (["--no-reaper"], {}, {"reaper": False}),
        (["--reaper"], {"TIDEPOOL_REAPER": "off"}, {"reaper": True}),
        ([], {"TIDEPOOL_REAPER": "0"}, {"reaper": False}),
        ([], {"TIDEPOOL_REAPER": "Yes"}, {"reaper": True}),
        (["--seed", "5"], {}, {"seed": 5}),
        (["--seed", "none"], {"TIDEPOOL_SEED": "3"}, {"seed": None}),
        ([], {"TIDEPOOL_SEED": ""}, {"seed": None}),
        (["--mode", "fifo"], {}, {"mode": "fifo"}),
        (["--peers", "http://a, http://b"], {}, {"peers": ("http://a", "http://b")}),
        ([], {"TIDEPOOL_PEERS": "http://c"}, {"peers": ("http://c",)}),
        (["--port", "0", "--host", "0.0.0.0"], {}, {"port": 0, "host": "0.0.0.0"}),
        ([], {"TIDEPOOL_LOG_LEVEL": "debug"}, {"log_level": "debug"}),
    ],
)
def test_types(argv: list[str], env: dict[str, str], expected: dict[str, object]) -> None:
    s = parse_settings(DemoSettings, argv, env)
    for name, value in expected.items():
        got = getattr(s, name)
        assert got == value and type(got) is type(value), (name, got)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--budget-bytes", "lots"], {}, "not a valid int: 'lots'"),
        (["--ratio", "half"], {}, "not a valid float"),
        (["--mode", "random"], {}, "must be one of lru, fifo"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        ([], {"TIDEPOOL_BUDGET_BYTES": "1.5"}, "TIDEPOOL_BUDGET_BYTES: not a valid int"),
        ([], {"TIDEPOOL_REAPER": "maybe"}, "TIDEPOOL_REAPER: not a boolean"),
        ([], {"TIDEPOOL_LOG_LEVEL": "verbose"}, "TIDEPOOL_LOG_LEVEL: must be one of"),
        (["--port", "70000"], {}, "port must be in 0..65535"),
        ([], {"TIDEPOOL_SHUTDOWN_TIMEOUT_S": "-1"}, "shutdown_timeout_s must be >= 0"),
    ],
)
def test_bad_values_exit_2_with_usage(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(DemoSettings, argv, env, prog="demo")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: demo")
    assert message in err


def test_required_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings(RequiredSettings, [], {"TIDEPOOL_MODEL": "/m"}).model == "/m"
    with pytest.raises(SystemExit) as exc:
        parse_settings(RequiredSettings, [], {})
    assert exc.value.code == 2
    assert "--model (or TIDEPOOL_MODEL) is required" in capsys.readouterr().err


def test_help_documents_every_knob(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(DemoSettings, ["--help"], {}, prog="demo")
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "Demo service settings." in out
    for flag, env, help_text, default in [
        ("--host", "TIDEPOOL_HOST", "localhost unless told otherwise", "default: 127.0.0.1"),
        ("--port", "TIDEPOOL_PORT", "TCP port to bind; 0 picks a free one", "default: 8000"),
        ("--log-level", "TIDEPOOL_LOG_LEVEL", "logging level", "default: info"),
        ("--shutdown-timeout-s", "TIDEPOOL_SHUTDOWN_TIMEOUT_S", "in-flight requests", "default: 10.0"),
        ("--redis-url", "TIDEPOOL_REDIS_URL", "where the pool lives", "default: redis://127.0.0.1:6379"),
        ("--budget-bytes", "TIDEPOOL_BUDGET_BYTES", "pool byte budget", "default: 1024"),
        ("--ratio", "TIDEPOOL_RATIO", "fill ratio in %", "default: 0.5"),
        ("--reaper, --no-reaper", "TIDEPOOL_REAPER", "run the lease reaper", "default: on"),
        ("--seed", "TIDEPOOL_SEED", "random seed", "default: None"),
        ("--mode {lru,fifo}", "TIDEPOOL_MODE", "eviction policy", "default: lru"),
        ("--peers", "TIDEPOOL_PEERS", "peer URLs", "comma-separated"),
    ]:
        assert flag in out
        assert help_text in out and env in out and default in out, flag


def test_field_without_help_is_a_programming_error() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Undocumented(BaseSettings):
        secret: str = field(default="x")

    with pytest.raises(TypeError, match="Undocumented.secret has no help text"):
        parse_settings(Undocumented, [], {})


def test_setting_rejects_mutable_default_and_empty_help() -> None:
    with pytest.raises(TypeError):
        setting([], help="peers")
    with pytest.raises(ValueError):
        setting(1, help="")


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_BUDGET_BYTES", "99")
    assert parse_settings(DemoSettings, []).budget_bytes == 99


# --- app ----------------------------------------------------------------------------------


def _demo_app(
    *, health: object = True, stats: object = None, registry: CollectorRegistry | None = None, **kw: object
) -> web.Application:
    app = create_app(
        "demo",
        DemoSettings(),
        stats=stats if callable(stats) else (lambda: {"blocks": 3, "bytes": 10}),
        health=health if callable(health) else (lambda: health),
        registry=registry,
        **kw,
    )

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    async def echo_json(request: web.Request) -> web.Response:
        return web.json_response(await request.json())

    async def echo_bytes(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def bad(request: web.Request) -> web.Response:
        raise web.HTTPBadRequest(text="block key is not hex")

    async def stream_then_fail(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"partial")
        raise RuntimeError("died mid-stream")

    app.router.add_get("/boom", boom)
    app.router.add_post("/json", echo_json)
    app.router.add_post("/bytes", echo_bytes)
    app.router.add_get("/bad", bad)
    app.router.add_get("/blocks/{key}", bad)
    app.router.add_get("/stream", stream_then_fail)
    return app


async def test_health_ok() -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        resp = await client.get("/health")
        assert resp.status == 200
        body = await resp.json()
        assert body["status"] == "ok" and body["service"] == "demo" and body["uptime_s"] >= 0


@pytest.mark.parametrize("kind", ["false", "async_false", "raises"])
async def test_health_unhealthy_is_503(kind: str) -> None:
    async def async_false() -> bool:
        return False

    def raises() -> bool:
        raise ConnectionError("redis down")

    health = {"false": lambda: False, "async_false": async_false, "raises": raises}[kind]
    async with TestClient(TestServer(_demo_app(health=health))) as client:
        resp = await client.get("/health")
        assert resp.status == 503
        body = await resp.json()
        assert body["status"] == "unhealthy"
        if kind == "raises":
            assert body["reason"] == "ConnectionError: redis down"


async def test_async_health_ok() -> None:
    async def healthy() -> bool:
        await asyncio.sleep(0)
        return True

    async with TestClient(TestServer(_demo_app(health=healthy))) as client:
        assert (await client.get("/health")).status == 200


async def test_stats_sync_and_async() -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        resp = await client.get("/stats")
        assert resp.status == 200 and resp.content_type == "application/json"
        assert await resp.json() == {"blocks": 3, "bytes": 10}

    async def stats() -> dict[str, int]:
        return {"leases": 2}

    async with TestClient(TestServer(_demo_app(stats=stats))) as client:
        assert await (await client.get("/stats")).json() == {"leases": 2}


async def test_metrics_prometheus_text_from_own_registry() -> None:
    registry = CollectorRegistry()
    evictions = Counter("tidepool_demo_evictions", "evicted blocks", registry=registry)
    evictions.inc(3)
    async with TestClient(TestServer(_demo_app(registry=registry))) as client:
        assert client.app is not None and client.app[METRICS_REGISTRY] is registry
        await client.get("/health")
        await client.get("/blocks/abc")
        await client.get("/nowhere")
        resp = await client.get("/metrics")
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = await resp.text()
    assert "tidepool_demo_evictions_total 3.0" in text
    assert 'tidepool_http_requests_total{method="GET",route="/health",status="200"} 1.0' in text
    # The route pattern, not the raw path, labels a request (bounded cardinality).
    assert 'tidepool_http_requests_total{method="GET",route="/blocks/{key}",status="400"} 1.0' in text
    assert 'tidepool_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'tidepool_http_request_duration_seconds_count{method="GET",route="/health"} 1.0' in text


async def test_two_apps_in_one_process_do_not_clash() -> None:
    a, b = _demo_app(), _demo_app()
    async with TestClient(TestServer(a)) as ca, TestClient(TestServer(b)) as cb:
        await ca.get("/health")
        await ca.get("/health")
        text_b = await (await cb.get("/metrics")).text()
    assert a[METRICS_REGISTRY] is not b[METRICS_REGISTRY]
    assert 'route="/health"' not in text_b


async def test_unhandled_exception_is_500_json_and_server_survives(caplog: pytest.LogCaptureFixture) -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        with caplog.at_level(logging.ERROR, logger="tidepool.demo"):
            resp = await client.get("/boom")
        assert resp.status == 500
        body = await resp.json()
        assert body["error"]["type"] == "server_error"
        assert body["error"]["code"] == "internal_error"
        assert "RuntimeError" in body["error"]["message"]
        assert "secret detail" not in body["error"]["message"]  # details stay in the log
        assert any("secret detail" in (r.exc_text or "") for r in caplog.records)
        assert (await client.get("/health")).status == 200


async def test_malformed_json_is_400() -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        resp = await client.post("/json", data=b"{not json", headers={"Content-Type": "application/json"})
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["code"] == "malformed_json"
        assert body["error"]["type"] == "invalid_request_error"
        ok = await client.post("/json", json={"a": 1})
        assert await ok.json() == {"a": 1}


async def test_http_errors_become_json() -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        resp = await client.get("/bad")
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "block key is not hex"

        resp = await client.get("/nowhere")
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"

        resp = await client.post("/health")
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
        assert "GET" in resp.headers["Allow"]


async def test_body_over_client_max_size_is_413_json() -> None:
    async with TestClient(TestServer(_demo_app(client_max_size=100))) as client:
        assert (await client.post("/bytes", data=b"x" * 100)).status == 200
        resp = await client.post("/bytes", data=b"x" * 101)
        assert resp.status == 413
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_failure_mid_stream_closes_connection_not_process() -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        resp = await client.get("/stream")
        with pytest.raises(Exception):
            await resp.read()  # the peer sees a broken stream, not a second response
        assert (await client.get("/health")).status == 200


async def test_requests_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    async with TestClient(TestServer(_demo_app())) as client:
        with caplog.at_level(logging.DEBUG, logger="tidepool.demo"):
            await client.get("/bad?x=1")
            await client.get("/health")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "tidepool.demo"]
    assert any(level == logging.INFO and m.startswith("GET /bad?x=1 400 ") for level, m in lines)
    assert any(level == logging.DEBUG and m.startswith("GET /health 200 ") for level, m in lines)


# --- runner -------------------------------------------------------------------------------

_SERVICE_SCRIPT = textwrap.dedent(
    """
    import asyncio
    from services.common import BaseSettings, create_app, parse_settings, run_service

    settings = parse_settings(BaseSettings)
    app = create_app("demo", settings, stats=dict, health=lambda: True)

    async def start_orphan(app):
        asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="orphan-sleeper")

    async def cleanup(app):
        print("cleanup ran", flush=True)

    app.on_startup.append(start_orphan)
    app.on_cleanup.append(cleanup)
    run_service(app, settings)
    print("exited run_service", flush=True)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_service_ready_line_and_graceful_shutdown(sig: signal.Signals, tmp_path: Path) -> None:
    script = tmp_path / "svc.py"
    script.write_text(_SERVICE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), TIDEPOOL_PORT="0", TIDEPOOL_LOG_LEVEL="info")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("tidepool demo ready at http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1]
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        samples = metrics(url)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["cleanup ran", "exited run_service"]
    assert "task orphan-sleeper still running after cleanup; cancelling" in err
    assert "Task was destroyed" not in err
    # The runner froze the startup heap (an interpreter with torch's imports holds tens of
    # thousands of objects) after one full collection, which the app's watcher timed.
    assert samples["tidepool_gc_frozen_objects"] > 10_000
    assert samples['tidepool_gc_pause_seconds_count{generation="2"}'] >= 1
    assert "froze" in err and "startup objects" in err


# --- garbage collection -------------------------------------------------------------------


def test_gc_pauses_are_timed_per_generation_and_the_watcher_leaves_with_the_app() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(registry)
    before = list(gc.callbacks)
    pauses.install()
    pauses.install()  # twice is once
    assert len(gc.callbacks) == len(before) + 1
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.remove()
    assert gc.callbacks == before
    sample = lambda name, gen: registry.get_sample_value(name, {"generation": gen})  # noqa: E731
    assert sample("tidepool_gc_pause_seconds_count", "0") == 2
    assert sample("tidepool_gc_pause_seconds_count", "2") == 1
    assert sample("tidepool_gc_pause_seconds_sum", "2") > 0
    gc.collect(0)  # removed: no longer counted
    assert sample("tidepool_gc_pause_seconds_count", "0") == 2


async def test_an_app_watches_the_collector_only_while_it_runs() -> None:
    before = list(gc.callbacks)
    app = _demo_app()
    assert gc.callbacks == before  # made, not started: nothing installed
    async with TestClient(TestServer(app)) as client:
        assert len(gc.callbacks) == len(before) + 1
        gc.collect(1)
        text = await (await client.get("/metrics")).text()
    assert gc.callbacks == before
    assert app[METRICS_REGISTRY].get_sample_value("tidepool_gc_pause_seconds_count", {"generation": "1"}) >= 1
    assert "tidepool_gc_pause_seconds_count" in text and "tidepool_gc_frozen_objects" in text


def test_freeze_moves_every_live_object_out_of_the_collectors_scans() -> None:
    gc.unfreeze()
    keep = [{"i": i} for i in range(20_000)]  # tracked containers, alive
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen >= len(keep)
        assert not any(gc.is_tracked(o) and o is keep[0] for o in gc.get_objects())  # not in any scanned generation
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


# --- cpu threads -------------------------------------------------------------------------


def test_torch_child_env_sets_passive_and_counts() -> None:
    base = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}
    env = torch_child_env(2, base)
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert base["OMP_WAIT_POLICY"] == "ACTIVE"  # the caller's mapping is left alone
    with pytest.raises(ValueError):
        torch_child_env(0)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, PYTHONPATH=str(REPO)),
    )


def test_services_common_does_not_import_torch() -> None:
    result = _run_python("import sys, services.common; print('torch' in sys.modules)", dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("policy", "torch_first", "threads", "expected", "warning"),
    [
        (None, False, 1, "True PASSIVE 1 1", None),
        (None, True, 2, "False PASSIVE 2 1", "OMP_WAIT_POLICY was not set when torch was imported"),
        ("active", False, 1, "False active 1 1", "OMP_WAIT_POLICY=active; services sharing cores need PASSIVE"),
    ],
)
def test_configure_torch_threads(
    policy: str | None, torch_first: bool, threads: int, expected: str, warning: str | None
) -> None:
    """Thread counts are set; the wait policy is set when missing and its lateness reported."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    code = (
        "import os, logging; logging.basicConfig()\n"
        + ("import torch\n" if torch_first else "")
        + "from services.common import configure_torch_threads as c\n"
        f"ok = c({threads})\nimport torch\n"
        "print(ok, os.environ['OMP_WAIT_POLICY'], torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    result = _run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected.split()
    if warning is None:
        assert "WARNING" not in result.stderr
    else:
        assert warning in result.stderr


def test_configure_torch_threads_rejects_zero() -> None:
    with pytest.raises(ValueError):
        configure_torch_threads(0)


def test_leftover_tasks_that_swallow_a_cancellation_are_cancelled_again():
    """Python 3.11's wait_for can lose a cancel(); shutdown must not hang on such a task.
    (A private event loop: the runner cancels every other task on its loop.)"""
    import asyncio
    import logging

    from services.common.runner import _cancel_leftover_tasks

    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed >= 2:
                    raise

    async def main() -> asyncio.Task:
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        await _cancel_leftover_tasks(logging.getLogger("t"), wait_s=0.05)
        return task

    task = asyncio.run(main())
    assert task.cancelled() and swallowed == 2
