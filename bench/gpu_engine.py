"""GPU: Tidepool's engine vs Hugging Face transformers' ``generate`` on the same weights.

SmolLM2-135M's shape, random weights, bfloat16, one GPU, both measured in this run:

- decode at batch 1 (ms/step) and batch 64 (tokens/s), prompts of 128 tokens;
- prefill of 16 x 1024-token prompts (tokens/s; HF: one forward of the padded batch);
- the GPU idle fraction between decode steps, with and without async prepare (and, for
  reference, without CUDA graphs).

    python -m bench.gpu_engine [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import cuda_time, hf_llama, ours_from_hf, table
from libs.engine import EngineConfig, LLM, SamplingParams

PROMPT = 128
DECODE_STEPS = 256


def engine(loaded, **kw) -> LLM:
    cfg = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, num_blocks=8192, max_num_batched_tokens=16384, max_model_len=4096)
    cfg.update(kw)
    return LLM(EngineConfig(**cfg), loaded=loaded)


def decode(eng: LLM, batch: int, steps: int = DECODE_STEPS) -> dict:
    """Steady-state decode of ``batch`` sequences; prefill is excluded from the timing."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(0, 49152, (PROMPT,), generator=g).tolist()
        eng.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while eng.num_waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    torch.cuda.synchronize()
    eng.timer.reset()
    hits0, tokens0 = eng.prepared_ahead_hits, eng.num_generated_tokens
    t, n = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
    dt = time.perf_counter() - t
    return {
        "ms_per_step": dt / n * 1e3,
        "tokens_per_s": (eng.num_generated_tokens - tokens0) / dt,  # several per step when speculating
        "gpu_idle_fraction": eng.timer.idle_fraction,
        "prepared_ahead": eng.prepared_ahead_hits - hits0,
        "steps": n,
    }


def prefill(eng: LLM, batch: int = 16, length: int = 1024) -> float:
    g = torch.Generator().manual_seed(7)

    def run():
        for i in range(batch):
            ids = torch.randint(0, 49152, (length,), generator=g).tolist()
            eng.add_request(f"p{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()

    return batch * length / cuda_time(run, reps=3, warmup=1)


def hf_decode(hf, batch: int, steps: int = 64) -> dict:
    ids = torch.randint(0, 49152, (batch, PROMPT), device="cuda")
    attn = torch.ones_like(ids)
    gen = lambda n: hf.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)  # noqa: E731
    t1 = cuda_time(lambda: gen(1), reps=2)
    tn = cuda_time(lambda: gen(steps + 1), reps=2)
    step = (tn - t1) / steps
    return {"ms_per_step": step * 1e3, "tokens_per_s": batch / step}


def hf_prefill(hf, batch: int = 16, length: int = 1024) -> float:
    ids = torch.randint(0, 49152, (batch, length), device="cuda")
    with torch.inference_mode():
        return batch * length / cuda_time(lambda: hf(input_ids=ids, use_cache=False), reps=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    hf = hf_llama(dev, torch.bfloat16)
    loaded = ours_from_hf(hf, dev, torch.bfloat16)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    fast = engine(loaded)  # CUDA graphs + async prepare (the defaults on CUDA)
    decode(fast, 2, steps=16)  # warm-up: kernels compiled, graphs exercised
    res["ours_b1"] = decode(fast, 1)
    res["ours_b64"] = decode(fast, 64)
    res["ours_prefill_tok_s"] = prefill(fast)
    fast.close()
    sync = engine(loaded, async_prepare="off")
    decode(sync, 2, steps=16)
    res["ours_b1_sync"] = decode(sync, 1)
    res["ours_b64_sync"] = decode(sync, 64)
    sync.close()
    eager = engine(loaded, cuda_graphs=False)
    decode(eager, 2, steps=16)
    res["ours_b1_eager"] = decode(eager, 1, steps=64)
    res["ours_b64_eager"] = decode(eager, 64, steps=64)
    eager.close()
    del loaded
    res["hf_b1"] = hf_decode(hf, 1)
    res["hf_b32"] = hf_decode(hf, 32)
    res["hf_b64"] = hf_decode(hf, 64)
    res["hf_prefill_tok_s"] = hf_prefill(hf)

    f = lambda x, d=2: f"{x:.{d}f}"  # noqa: E731
    rows = [
        ["decode b1, ms/step", f(res["ours_b1"]["ms_per_step"], 3), f(res["hf_b1"]["ms_per_step"]), f(res["hf_b1"]["ms_per_step"] / res["ours_b1"]["ms_per_step"], 1) + "x", "<= 2 ms"],
        ["decode b64, tokens/s", f(res["ours_b64"]["tokens_per_s"], 0), f(res["hf_b64"]["tokens_per_s"], 0), f(res["ours_b64"]["tokens_per_s"] / res["hf_b64"]["tokens_per_s"], 1) + "x", ">= 20,000"],
        ["decode b32 (HF), tokens/s", "", f(res["hf_b32"]["tokens_per_s"], 0), "", ""],
        ["prefill 16x1024, tokens/s", f(res["ours_prefill_tok_s"], 0), f(res["hf_prefill_tok_s"], 0), f(res["ours_prefill_tok_s"] / res["hf_prefill_tok_s"], 1) + "x", ">= 5x HF"],
    ]
    print(f"\n{res['device']}, torch {res['torch']}, bf16, SmolLM2-135M shape (random weights)\n")
    print(table(["measure", "ours", "HF transformers", "ratio", "goal"], rows))
    idle = lambda r: "n/a" if r["gpu_idle_fraction"] is None else f"{100 * r['gpu_idle_fraction']:.1f}%"  # noqa: E731
    rows = [
        [name, f(res[k]["ms_per_step"], 3), f(res[k]["tokens_per_s"], 0), idle(res[k]), res[k]["prepared_ahead"]]
        for name, k in [
            ("b1, graphs + async prepare", "ours_b1"), ("b1, graphs, sync prepare", "ours_b1_sync"), ("b1, eager + async", "ours_b1_eager"),
            ("b64, graphs + async prepare", "ours_b64"), ("b64, graphs, sync prepare", "ours_b64_sync"), ("b64, eager + async", "ours_b64_eager"),
        ]
    ]
    print()
    print(table(["decode", "ms/step", "tokens/s", "GPU idle between steps", "steps prepared ahead"], rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
