"""Shared pieces of the benchmarks: timing, tables, and random models of real shapes.

GPU benchmarks run on a lent machine that cannot carry the 98 MB GGUF, so they use
random weights of SmolLM2-135M's exact shape: speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch

from libs.model import LoadedModel, ModelFingerprint
from libs.model.attention import make_backend
from libs.model.config import ModelConfig
from libs.model.llama import LlamaModel
from libs.model.tokenizer import Tokenizer

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
# Larger shapes (Hugging Face config.json fields) for the GPU benchmarks: head_dim 64 with
# 8 KV heads and a 128k vocabulary; head_dim 128, qkv biases and a 152k vocabulary.
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
)
QWEN2_5_7B = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=8192,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_3_2_1B, "qwen2.5-7b": QWEN2_5_7B}


def hf_llama(device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides: Any):
    """A transformers LlamaForCausalLM of SmolLM2-135M's shape (config fields in
    ``overrides`` replaced, e.g. ``num_hidden_layers``) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, **overrides}, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    model.generation_config.eos_token_id = None  # never stop early: fixed-length timing
    return model.to(device=device, dtype=dtype).eval()


def ours_from_hf(hf_model, device: torch.device, dtype: torch.dtype, backend: str = "auto") -> LoadedModel:
    """Our model with exactly the weights of ``hf_model`` (via the HF state-dict names)."""
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        model = LlamaModel(cfg, make_backend(backend, device))
    model = model.to_empty(device="cpu").float()
    model.rotary.__init__(cfg)
    model.load_hf_state({k: v.float().cpu() for k, v in hf_model.state_dict().items()})
    model = model.to(device=device, dtype=dtype)
    model.rotary.to(device=device, dtype=torch.float32)
    model.eval().requires_grad_(False)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer(backend=HFTokenizer(models.BPE()), eos_token_ids=())
    fp = ModelFingerprint("random-smollm2-135m", str(dtype).removeprefix("torch."))
    return LoadedModel("random-smollm2-135m", Path("random"), cfg, model, tok, fp, dtype, device)


def random_loaded(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, **overrides) -> LoadedModel:
    """Our model of a named shape (``SHAPES``) with random weights, built on ``device``
    directly (no transformers): N(0, 0.02) linears and embeddings, unit norms. Speed does
    not depend on the values. ``overrides`` replace config fields (e.g. a smaller vocab)."""
    cfg = ModelConfig.from_hf({**SHAPES[shape], **overrides})
    with torch.device("meta"):
        model = LlamaModel(cfg, make_backend("auto", device))
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    model.rotary.__init__(cfg)
    model.rotary.to(device=device, dtype=torch.float32)
    model.eval().requires_grad_(False)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer(backend=HFTokenizer(models.BPE()), eos_token_ids=())
    fp = ModelFingerprint(f"random-{shape}-{seed}", str(dtype).removeprefix("torch."))
    return LoadedModel(f"random-{shape}", Path("random"), cfg, model, tok, fp, dtype, device)


def synchronize(device: torch.device | str = "cuda") -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cuda_time(fn: Callable[[], object], reps: int = 5, warmup: int = 1, device: torch.device | str = "cuda") -> float:
    """Median seconds of ``fn`` (synchronised with ``device``: CUDA, or the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def table(headers: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def save_results(results: dict, out: str | None) -> None:
    """End of a CPU run: the load average after it (the box is shared; ``load_before`` is
    the caller's), printed with the one before, and the JSON written to ``out`` if given."""
    results["load_after"] = os.getloadavg()[0]
    print(f"load average before/after: {results['load_before']:.2f} / {results['load_after']:.2f}")
    write_json(results, out)


def write_json(results: dict, out: str | None) -> None:
    """The results as indented JSON to ``out``, if given."""
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


def git_commit() -> str:
    """The checkout's short commit, for the record ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def kernel_bench_parser(doc: str, threshold_help: str) -> argparse.ArgumentParser:
    """The command line every kernel sweep takes: ``--toy`` (tiny shapes in Triton's
    interpreter on the CPU: checks the script, times nothing real), ``--write-threshold``
    (store the measured threshold; GPU only) and ``--out`` (the rows as JSON)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (Triton's interpreter): checks the script, times nothing real")
    ap.add_argument("--write-threshold", action="store_true", help=threshold_help)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    return ap
