"""Tensor parallelism: TP=2 against TP=1 in one run, and the PD handoff across layouts.

Random weights of a named shape (bench/random_checkpoint.py writes them to disk once: a
TP engine's ranks each load their own shard), one engine at a time per measure:

- decode ms/step at the given batch sizes (default 1 and 64; 128-token prompts, steady
  state, prefill excluded; bench/gpu_engine.py's loop), TP=1 and TP=2, the latter with
  each ``--all-reduce`` (default: NCCL's, then "auto", the one-shot over symmetric memory
  for small sums, libs/dist/one_shot.py);
- prefill tokens/s of ``B x L`` prompts (default 8 x 2048), TP=1 and TP=2;
- the handoff of one ``--handoff-tokens`` prompt (default 4096): prefill with export on
  the prefill engine, the blocks encoded as pool values (the bytes a prefill writes to
  Redis, libs/kvpool/codec.py: whole blocks, whatever the layout), decoded into the
  decode engine's staging and imported, then its first decode step. TP=2 prefill -> TP=1
  decode against TP=1 -> TP=1 (and TP=1 -> TP=2). Redis itself is left out: its leg moves
  the same bytes for every layout (bench/gpu_pd.py measures it).

The issue's goal: TP=2 decode at batch 1 in at most 0.65x TP=1's time (two GPUs:
``nvidia-h200-x2``). On the CPU (gloo, ``--device cpu``) the run checks that the whole
benchmark works on a tiny shape; its ratios say nothing about GPUs.

    python -m bench.tp_bench                       # two GPUs: Qwen2.5-7B shape, bf16
    python -m bench.tp_bench --device cpu --shape tiny-qwen2 --batches 1,8 --prefill 2x256 \\
        --handoff-tokens 512 --steps 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.common import SHAPES, git_commit, synchronize, table, write_json
from bench.gpu_engine import decode, prefill
from bench.random_checkpoint import write_random_checkpoint
from libs.engine import LLM, EngineConfig, KVImport, SamplingParams
from libs.kvpool.codec import BlockCodec

# A CPU-sized Qwen2 (biases, GQA 4:1 like Qwen2.5-7B) for checking the benchmark itself.
TINY_QWEN2 = dict(
    model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
BENCH_SHAPES = {**SHAPES, "tiny-qwen2": TINY_QWEN2}
GOAL_B1 = 0.65


def config(args: argparse.Namespace, folder: Path, tp: int, **kw) -> EngineConfig:
    cuda = args.device == "cuda"
    base = dict(
        model=str(folder), device=args.device, dtype="bfloat16" if cuda else "float32", tensor_parallel_size=tp,
        max_num_seqs=max(2, *args.batches),  # 2: throughput()'s warm-up
        num_blocks=args.num_blocks, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.budget, prefill_graph_max_tokens=args.budget, num_threads=args.threads,
        tp_timeout_s=300,
    )
    return EngineConfig(**{**base, **kw})


def throughput(eng: LLM, args: argparse.Namespace) -> dict:
    decode(eng, 2, steps=4)  # warm-up (and the kernels' compilation)
    out = {f"b{b}": decode(eng, b, args.steps) for b in args.batches}
    out["prefill_tok_s"] = prefill(eng, *args.prefill)
    return out


# -- the handoff ------------------------------------------------------------------------------


def handoff(src: LLM, dst: LLM, tokens: int, seed: int) -> dict:
    """One prompt from ``src`` (prefill with export) to ``dst`` (import, then decode)."""
    ids = torch.randint(0, src.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    t0 = time.perf_counter()
    src.add_request(f"h{seed}", ids, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    first = exported = None
    while src.has_unfinished_requests():
        for out in src.step():
            if out.outputs and out.outputs[0].new_token_ids:
                first = out.outputs[0].new_token_ids[0]
            exported = out.exported_kv or exported
    t1 = time.perf_counter()
    codec = BlockCodec(src.layout)
    values = [bytes(b"".join(codec.encode_views(block, n))) for block, n in exported.blocks()]
    exported.release()
    t2 = time.perf_counter()
    dcodec, swapper, buffers = BlockCodec(dst.layout), dst.swapper, []
    for i in range(0, len(values), swapper.max_blocks):
        buf = swapper.acquire(len(values[i : i + swapper.max_blocks]))
        for row, value in zip(buf.host, values[i : i + swapper.max_blocks]):
            dcodec.decode(value, row)
        buffers.append(buf)
    dst.add_request(
        f"h{seed}", ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), output_prefix=[first],
        kv_import=KVImport(buffers, first_block=0, num_tokens=tokens),
    )
    imported = 0
    while dst.has_unfinished_requests():
        for out in dst.step():
            imported = max(imported, out.num_imported_tokens)
    synchronize(dst.device)
    t3 = time.perf_counter()
    assert imported == tokens, f"{imported} of {tokens} prompt tokens imported"
    return {"prefill_export_s": t1 - t0, "encode_s": t2 - t1, "import_decode_s": t3 - t2, "total_s": t3 - t0,
            "bytes": sum(map(len, values))}


def handoffs(pairs: dict[str, tuple[LLM, LLM]], tokens: int, reps: int) -> dict:
    """Each pair ``reps`` times, alternating (fresh prompts: no prefix cache hits); medians."""
    runs: dict[str, list[dict]] = {k: [] for k in pairs}
    for k, (src, dst) in enumerate(pairs.values()):  # warm-up
        handoff(src, dst, min(tokens, 256), seed=100_000 + k)  # (seeds no other prompt of the run uses)
    for r in range(reps):
        for k, (name, (src, dst)) in enumerate(pairs.items()):
            runs[name].append(handoff(src, dst, tokens, seed=200_000 + 10 * r + k))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {name: {key: med([x[key] for x in rs]) for key in rs[0]} for name, rs in runs.items()}


# -- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    folder = write_random_checkpoint(BENCH_SHAPES[args.shape], args.checkpoint / args.shape, device=args.device if args.device == "cuda" else "cpu")
    res: dict = {"shape": args.shape, "device": device_name(args.device), "tp": args.tp, "torch": torch.__version__, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    from libs.model import load_model, make_backend

    probe = config(args, folder, 1)
    dev, dt = probe.resolve_device(), probe.resolve_dtype(probe.resolve_device())
    loaded = load_model(str(folder), dtype=dt, device=dev, backend=make_backend(probe.attention_backend, dev))  # TP=1, shared
    tp1 = LLM(probe, loaded=loaded)
    res["tp1"] = throughput(tp1, args)
    progress("tp1", res["tp1"])
    for k, mode in enumerate(args.all_reduce):  # the last one stays up for the handoff
        tpn = LLM(config(args, folder, args.tp, tp_all_reduce=mode))
        name = f"tp{args.tp}" + ("" if k == len(args.all_reduce) - 1 else f"_{mode}")
        res[name] = {**throughput(tpn, args), "all_reduce": mode, "one_shot": tpn.tp.all_reduce == "one_shot"}
        progress(name, res[name])
        if k < len(args.all_reduce) - 1:
            tpn.close()
    # The handoff: a second TP=1 engine on the same weights decodes (no prefix cache shared).
    dec1 = LLM(probe, loaded=loaded)
    res["handoff"] = handoffs(
        {f"tp{args.tp}->tp1": (tpn, dec1), "tp1->tp1": (tp1, dec1), f"tp1->tp{args.tp}": (tp1, tpn)}, args.handoff_tokens, args.handoff_reps
    )
    for eng in (dec1, tpn, tp1):
        eng.close()
    return res


def progress(name: str, part: dict) -> None:
    """One measured part as soon as it is known: a call cut by the device's time limit still
    leaves the decode figures in its log."""
    print(f"[{name}] {json.dumps(part)}", flush=True)


def report(res: dict) -> str:
    n = res["tp"]
    one = res["tp1"]
    f = lambda x, d=2: f"{x:,.{d}f}"  # noqa: E731
    lines = [f"{res['device']}, torch {res['torch']}, {res['shape']} shape (random weights)", ""]
    for name in (k for k in res if k.startswith(f"tp{n}")):
        many = res[name]
        rows = []
        for key in (k for k in one if k.startswith("b")):
            a, b = one[key]["ms_per_step"], many[key]["ms_per_step"]
            goal = f"<= {GOAL_B1}x" if key == "b1" else ""
            rows.append([f"decode batch {key[1:]}, ms/step", f(a, 3), f(b, 3), f(b / a) + "x", goal])
        p = res["args"]["prefill"]
        a, b = one["prefill_tok_s"], many["prefill_tok_s"]
        rows.append([f"prefill {p[0]} x {p[1]}, tokens/s", f(a, 0), f(b, 0), f(b / a) + "x (throughput)", ""])
        how = "one-shot all-reduce" if many.get("one_shot") else "the backend's all-reduce"
        lines += [f"TP={n}, --tp-all-reduce {many.get('all_reduce', 'nccl')} ({how})", "",
                  table(["measure", "TP=1", f"TP={n}", f"TP={n} / TP=1", "goal"], rows), ""]
    h = res["handoff"]
    base = h["tp1->tp1"]["total_s"]
    rows = [[name, f(r["prefill_export_s"] * 1e3, 1), f(r["encode_s"] * 1e3, 1), f(r["import_decode_s"] * 1e3, 1), f(r["total_s"] * 1e3, 1),
             f(r["total_s"] / base) + "x", f(r["bytes"] / 2**20, 1)] for name, r in h.items()]
    lines += [f"handoff of a {res['args']['handoff_tokens']}-token prompt (median of {res['args']['handoff_reps']})", "",
              table(["prefill -> decode", "prefill + export ms", "encode ms", "import + 1st decode step ms", "total ms", "vs TP=1 -> TP=1", "MiB"], rows)]
    return "\n".join(lines)


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(BENCH_SHAPES), default="qwen2.5-7b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--all-reduce", type=lambda s: s.split(","), default=["nccl", "auto"],
                    help="TP engines' tp_all_reduce, each measured in turn (the last also runs the handoff)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per batch size")
    ap.add_argument("--prefill", type=lambda s: tuple(int(x) for x in s.split("x")), default=(8, 2048), help="BxL prompts")
    ap.add_argument("--handoff-tokens", type=int, default=4096)
    ap.add_argument("--handoff-reps", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads per rank")
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/tidepool-bench"), help="where the random checkpoint is written (reused)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"TP={args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    res = run(args)
    res["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    res["commit"] = git_commit()  # "unknown" on a lent GPU machine (no checkout): the caller records it
    print(report(res))
    write_json(res, args.out and str(args.out))
    return res


if __name__ == "__main__":
    main()
