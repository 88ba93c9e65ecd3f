"""Structured outputs' cost on the CPU: a JSON-schema workload on the real model, tokens/s
with the grammar against the same requests without it, in the same run.

Both sides run the same prompts, batch and sampling with ``ignore_eos`` off and a fixed
``max_tokens``; throughput is generated tokens over wall time (prefill included, as a
client sees it). The constrained side pays for the per-step bitmask (filled on a host
thread while the forward runs), its application before sampling and the matchers' token
accepts. Sides alternate for ``--reps`` rounds; the ratio of medians is reported.

    python -m bench.structured_bench [--batch 8] [--max-tokens 48] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: a shared box's spinning threads collapse
import torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write raw figures here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from libs.engine import LLM, EngineConfig, SamplingParams
    from libs.structured import GrammarSpec

    eng = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=1024, max_num_seqs=max(16, args.batch), enable_prefix_caching=False))
    spec = GrammarSpec.json_schema(SCHEMA)
    eng.grammars.compile(spec)  # compile once, outside the timing (cached, as in serving)
    convs = [[{"role": "user", "content": f"Invent user number {i} as JSON with name, age, email, tags and active."}] for i in range(args.batch)]

    def run(grammar) -> tuple[float, int, int]:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens) for i in range(args.batch)]
        t = time.perf_counter()
        results = eng.generate(messages=convs, params=params, grammar=grammar)
        dt = time.perf_counter() - t
        valid = 0
        for r in results:
            try:
                json.loads(r.text)
                valid += 1
            except json.JSONDecodeError:
                pass
        return sum(len(r.token_ids) for r in results) / dt, sum(len(r.token_ids) for r in results), valid

    def timed(label: str, grammar) -> tuple[float, int, int]:
        r = run(grammar)
        print(f"  {label}: {r[0]:.1f} tok/s ({r[1]} tokens, {r[2]} valid JSON)", flush=True)
        return r

    timed("warm-up", None)
    free, constrained = [], []
    for i in range(args.reps):
        free.append(timed(f"rep {i} unconstrained", None))
        constrained.append(timed(f"rep {i} json_schema", spec))
    f = statistics.median(x[0] for x in free)
    c = statistics.median(x[0] for x in constrained)
    out = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "threads": args.threads,
        "unconstrained_tok_s": f,
        "json_schema_tok_s": c,
        "ratio": c / f,
        "unconstrained_runs": free,
        "json_schema_runs": constrained,
        "mask_rows_filled": eng.bitmasks.rows_filled,
        "mask_steps": eng.bitmasks.steps,
    }
    print(f"unconstrained {f:.1f} tok/s, json_schema {c:.1f} tok/s, ratio {c / f:.3f} "
          f"(valid JSON: {[x[2] for x in constrained]} of {args.batch}; free-form parsing JSON: {[x[2] for x in free]})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
