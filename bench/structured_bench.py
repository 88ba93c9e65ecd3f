"""Structured outputs' cost on the CPU: a JSON-schema workload on the real model, tokens/s
with the grammar against the same requests without it, in the same run.

Both sides do the same work but for the constraint: the same prompts, batch, seeds and
temperature, and the same number of tokens per request. A constrained request ends when
its JSON is complete (or at ``max_tokens``), so its lengths are taken from the
constrained side (seeded: the same every run) and the free side generates exactly as many
(``max_tokens`` = that length, ``ignore_eos``). Without that the free side would keep all
its rows to ``max_tokens`` while the constrained batch shrinks, and the ratio would count
smaller late batches as grammar cost. Throughput is generated tokens over wall time
(prefill included, as a client sees it). The constrained side pays for the per-step
bitmask (filled on a host thread while the forward runs), its application before
sampling and the matchers' token accepts. Both sides are warmed up first; they then
alternate (which goes first alternates too) for ``--reps`` rounds. Reported: the median of
each round's paired ratio (its two runs are back to back, so a shared machine's load
drifts less within a pair than across the run), and the ratio of the medians. ``OMP_WAIT_POLICY=PASSIVE`` is set unless given.

    python -m bench.structured_bench [--batch 8] [--max-tokens 48] [--reps 3] [--threads 1] [--json out.json]
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

    lengths: list[int] = []

    def run(grammar) -> tuple[float, int, int, list[int]]:
        if grammar is not None:
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens) for i in range(args.batch)]
        else:  # exactly the constrained side's lengths
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
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
        counts = [len(r.token_ids) for r in results]
        return sum(counts) / dt, sum(counts), valid, counts

    def timed(label: str, grammar) -> tuple[float, int, int, list[int]]:
        r = run(grammar)
        print(f"  {label}: {r[0]:.1f} tok/s ({r[1]} tokens, {r[2]} valid JSON)", flush=True)
        return r

    lengths = timed("warm-up json_schema", spec)[3]
    timed("warm-up unconstrained", None)
    free, constrained = [], []
    for i in range(args.reps):
        sides = [("unconstrained", None, free), ("json_schema", spec, constrained)]
        for name, grammar, into in sides if i % 2 == 0 else sides[::-1]:
            into.append(timed(f"rep {i} {name}", grammar))
        assert constrained[-1][3] == lengths and free[-1][3] == lengths, "the two sides' lengths differ"
    f = statistics.median(x[0] for x in free)
    c = statistics.median(x[0] for x in constrained)
    paired = [cs[0] / fs[0] for fs, cs in zip(free, constrained)]
    out = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "lengths": lengths,
        "reps": args.reps,
        "threads": args.threads,
        "unconstrained_tok_s": f,
        "json_schema_tok_s": c,
        "ratio_of_medians": c / f,
        "paired_ratios": paired,
        "ratio": statistics.median(paired),
        "unconstrained_runs": [x[:3] for x in free],
        "json_schema_runs": [x[:3] for x in constrained],
        "mask_rows_filled": eng.bitmasks.rows_filled,
        "mask_steps": eng.bitmasks.steps,
    }
    print(f"unconstrained {f:.1f} tok/s, json_schema {c:.1f} tok/s (medians; ratio {c / f:.3f}); "
          f"paired ratios {[round(r, 3) for r in paired]}, median {statistics.median(paired):.3f} "
          f"(valid JSON: {[x[2] for x in constrained]} of {args.batch}; free-form parsing JSON: {[x[2] for x in free]})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
