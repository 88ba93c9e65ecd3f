"""``python -m services.prefill``: a prefill instance (see services/prefill/app.py; ``--help`` lists every setting)."""

from services.prefill.app import add_routes
from services.worker.app import run_worker

if __name__ == "__main__":
    run_worker("prefill", add_routes)
