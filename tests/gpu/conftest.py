import pytest
import torch

collect_ignore_glob: list[str] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        item.add_marker(skip)
