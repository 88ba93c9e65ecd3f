"""GPU: the cost of speculation itself, with acceptance forced to 0, 0.5 and 1, k = 1..8.

SmolLM2-135M's shape, random weights, bfloat16, CUDA graphs (decode, verify, draft steps),
the Triton rejection sampler. The draft is a 1-layer self-draft, so almost all of a
round's cost is the target's verify; forced acceptance (``forced_acceptance`` in the
speculative config) fixes how many drafts each round keeps, which random weights could
not. Same run, same engine settings, for each batch size:

- ms per emitted token with speculation, against plain decoding (``off``);
- the verify forward alone (a replay of its CUDA graph) against a decode step's graph:
  what ``k + 1`` query tokens per sequence cost compared with one.

    python -m bench.gpu_spec [--batches 1 16] [--out bench/results/gpu_spec.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import cuda_time, hf_llama, ours_from_hf, table
from bench.gpu_engine import decode
from libs.engine import EngineConfig, LLM

TOKENS = 256


def engine(loaded, spec: dict | None) -> LLM:
    return LLM(
        EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, num_blocks=8192, max_model_len=4096,
                     speculative_config=json.dumps(spec) if spec else None),
        loaded=loaded,
    )


def ms_per_token(eng: LLM, batch: int) -> float:
    """Per sequence: wall ms per emitted token in steady-state decode."""
    return batch * 1e3 / decode(eng, batch, TOKENS)["tokens_per_s"]


def graph_replay_ms(graphs, batch: int) -> float:
    bs = next(s for s in graphs.sizes if s >= batch)
    return cuda_time(graphs.graphs[bs].replay, reps=50, warmup=5) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = ours_from_hf(hf_llama(torch.device("cuda"), torch.bfloat16), torch.device("cuda"), torch.bfloat16)
    results: dict = {"device": torch.cuda.get_device_name(), "batches": args.batches, "rows": []}
    off = engine(loaded, None)
    ms_per_token(off, 1)  # warm-up
    for b in args.batches:
        off_ms = ms_per_token(off, b)
        decode_ms = graph_replay_ms(off.runner.graphs, b)
        for k in args.ks:
            for r in args.rates:
                eng = engine(loaded, {"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": k,
                                      "forced_acceptance": r, "min_acceptance_length": 0})
                ms = ms_per_token(eng, b)
                verify_ms = graph_replay_ms(eng.runner.verify_graphs, b)
                m = eng.spec.metrics
                results["rows"].append({
                    "batch": b, "k": k, "rate": r, "ms_per_token": ms, "off_ms_per_token": off_ms,
                    "speedup": off_ms / ms, "verify_ms": verify_ms, "decode_ms": decode_ms,
                    "verify_over_decode": verify_ms / decode_ms, "mean_acceptance_length": m.mean_acceptance_length,
                    "verify_graph_replays": eng.runner.verify_graphs.replays,
                })
                eng.close()
    off.close()
    print(table(
        ["batch", "k", "forced rate", "ms/token", "off ms/token", "speedup", "verify ms", "decode ms", "verify / decode"],
        [[r["batch"], r["k"], r["rate"], f"{r['ms_per_token']:.3f}", f"{r['off_ms_per_token']:.3f}", f"{r['speedup']:.2f}x",
          f"{r['verify_ms']:.3f}", f"{r['decode_ms']:.3f}", f"{r['verify_over_decode']:.2f}"] for r in results["rows"]],
    ))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
