from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Skip this folder's tests without CUDA (a hook sees every collected item, so only
    the ones under tests/gpu are marked)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
