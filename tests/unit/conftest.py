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


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' Llama on the same GGUF, in float32: the reference the engine is checked
    against. Loaded once per session (~15 s each time on the 2-core CI machine, 0.5 GB held):
    three modules use it."""
    transformers = pytest.importorskip("transformers")
    path = engine.loaded.path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (from the GGUF), loaded once per session."""
    from libs.model import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def grammar_compiler(smollm2_tokenizer):
    """A structured-output grammar compiler on the real tokenizer (llguidance indexes the
    vocabulary once, ~1 s)."""
    from libs.structured import GrammarCompiler

    return GrammarCompiler(smollm2_tokenizer)
