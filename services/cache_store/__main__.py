"""``python -m services.cache_store``: serve the pool's policy and REST API until SIGINT/SIGTERM."""

from __future__ import annotations

from typing import Sequence

from services.cache_store.app import build_app
from services.cache_store.settings import CacheStoreSettings
from services.common.runner import run_service
from services.common.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(CacheStoreSettings, argv, prog="python -m services.cache_store")
    run_service(build_app(settings), settings)


if __name__ == "__main__":
    main()
