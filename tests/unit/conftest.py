import pytest
import torch

from libs.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    """The real SmolLM2-135M in float32 on the CPU, shared by the session's tests.

    Tests must leave it idle (every request finished or aborted)."""
    torch.set_num_threads(2)
    eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=1024, max_num_seqs=32))
    yield eng
    assert not eng.has_unfinished_requests()
