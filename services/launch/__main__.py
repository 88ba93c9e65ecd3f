"""``python -m services.launch`` (what ``make run`` runs): Redis and the four services.

Prints the API's URL once a request would succeed (the router's ``/ready``), restarts any
process that dies (services/launch/supervisor.py; each restart is logged here), and Ctrl-C
stops every process it started.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.processes import ServiceStartError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.launch",
        description="Run Redis, cache_store, router, prefill and decode locally.",
        epilog="The services share an internal token: TIDEPOOL_INTERNAL_TOKEN from this environment, or a "
        "random one. Any other TIDEPOOL_* variable reaches every service (see python -m services.<name> --help).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the router binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="router port: the OpenAI API (default 8000)")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per model process (default: cores / instances)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="start a local Redis Cluster of N nodes instead of one Redis (the pool shards over it)")
    p.add_argument("--pool-gb", type=float, default=1.0, help="memory for the KV pool (Redis maxmemory, split between cluster nodes), GiB")
    p.add_argument("--redis-args", default=os.environ.get("TIDEPOOL_REDIS_ARGS", ""),
                   help="more redis-server flags for the Redis (or each cluster node) started here, e.g. "
                   "'--io-threads 4 --io-threads-do-reads yes' on a host with cores to spare (env TIDEPOOL_REDIS_ARGS)")
    p.add_argument("--log-dir", default=".run/logs", help="where service logs go (default .run/logs)")
    p.add_argument("--api-key", default=None, help="require this API key (Authorization: Bearer ...)")
    p.add_argument("--no-supervise", dest="supervise", action="store_false",
                   help="do not restart processes that die (default: restart with backoff)")
    args = p.parse_args(argv)
    if args.redis_cluster < 0 or (args.redis_cluster and args.redis_url):
        p.error("--redis-cluster N takes N >= 1 and starts its own Redis: drop --redis-url")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    cfg = ClusterConfig(
        host=args.host, router_port=args.port, model=args.model, device=args.device, dtype=args.dtype,
        num_prefill=args.prefill, num_decode=args.decode, threads=args.threads, redis_url=args.redis_url, redis_cluster=args.redis_cluster,
        pool_gb=args.pool_gb, redis_args=args.redis_args.split(), log_dir=Path(args.log_dir), api_key=args.api_key,
        supervise=args.supervise,
    )
    cluster = LocalCluster(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("starting Redis, cache_store, router, prefill and decode (model load takes a few seconds) ...", flush=True)
    try:
        cluster.start()
    except ServiceStartError as e:
        print(f"launch failed: {e}", file=sys.stderr)
        return 1
    print(f"\nTidepool is up: {cluster.url}/v1  (model list: {cluster.url}/v1/models)", flush=True)
    print(f"  try: curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' "
          "-d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}]}'", flush=True)
    print(f"  logs: {cfg.log_dir}/   Ctrl-C stops everything.", flush=True)
    try:
        while not stop.wait(0.5):
            if not cfg.supervise and any(not c.running for c in cluster.children()):
                dead = ", ".join(c.name for c in cluster.children() if not c.running)
                print(f"service(s) exited: {dead}; stopping (see {cfg.log_dir})", file=sys.stderr)
                return 1
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        print("stopped.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
