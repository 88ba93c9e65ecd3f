"""``python -m services.decode``: a decode instance (see services/decode/app.py; ``--help`` lists every setting)."""

from services.decode.app import add_routes
from services.worker.app import run_worker

if __name__ == "__main__":
    run_worker("decode", add_routes)
