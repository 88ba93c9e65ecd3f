"""Tiny random Hugging Face checkpoints written by transformers itself, for model tests.

``write_checkpoint`` saves a model of any transformers family with ``save_pretrained``
(safetensors) and the SmolLM2 tokenizer beside it, so the folder is exactly what a user
downloads. The weights are re-drawn large enough that the logits are far from uniform: a
wrong rope theta, a dropped bias, a wrong tie or a wrong expert shows up as a logits error
of order 1, against a tolerance of 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import hf_gguf_tokenizer


def save_tokenizer(folder: Path) -> Path:
    """The SmolLM2 tokenizer as transformers saves it (tokenizer.json, config, template)."""
    hf_gguf_tokenizer().save_pretrained(str(folder))
    return folder


def write_checkpoint(
    config_cls: str, model_cls: str, config: dict[str, Any], folder: Path, tokenizer_dir: Path, *, seed: int = 0
):
    """Write a random ``model_cls`` of ``config`` (plus the vocabulary size) into ``folder``
    with the tokenizer from ``tokenizer_dir``; return the transformers model."""
    import transformers

    cfg = getattr(transformers, config_cls)(vocab_size=len(hf_gguf_tokenizer()), **config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # biases too: transformers initialises them to zero, which would hide a dropped bias
                p.normal_(0, 0.3 if ("embed" in pname or "lm_head" in pname) else 0.15)
    model.save_pretrained(str(folder), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return model


def assert_logits_match(model, engine, prompts: list[list[int]], tol: float = 1e-4) -> None:
    """The engine's first-step logits equal transformers' within ``tol`` for each prompt."""
    for ids in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].float()
        assert ref.std() > 1.0, "random weights too small: the comparison would prove little"
        ours = engine.first_step_logits(ids)
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < tol, f"max |Δlogit| {err:.3g} for a {len(ids)}-token prompt"


def assert_greedy_matches(model, engine, prompts: list[list[int]], n: int) -> None:
    """``n`` greedy tokens of the engine (batched) equal transformers' own, for each prompt."""
    from libs.engine import SamplingParams
    from tests.models import hf_greedy

    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for ids, r in zip(prompts, ours):
        assert r.token_ids == hf_greedy(model, ids, n)[0]
    assert not engine.has_unfinished_requests()
