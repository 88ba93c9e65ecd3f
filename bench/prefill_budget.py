"""Prefill of 16 x 1024-token prompts by step budget, with async scheduling on and off
(issue 10): does splitting the batch into steps let the host's work for one step hide
behind the GPU's work for the one before?

``bench.gpu_engine`` times the prefill with a 16384-token budget: one step, whose host
work (admission, scheduling, preparing, launching the graph) comes before any GPU work.
With a budget of 8192 or 4096 tokens the same prompts take 2 or 4 chunked steps, and with
async scheduling step N + 1 is prepared while step N runs. This reports, per budget and
mode, tokens/s (median of ``--reps``), the ratio to transformers' prefill of the same
prompts on the same weights (SmolLM2 shape, bf16, random), and the host phases of one
batch (``LLM.phases``: summed over its steps, in ms; ``sample`` is mostly the wait for
the GPU).

    python -m bench.prefill_budget [--budgets 16384,8192,4096] [--reps 5] [--out results.json]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import cuda_time, hf_llama, ours_from_hf, table, write_json
from bench.gpu_engine import decode, engine, hf_prefill, prefill_batch, prompt_sets

BATCH, LENGTH = 16, 1024


def measure(loaded, budget: int, mode: str, reps: int) -> dict:
    eng = engine(loaded, async_scheduling=mode, max_num_batched_tokens=budget, prefill_graph_max_tokens=budget)
    try:
        decode(eng, 2, steps=8)  # warm the graphs
        prompts = prompt_sets(eng, [LENGTH] * BATCH, reps + 3, seed=7)
        seconds = cuda_time(lambda: prefill_batch(eng, prompts()), reps=reps, warmup=2, device=eng.device)
        eng.phases.history = []
        admission = prefill_batch(eng, prompts())
        torch.cuda.synchronize()
        history, eng.phases.history = eng.phases.history, None
    finally:
        eng.close()
    phases = {k: sum(h.get(k, 0.0) for h in history) * 1e3 for k in history[0] if isinstance(history[0][k], float)}
    return {"tok_s": BATCH * LENGTH / seconds, "admission_ms": admission * 1e3, "steps": len(history), "phases_ms": phases}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="16384,8192,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="also write the figures here as JSON")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hf = hf_llama(dev, torch.bfloat16)
    loaded = ours_from_hf(hf, dev, torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "hf_tok_s": hf_prefill(hf, BATCH, LENGTH), "runs": {}}
    del hf
    rows = []
    for budget in map(int, args.budgets.split(",")):
        for mode in ("on", "off"):
            r = res["runs"][f"{budget}/{mode}"] = measure(loaded, budget, mode, args.reps)
            p = r["phases_ms"]
            rows.append([budget, mode, r["steps"], f"{r['tok_s']:,.0f}", f"{r['tok_s'] / res['hf_tok_s']:.2f}x", f"{r['admission_ms']:.2f}",
                         *(f"{p.get(k, 0):.2f}" for k in ("schedule", "prepare", "launch", "sample", "output"))])
    print(f"\n{res['device']}: prefill {BATCH} x {LENGTH}, SmolLM2 shape; transformers {res['hf_tok_s']:,.0f} tokens/s\n")
    print(table(["budget", "async", "steps", "tokens/s", "vs transformers", "admission ms", "schedule ms", "prepare ms", "launch ms", "sample ms", "output ms"], rows))
    write_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
