"""The router: the public OpenAI-compatible API in front of prefill and decode instances.

Module map (each has one job):

- ``app``: routes, auth, registration endpoints, lifecycle (``create_router_app``)
- ``settings``: ``RouterSettings`` (``python -m services.router --help``)
- ``api``: OpenAI request bodies -> validated ``GenerateRequest``
- ``generate``: one API request end to end (tokenize, jobs, SSE or JSON, disconnects)
- ``handoff``: one prompt's prefill -> decode path, fallbacks and stream resumption
- ``placement``: choosing decode (load, free blocks) and prefill (queue depth); skip rules
- ``registry``: registered instances, heartbeats, expiry
- ``workers``: the HTTP client for prefill, decode and cache_store
- ``detok``/``stop``: tokens -> text (incremental, stop strings) and rendered logprobs
- ``responses``: OpenAI response and chunk shapes
- ``trace``: the per-request handoff trace and its one log line
- ``metrics``: Prometheus metrics
- ``errors``: OpenAI-shaped errors
"""

from services.router.app import create_router_app
from services.router.settings import RouterSettings

__all__ = ["RouterSettings", "create_router_app"]
