"""Models for tests: the real embedded SmolLM2 (loaded once per session) and a tiny random
Llama for fast scheduler and block-manager tests."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from libs.engine import EngineConfig, LLM
from libs.model import LoadedModel, ModelFingerprint, default_model_path
from libs.model.attention import torch_backend
from libs.model.config import ModelConfig
from libs.model.llama import LlamaModel
from libs.model.source import load_tokenizer

RAW_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The capital of Japan is",
    "List three colors: red,",
    "In 1969, the first humans",
    "import numpy as np\nx = np.array([1, 2, 3])\nprint(",
    "Water boils at a temperature of",
    "My favourite recipe for pancakes starts with",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name two prime numbers."},
        {"role": "assistant", "content": "2 and 3."},
        {"role": "user", "content": "Two more?"},
    ],
]

CORE_TOKENS = 32  # greedy tokens per prompt in the engine-core checks (tests/unit/conftest.py)


@functools.lru_cache(maxsize=1)
def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True,
    )


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return load_tokenizer(None)


def tiny_loaded(seed: int = 0) -> LoadedModel:
    """A 2-layer random Llama with the real tokenizer: fast, deterministic, same API."""
    cfg = tiny_config()
    torch.manual_seed(seed)
    model = LlamaModel(cfg, torch_backend()).float().eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return LoadedModel(
        name="tiny", path=Path("tiny"), config=cfg, model=model, tokenizer=_tokenizer(),
        fingerprint=ModelFingerprint(f"tiny-{seed}", "float32"), dtype=torch.float32, device=torch.device("cpu"),
    )


def tiny_engine(**overrides) -> LLM:
    cfg = EngineConfig(device="cpu", dtype="float32", **{"num_blocks": 64, **overrides})
    return LLM(cfg, loaded=tiny_loaded())


def real_model_path() -> Path:
    return default_model_path()


@functools.lru_cache(maxsize=1)
def hf_gguf_tokenizer():
    """transformers' own tokenizer for the embedded GGUF (the reference for ours), loaded
    once per session: converting the GGUF vocabulary takes seconds.

    On a lent GPU machine the GGUF cannot travel (too large): there
    ``TIDEPOOL_TOKENIZER_DIR`` names a folder with its exported tokenizer files
    (bench/gpu_session.sh sets it), which the random-weight GPU tests need."""
    import transformers

    from libs.model.source import ModelNotFoundError

    try:
        path = default_model_path()
    except ModelNotFoundError:
        folder = os.environ.get("TIDEPOOL_TOKENIZER_DIR")
        if not folder:
            raise
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"))
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_greedy_batch(model, prompts: list[list[int]], n: int) -> list[tuple[list[int], torch.Tensor]]:
    """:func:`hf_greedy` for many prompts in one left-padded batch (an attention mask and
    explicit positions, as transformers' own batched ``generate`` pads): on the CPU a step
    costs a read of every weight, so one batch is about as fast as one prompt. A padded
    row's tokens and logits are those of the prompt alone up to float32 rounding."""
    width = max(len(ids) for ids in prompts)
    x = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    past, first = None, None
    with torch.no_grad():
        for _ in range(n):
            positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -x.shape[1]:]
            o = model(input_ids=x, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            logits = o.logits[:, -1].float()
            first = logits if first is None else first
            past = o.past_key_values
            x = logits.argmax(-1, keepdim=True)
            for row, t in zip(out, x[:, 0].tolist()):
                row.append(t)
            mask = torch.cat([mask, torch.ones_like(x)], dim=-1)
    return [(row, first[i]) for i, row in enumerate(out)]


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from a transformers model with its own KV cache (no EOS stop), plus
    the first step's fp32 logits: the reference our engine is compared with."""
    return hf_greedy_batch(model, [prompt_ids], n)[0]
