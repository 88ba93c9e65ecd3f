import pytest
import torch

from libs.engine import EngineConfig, LLM


@pytest.fixture(scope="session")
def engine() -> LLM:
    """The real SmolLM2-135M in float32 on the CPU, shared by the session's tests.

    Tests must leave it idle (every request finished or aborted)."""
    torch.set_num_threads(2)
    eng = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=1024, max_num_seqs=32))
    yield eng
    assert not eng.has_unfinished_requests()
