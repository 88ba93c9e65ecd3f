"""End-to-end decode with FP8 weights against bf16 weights: ms per decode step for
Llama-3.2-1B's shape at batch 1 and 64 (``--batches``), both in one run on one GPU.

Random weights of the exact shape (hidden 2048, 16 layers, 32/8 heads, intermediate 8192,
vocab 128256, tied embeddings; ``--shape llama-3-8b``: hidden 4096, 32 layers, 32/8 heads of
128, intermediate 14336, untied): speed does not depend on the values. The FP8 engine
quantizes its projections at load (libs/model/fp8.py), so on an FP8 GPU every projection
runs what an FP8 layer runs at that batch: the skinny GEMM with its e4m3 weight (norm or
activation folded in, as bf16's; kernels/gemv) up to the stored ``fp8_max_m``, else the
block-scaled GEMMs of kernels/fp8 (swap-AB at these batch sizes if the stored threshold
says so). A third engine runs FP8 with the skinny GEMM turned off
(``TIDEPOOL_FP8_SKINNY_MAX_M=0``), to show what it buys. Attention, norms and the LM head
stay bf16 in all. CUDA graphs are on for all (the engine's default on CUDA).

``--toy`` runs a two-layer model on the CPU through the same code (the FP8 layers then take
the dequantize-then-matmul path): it checks the script; its timings say nothing about GPUs.

    python -m bench.fp8_decode_bench [--shape llama-3-8b] [--batches 1,16] [--skip-no-skinny] [--out FILE]
    python -m bench.fp8_decode_bench --toy
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.common import table
from kernels.gemv.threshold import FP8_ENV, fp8_skinny_max_m
from libs.engine import LLM, EngineConfig, SamplingParams
from libs.model import LoadedModel, ModelFingerprint
from libs.model.attention import make_backend
from libs.model.config import ModelConfig
from libs.model.fp8 import Fp8Linear, quantize_projections
from libs.model.llama import LlamaModel
from libs.model.tokenizer import Tokenizer

LLAMA_3_2_1B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    name="llama-3.2-1b-shape",
)
LLAMA_3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, name="llama-3-8b-shape",
)
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B}
TOY = ModelConfig(
    architecture="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True, name="toy",
)
PROMPT = 128


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, fp8: bool, seed: int = 0) -> LoadedModel:
    """Our model with random weights (std 0.02, norms 1), FP8 projections if ``fp8``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaModel(cfg, make_backend("auto", device))
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    model.rotary.__init__(cfg)
    if fp8:
        quantize_projections(model, device)
    model = model.to(device=device, dtype=dtype)
    model.rotary.to(device=device, dtype=torch.float32)
    model.eval().requires_grad_(False)
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer(backend=HFTokenizer(models.BPE()), eos_token_ids=())
    fingerprint = ModelFingerprint(f"random-{cfg.name}", str(dtype).removeprefix("torch."), quantization="fp8" if fp8 else "none")
    return LoadedModel(cfg.name, Path("random"), cfg, model, tok, fingerprint, dtype, device)


def decode_ms_per_step(llm: LLM, batch: int, steps: int) -> float:
    """Steady-state decode of ``batch`` sequences of ``PROMPT`` random tokens; prefill excluded."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(0, llm.vocab_size, (PROMPT,), generator=g).tolist()
        llm.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while llm.num_waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running.values()):
        llm.step()
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t, n = time.perf_counter(), 0
    while llm.has_unfinished_requests():
        llm.step()
        n += 1
    sync()
    return (time.perf_counter() - t) / n * 1e3


def projection_bytes(model: torch.nn.Module) -> int:
    total = 0
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, Fp8Linear):
                total += m.weight_q.numel() + 4 * m.weight_scale.numel()
            elif type(m) is torch.nn.Linear:
                total += m.weight.numel() * m.weight.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="a two-layer model on the CPU: checks the script, times nothing real")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 256; toy 8)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64; toy 1,4)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b", help="the model shape (random weights)")
    ap.add_argument("--skip-no-skinny", action="store_true", help="leave out the FP8 engine with the skinny GEMM off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.toy else "cuda")
    cfg, dtype = (TOY, torch.float32) if args.toy else (SHAPES[args.shape], torch.bfloat16)
    steps = args.steps or (8 if args.toy else 256)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 4) if args.toy else (1, 64)
    engine_cfg = dict(device=device.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=64, num_blocks=64 if args.toy else 4096, max_model_len=1024)
    results: dict = {"model": cfg.name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "steps": steps}
    dense = str(dtype).removeprefix("torch.")
    engines = [(dense, False, False), ("fp8", True, False)] + [("fp8_no_skinny", True, True)] * (not args.skip_no_skinny)
    for name, fp8, skinny_off in engines:
        if skinny_off:
            os.environ[FP8_ENV] = "0"
        try:
            loaded = random_model(cfg, device, dtype, fp8)
            llm = LLM(EngineConfig(**engine_cfg), loaded=loaded)
            results[name] = {"projection_bytes": projection_bytes(loaded.model)}
            for batch in batches:
                results[name][f"batch_{batch}_ms_per_step"] = decode_ms_per_step(llm, batch, steps)
            llm.close()
        finally:
            if skinny_off:
                os.environ.pop(FP8_ENV, None)
        del llm, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["fp8_skinny_max_m"] = fp8_skinny_max_m(device)

    def ms(name: str, b: int) -> float:
        return results[name][f"batch_{b}_ms_per_step"]

    names = [name for name, _, _ in engines]
    rows = [[b] + [f"{ms(name, b):.3f}" for name in names] + [f"{ms(dense, b) / ms(name, b):.2f}x" for name in names[1:]] for b in batches]
    print(json.dumps(results, indent=2))
    print(table(["batch"] + [f"{name} ms/step" for name in names] + [f"{dense}/{name}" for name in names[1:]], rows))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
