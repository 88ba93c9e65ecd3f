"""Scaffolding shared by the four services: settings, the aiohttp app, the runner, CPU threads.

A service's ``__main__`` is typically::

    settings = parse_settings(CacheStoreSettings)
    app = create_app("cache_store", settings, stats=store.stats, health=store.healthy)
    app.router.add_post("/leases", handle_lease)
    run_service(app, settings)
"""

from services.common.app import METRICS_REGISTRY, SERVICE_NAME, SETTINGS, create_app
from services.common.cpu import configure_torch_threads, torch_child_env
from services.common.runner import configure_logging, run_service, serve
from services.common.settings import BaseSettings, build_parser, env_name, flag_name, parse_settings, setting

__all__ = [
    "METRICS_REGISTRY",
    "SERVICE_NAME",
    "SETTINGS",
    "BaseSettings",
    "build_parser",
    "configure_logging",
    "configure_torch_threads",
    "create_app",
    "env_name",
    "flag_name",
    "parse_settings",
    "run_service",
    "serve",
    "setting",
    "torch_child_env",
]
