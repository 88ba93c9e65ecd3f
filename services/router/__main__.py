"""``python -m services.router``: load the tokenizer, then serve until SIGINT/SIGTERM.

Prints ``tidepool router ready at http://HOST:PORT`` once listening (with ``--port 0``,
the port the kernel picked), which is how launchers and tests find it.
"""

from __future__ import annotations

from services.common import parse_settings, run_service
from services.router.app import create_router_app
from services.router.settings import RouterSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(RouterSettings, argv, prog="python -m services.router")
    run_service(create_router_app(settings), settings)


if __name__ == "__main__":
    main()
