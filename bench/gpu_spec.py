"""GPU: the cost of speculation itself, with acceptance forced to 0, 0.5 and 1, k = 1..8.

SmolLM2-135M's shape, random weights, bfloat16, CUDA graphs (a verify step replays the
prefill graph of its token bucket), the Triton rejection sampler, async prepare. Drafts
come from a proposer that costs nothing (it repeats the last token), and forced
acceptance (``forced_acceptance`` in the speculative config) fixes how many drafts each
round keeps, which random weights could not: so the figures are what speculation costs
and gives at a known acceptance, whatever drafts it. Same run, same engine settings, for
each batch size:

- ms per emitted token (per sequence, steady-state decode) with speculation, against
  plain decoding (``off``);
- the verify step (its median wall time, forward + rejection sampling + bookkeeping)
  against a plain decode step: what ``k + 1`` query tokens per sequence cost compared
  with one.

    python -m bench.gpu_spec [--batches 1 16] [--ks 1 2 ... 8] [--out bench/results/gpu_spec.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from bench.common import hf_llama, ours_from_hf, table
from bench.spec_bench import FreeDrafts
from libs.engine import EngineConfig, LLM, SamplingParams

TOKENS = 256
PROMPT = 128


def engine(loaded, k: int | None, max_batch: int) -> LLM:
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k, "forced_acceptance": 0.0, "min_acceptance_length": 0}
    eng = LLM(
        EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=max_batch, num_blocks=4096, max_model_len=2048,
                     graph_max_batch=max_batch, prefill_graph_max_tokens=max_batch * 9,
                     speculative_config=json.dumps(spec) if spec else None),
        loaded=loaded,
    )
    if k is not None:
        eng.spec.proposer = FreeDrafts()
    return eng


def run(eng: LLM, batch: int) -> dict:
    """Steady-state decode of ``batch`` sequences of ``TOKENS`` tokens each."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(0, eng.vocab_size, (PROMPT,), generator=g).tolist()
        eng.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    while eng.num_waiting or len(eng.scheduler.decoding) < batch:  # the prompts' steps
        eng.step()
    paths, build = [], eng.builder.build

    def spy(*a):
        step = build(*a)
        paths.append(step.path if not step.num_verify_tokens else "verify:" + step.path)
        return step

    eng.builder.build = spy
    tokens0, times = eng.num_generated_tokens, []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()  # (synchronous scheduling: each step waits for its own ids)
        times.append(time.perf_counter() - t)
    eng.builder.build = build
    emitted = (eng.num_generated_tokens - tokens0) / batch
    steady = times[: max(1, len(times) - 2)]  # the last steps are cut short by max_tokens
    return {"ms_per_token": sum(times) * 1e3 / emitted, "step_ms": statistics.median(steady) * 1e3, "paths": sorted(set(paths))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = ours_from_hf(hf_llama(torch.device("cuda"), torch.bfloat16), torch.device("cuda"), torch.bfloat16)
    max_batch = max(args.batches)
    results: dict = {"device": torch.cuda.get_device_name(), "batches": args.batches, "tokens": TOKENS, "rows": []}
    off = engine(loaded, None, max_batch)
    run(off, 1)  # warm-up
    plain = {b: run(off, b) for b in args.batches}
    off.close()
    for k in args.ks:
        eng = engine(loaded, k, max_batch)
        run(eng, 1)  # warm-up
        for r in args.rates:
            eng.spec.config = dataclasses.replace(eng.spec.config, forced_acceptance=r)
            for b in args.batches:
                m0 = eng.spec.metrics.snapshot()
                got = run(eng, b)
                m = eng.spec.metrics.snapshot()
                drafts = m["num_drafts"] - m0["num_drafts"]
                results["rows"].append({
                    "batch": b, "k": k, "rate": r, "ms_per_token": got["ms_per_token"], "off_ms_per_token": plain[b]["ms_per_token"],
                    "speedup": plain[b]["ms_per_token"] / got["ms_per_token"], "verify_step_ms": got["step_ms"],
                    "decode_step_ms": plain[b]["step_ms"], "verify_over_decode": got["step_ms"] / plain[b]["step_ms"],
                    "mean_acceptance_length": 1 + (m["num_accepted_tokens"] - m0["num_accepted_tokens"]) / drafts if drafts else None,
                    "paths": got["paths"],
                })
        eng.close()
    print(table(
        ["batch", "k", "forced rate", "ms/token", "off ms/token", "speedup", "verify step ms", "decode step ms", "verify / decode", "paths"],
        [[r["batch"], r["k"], r["rate"], f"{r['ms_per_token']:.3f}", f"{r['off_ms_per_token']:.3f}", f"{r['speedup']:.2f}x",
          f"{r['verify_step_ms']:.3f}", f"{r['decode_step_ms']:.3f}", f"{r['verify_over_decode']:.2f}", " ".join(r["paths"])] for r in results["rows"]],
    ))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
