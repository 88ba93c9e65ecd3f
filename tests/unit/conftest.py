import functools

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
def core_prompts(engine) -> list[list[int]]:
    """The engine-core prompts (tests/models.py: raw and chat), as token ids."""
    from bench.fp8_quality import engine_prompts

    return engine_prompts(engine)


@pytest.fixture(scope="session")
def core_greedy(engine, core_prompts) -> list[list[int]]:
    """The float32 engine's ``CORE_TOKENS`` greedy tokens for each core prompt, all in one
    batch, EOS ignored: computed once for the two modules that compare with them
    (transformers' in test_engine_correctness.py, FP8's in test_fp8_model.py)."""
    from libs.engine import SamplingParams
    from tests.models import CORE_TOKENS

    params = SamplingParams(temperature=0, max_tokens=CORE_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate(core_prompts, params)]


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' Llama on the same GGUF, in float32: the reference the engine is checked
    against. Loaded once per session (~15 s on the 2-core CI machine, 0.5 GB held):
    three modules use it."""
    transformers = pytest.importorskip("transformers")
    import gguf

    path = engine.loaded.path
    # transformers rebuilds gguf's tensor-name map, a pure function of (architecture, layer
    # count), once for each of the GGUF's tensors: 11 of the load's 25 s on 2 cores. It is
    # memoized for this load only; what transformers reads and converts is untouched.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
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
