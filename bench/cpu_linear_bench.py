"""CPU float32: oneDNN packed linears (libs/model/cpu_linear.py) against F.linear (torch's BLAS).

Two levels, alternating ours and the peer, ``--reps`` times, medians:

- the linear layers of one forward of the real SmolLM2-135M (its own weights: 30 layers
  of qkv, o, gate_up and down, and the tied LM head) at 1, 2, 5, 9, 17 and 33 rows: a
  decode row, speculative verify chunks of k + 1 = 2 / 5 / 9 rows, small batches;
- the engine: greedy decode tokens/s at batch 1 on chat prompts, with ``packed_linears``
  on and off (two loads of the model), and whether the two produced the same tokens.

    python -m bench.cpu_linear_bench [--threads 1] [--reps 5] [--out bench/results/cpu_linear.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from bench.common import save_results, table
from libs.engine import EngineConfig, LLM, SamplingParams
from libs.model import cpu_linear

PROMPTS = [
    "Explain how photosynthesis works to a ten-year-old.",
    "Describe the city of Lisbon in a few sentences.",
    "What are three good habits for staying healthy in winter?",
]


def layer_weights(llm: LLM) -> list[torch.Tensor]:
    """The float32 weights of every linear of the model, and its LM head."""
    model = llm.loaded.model
    ws = [m.weight.detach() for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    ws.append((model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach())
    return ws


def ops(weights: list[torch.Tensor], rows: tuple[int, ...], reps: int) -> dict:
    packed = [cpu_linear.pack(w) for w in weights]
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        peer, ours = [], []
        for _ in range(reps):
            t = time.perf_counter()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            peer.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w, p in zip(weights, packed):
                cpu_linear.packed_linear(xs[w.shape[1]], p)
            ours.append(time.perf_counter() - t)
        a, b = statistics.median(peer[1:]) * 1e3, statistics.median(ours[1:]) * 1e3
        out[f"rows{m}"] = {"f_linear_ms": round(a, 2), "packed_ms": round(b, 2), "speedup": round(a / b, 2)}
    return out


def decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n, seconds, tokens = 0, 0.0, []
    for p in prompts:
        llm.add_request("r", p, params)
        got = []
        for o in llm.step():  # the prompt's step
            got += o.outputs[0].new_token_ids
        t = time.perf_counter()
        while llm.has_unfinished_requests():
            for o in llm.step():
                got += o.outputs[0].new_token_ids
        seconds += time.perf_counter() - t
        n += len(got) - 1
        tokens.append(got)
    return n / seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = dict(device="cpu", dtype="float32", num_threads=args.threads, num_blocks=64)
    ours, peer = LLM(EngineConfig(**cfg)), LLM(EngineConfig(**cfg, packed_linears=False))
    res: dict = {
        "device": platform.processor() or platform.machine(), "threads": args.threads, "reps": args.reps,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "load_before": os.getloadavg()[0],
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    res["linears_of_one_forward"] = ops(layer_weights(peer), (1, 2, 5, 9, 17, 33), args.reps)
    prompts = [ours.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    decode(ours, prompts[:1], 4)  # warm-up
    decode(peer, prompts[:1], 4)
    a, b, same = [], [], True
    for _ in range(max(1, args.reps // 2)):
        tps, t_peer = decode(peer, prompts, args.max_tokens)
        a.append(tps)
        tps, t_ours = decode(ours, prompts, args.max_tokens)
        b.append(tps)
        same = same and t_ours == t_peer
    res["engine_decode"] = {
        "f_linear_tok_s": round(statistics.median(a), 1), "packed_tok_s": round(statistics.median(b), 1),
        "speedup": round(statistics.median(b) / statistics.median(a), 2), "same_greedy_tokens": same,
        "f_linear_runs": [round(x, 1) for x in a], "packed_runs": [round(x, 1) for x in b],
    }
    rows = [[k, v["f_linear_ms"], v["packed_ms"], f"{v['speedup']}x"] for k, v in res["linears_of_one_forward"].items()]
    print(table(["rows", "F.linear ms", "packed ms", "speedup"], rows))
    print(json.dumps(res["engine_decode"]))
    save_results(res, args.out)


if __name__ == "__main__":
    main()
