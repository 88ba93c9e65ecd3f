"""cache_store: the KV pool's policy (byte budget, LRU eviction, leases, statistics) and its REST API.

Prefill and decode move block bytes to and from Redis themselves (libs/kvpool); this
service owns what happens around those bytes (DESIGN.md, "Pool policy"):

- settings.py  the knobs (``python -m services.cache_store --help``)
- policy.py    the background loop: reap expired leases, evict to the budget, refresh stats
- app.py       the HTTP API (blocks, queries, leases, stats) and the app factory
- metrics.py   the Prometheus view of the pool-wide counters kept in Redis
"""
