"""CPU: Tidepool's engine vs llama.cpp on the same GGUF (SmolLM2-135M-Instruct), same run.

Three figures, each as ours, llama.cpp's and the ratio:

- prefill tokens/s of a 512-token prompt;
- decode ms/step at batch 1;
- aggregate decode tokens/s at batch 16 (llama.cpp: its single stream, the issue's peer).

llama.cpp comes from llama-cpp-python built from PyPI (``pip install llama-cpp-python``);
without it those columns say "missing" and only our figures are printed. Both sides get
the same number of threads. Ours runs twice: in float32 (the engine's CPU default, exact
against transformers) and with the GGUF's 4-bit weights kept packed (``quantized_weights``:
the file's own format, as llama.cpp runs it; libs/model/quantized.py). Decode figures are
the median of three runs.

    python -m bench.cpu_engine [--threads 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench.common import table
from libs.engine import EngineConfig, LLM, SamplingParams
from libs.model import default_model_path

PREFILL_LEN = 512
DECODE_STEPS = 128


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    text = f"{salt} " + " ".join(f"The {i}th ocean wave rolls onto the sand while gulls circle overhead." for i in range(200))
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def ours(threads: int, dtype: str, quantized: bool = False) -> dict:
    torch.set_num_threads(threads)
    eng = LLM(EngineConfig(
        device="cpu", dtype=dtype, num_threads=threads, max_num_batched_tokens=PREFILL_LEN, num_blocks=1024,
        enable_prefix_caching=False, quantized_weights=quantized,
    ))
    tok = eng.tokenizer
    eng.generate([prompt_ids(tok, 64, 99)], SamplingParams(temperature=0, max_tokens=8))  # warm-up

    def prefill_once(salt: int) -> float:
        ids = prompt_ids(tok, PREFILL_LEN, salt)
        t = time.perf_counter()
        eng.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        return PREFILL_LEN / (time.perf_counter() - t)

    prefill = statistics.median(prefill_once(s) for s in range(3))

    def decode(batch: int) -> float:
        """Seconds per decode step with ``batch`` sequences in flight."""
        for i in range(batch):
            eng.add_request(f"b{batch}-{i}", prompt_ids(tok, 32, 1000 + i), SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True))
        while eng.num_waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
            eng.step()
        t, n = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        return (time.perf_counter() - t) / n

    b1 = statistics.median(decode(1) for _ in range(3))
    b16 = statistics.median(decode(16) for _ in range(3))
    return {"prefill_tok_s": prefill, "decode_b1_ms": b1 * 1e3, "decode_b16_tok_s": 16 / b16}


def llama_cpp(threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_model_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=PREFILL_LEN, verbose=False)
    from libs.model import load_tokenizer

    tok = load_tokenizer(None)
    llm.eval(prompt_ids(tok, 64, 99))  # warm-up

    def prefill_once(salt: int) -> float:
        llm.reset()
        ids = prompt_ids(tok, PREFILL_LEN, salt)
        t = time.perf_counter()
        llm.eval(ids)
        return PREFILL_LEN / (time.perf_counter() - t)

    prefill = statistics.median(prefill_once(s) for s in range(3))
    def decode_once() -> float:
        llm.reset()
        llm.eval(prompt_ids(tok, 32, 1000))
        t = time.perf_counter()
        for _ in range(DECODE_STEPS):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])  # one token per step, greedy
        return (time.perf_counter() - t) / DECODE_STEPS

    step = statistics.median(decode_once() for _ in range(3))
    return {"prefill_tok_s": prefill, "decode_b1_ms": step * 1e3, "single_stream_tok_s": 1 / step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    peer = llama_cpp(args.threads)
    exact = ours(args.threads, args.dtype)
    q4 = ours(args.threads, args.dtype, quantized=True)
    f = lambda x, d=1: "missing" if x is None else f"{x:.{d}f}"  # noqa: E731
    g = lambda k: None if peer is None else peer[k]  # noqa: E731
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    rows = []
    for name, m in ((f"ours, {args.dtype} (exact)", exact), ("ours, 4-bit decode (quantized_weights)", q4)):
        rows += [
            [f"prefill 512 tokens (tokens/s), {name}", f(m["prefill_tok_s"]), f(g("prefill_tok_s")), ratio(m["prefill_tok_s"], g("prefill_tok_s")), ">= 2x"],
            [f"decode batch 1 (ms/step), {name}", f(m["decode_b1_ms"], 2), f(g("decode_b1_ms"), 2), ratio(g("decode_b1_ms"), m["decode_b1_ms"]), ">= 0.5x (within 2x)"],
            [f"decode batch 16 aggregate vs llama.cpp single stream (tokens/s), {name}", f(m["decode_b16_tok_s"]), f(g("single_stream_tok_s")), ratio(m["decode_b16_tok_s"], g("single_stream_tok_s")), ">= 2x"],
        ]
    print(f"\n{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}\n")
    print(table(["measure", "ours", "llama.cpp", "ours vs llama.cpp", "goal"], rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"ours_exact": exact, "ours_q4": q4, "llama_cpp": peer, "threads": args.threads}, fh, indent=1)


if __name__ == "__main__":
    main()
