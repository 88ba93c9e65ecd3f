"""GPU: Tidepool's engine vs Hugging Face transformers, and vs the weights-read floor.

All in one run, bf16, random weights (speed does not depend on the values):

- SmolLM2-135M's shape, against transformers' ``generate`` on the same weights: decode at
  batch 1 (ms/step) and 64 (tokens/s) with 128-token prompts, prefill of 16 x 1024-token
  prompts (tokens/s; one batch alone, and 8 batches arriving a step apart, where async
  scheduling overlaps a batch's host work with the batch before it on the GPU), each with async
  scheduling off and on, with prefill CUDA graphs off and on, and without any graphs; the
  GPU idle fraction between decode steps; the host time of a decode step per phase
  (schedule, prepare, launch, sample, output).
- Llama-3.2-1B's and Qwen2.5-7B's shapes (head_dim 64 and 128, 128k and 152k
  vocabularies): decode at batch 1 against the weights-read floor, the time to read
  every weight once, measured in the same run as a device-to-device copy of that many
  bytes (a copy reads and writes each byte: the floor is half the copy's time).

``--quick`` (about a third of the time): fewer decode steps, one prefill repetition, and
only the async and sync configurations (no eager or no-prefill-graph comparison).

``--fusions`` instead measures issue 10's two decode-step fusions in one process, async
scheduling on, at batch 1, 2, 4 and 64 for each shape: without either, with decode attention
taking rotary and the KV store (``rotary_decode_attention``), with the Triton skinny GEMM
(up to the M that kernels/gemv/threshold.json holds for this GPU, or ``--skinny-max-m``),
and with both; each variant's greedy tokens are compared with the unfused engine's.

``--prefill-sweep`` adds prefill tokens/s at step sizes of 512 to 16384 tokens with prefill
graphs and without: where graphs pay, for ``EngineConfig.prefill_graph_max_tokens``.

    python -m bench.gpu_engine [--shapes smollm2-135m,llama-3.2-1b,qwen2.5-7b] [--quick] [--prefill-sweep] [--out results.json]
    python -m bench.gpu_engine --fusions [--skinny-max-m N] [--shapes ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from bench.common import SHAPES, cuda_time, hf_llama, ours_from_hf, random_loaded, synchronize, table, write_json
from libs.engine import EngineConfig, LLM, SamplingParams
from libs.engine.step_timer import PHASES

PROMPT = 128
DECODE_STEPS = 256
QUICK = False  # --quick: shorter runs, fewer configurations


def engine(loaded, **kw) -> LLM:
    # Prefill graphs cover the whole step budget, as the engine's defaults do
    # (EngineConfig.prefill_graph_max_tokens, capped by max_num_batched_tokens).
    cfg = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, num_blocks=4096, max_num_batched_tokens=16384, max_model_len=4096)
    cfg.update(kw)
    return LLM(EngineConfig(**cfg), loaded=loaded)


def decode(eng: LLM, batch: int, steps: int = DECODE_STEPS) -> dict:
    """Steady-state decode of ``batch`` sequences; prefill is excluded from the timing."""
    if batch > eng.config.max_num_seqs:  # they would never all be decoding at once: the wait below would not end
        raise ValueError(f"decode batch {batch} exceeds the engine's max_num_seqs ({eng.config.max_num_seqs})")
    g = torch.Generator().manual_seed(batch)
    vocab = eng.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (PROMPT,), generator=g).tolist()
        eng.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while eng.num_waiting or len(eng.scheduler.decoding) < batch:
        eng.step()
    for _ in range(2):
        eng.step()
    synchronize(eng.device)
    eng.timer.reset()
    tokens0 = eng.num_generated_tokens
    eng.phases.history = []
    t, n = time.perf_counter(), 0
    for _ in range(steps):
        eng.step()
        n += 1
    dt = time.perf_counter() - t
    history, eng.phases.history = eng.phases.history, None
    while eng.has_unfinished_requests():
        eng.step()
    return {
        "ms_per_step": dt / n * 1e3,
        "tokens_per_s": (eng.num_generated_tokens - tokens0) / dt,  # several per step when speculating
        "gpu_idle_fraction": eng.timer.idle_fraction,
        "host_us": {k: statistics.median(h[k] for h in history) * 1e6 for k in (*PHASES, "forward", "step")},
        "steps": n,
    }


def random_prompts(eng: LLM, lengths: list[int], g: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, eng.vocab_size, (n,), generator=g).tolist() for n in lengths]


def admit(eng: LLM, prompts: list[list[int]], tag: str = "p") -> None:
    """Queue ``prompts`` for a prefill: one greedy token each to generate."""
    for i, ids in enumerate(prompts):
        eng.add_request(f"{tag}{i}-{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=1))


def prefill_batch(eng: LLM, prompts: list[list[int]]) -> float:
    """Admit ``prompts`` (one token each to generate) and step until they are done: a
    prefill as the benchmarks time it. Returns the seconds admission took."""
    t = time.perf_counter()
    admit(eng, prompts)
    admitted = time.perf_counter() - t
    while eng.has_unfinished_requests():
        eng.step()
    return admitted


def prompt_sets(eng: LLM, lengths: list[int], count: int, seed: int) -> Callable[[], list[list[int]]]:
    """``count`` sets of random prompts made up front, handed out one per call: making them
    (~0.5 ms for 16 x 1024 ids) is the benchmark's work, not the engine's, and transformers'
    inputs are made outside its timing too."""
    g = torch.Generator().manual_seed(seed)
    sets = [random_prompts(eng, lengths, g) for _ in range(count)]
    return lambda: sets.pop()


def prefill(eng: LLM, batch: int = 16, length: int = 1024) -> float:
    reps, warmup = (1 if QUICK else 3), 1
    prompts = prompt_sets(eng, [length] * batch, reps + warmup, seed=7)
    run = lambda: prefill_batch(eng, prompts())  # noqa: E731
    return batch * length / cuda_time(run, reps=reps, warmup=warmup, device=eng.device)


def prefill_sustained(eng: LLM, batch: int = 16, length: int = 1024, batches: int = 8) -> dict:
    """Prefill tokens/s under sustained load: ``batches`` batches of ``batch x length``
    prompts (one token each to generate), each admitted right after the step before it
    was launched, as a server's engine thread takes new arrivals between steps. The step
    budget (16384 tokens) takes one batch a step. With async scheduling the host work of
    a batch (admission, schedule, layout, launch) then runs while the batch before it is on
    the GPU; ``prefill`` times one batch alone, whose host work nothing can hide. Also the
    GPU's idle share between steps."""
    runs = 2 if QUICK else 3  # the first is a warm-up
    sets = prompt_sets(eng, [length] * (batch * batches), runs, seed=11)
    reps = []
    for rep in range(runs):
        prompts = sets()
        synchronize(eng.device)
        eng.timer.reset()
        t = time.perf_counter()
        for k in range(batches):
            admit(eng, prompts[k * batch : (k + 1) * batch], tag=f"s{k}-")
            eng.step()
        while eng.has_unfinished_requests():
            eng.step()
        synchronize(eng.device)
        if rep:
            reps.append((batch * batches * length / (time.perf_counter() - t), eng.timer.idle_fraction))
    idle = [i for _, i in reps if i is not None]
    return {"tokens_per_s": statistics.median(r for r, _ in reps), "gpu_idle_fraction": statistics.median(idle) if idle else None, "batches": batches}


SWEEP_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)


def prefill_sweep(res: dict) -> None:
    """Prefill tokens/s with prefill graphs up to 16384 tokens and without any, at each
    step size of ``SWEEP_TOKENS`` (one prompt up to 1024 tokens, then 1024-token prompts):
    where graphs pay (EngineConfig.prefill_graph_max_tokens)."""
    dev = torch.device("cuda")
    loaded = random_loaded("smollm2-135m", dev, torch.bfloat16)
    out: dict = {}
    for name, max_tokens in (("graphs", 16384), ("eager", 0)):
        eng = engine(loaded, async_scheduling="on", prefill_graph_max_tokens=max_tokens)
        decode(eng, 2, steps=8)
        for tokens in SWEEP_TOKENS:
            lengths = [tokens] if tokens <= 1024 else [1024] * (tokens // 1024)
            prompts = prompt_sets(eng, lengths, 5 + 2, seed=tokens)
            run = lambda prompts=prompts: prefill_batch(eng, prompts())  # noqa: E731
            out.setdefault(str(tokens), {})[name] = tokens / cuda_time(run, reps=5, warmup=2, device=eng.device)
        eng.close()
    res["prefill_sweep"] = out
    rows = [[t, f"{r['graphs']:,.0f}", f"{r['eager']:,.0f}", f"{r['graphs'] / r['eager']:.2f}x"] for t, r in out.items()]
    print(f"\n{res['device']}: prefill tokens/s by step size, SmolLM2 shape (prompts of <= 1024 tokens)\n")
    print(table(["tokens in the step", "prefill graphs", "eager", "graphs / eager"], rows))
    del loaded
    torch.cuda.empty_cache()


def hf_decode(hf, batch: int, steps: int = 64) -> dict:
    ids = torch.randint(0, 49152, (batch, PROMPT), device="cuda")
    attn = torch.ones_like(ids)
    gen = lambda n: hf.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)  # noqa: E731
    t1 = cuda_time(lambda: gen(1), reps=2)
    tn = cuda_time(lambda: gen(steps + 1), reps=2)
    step = (tn - t1) / steps
    return {"ms_per_step": step * 1e3, "tokens_per_s": batch / step}


def hf_prefill(hf, batch: int = 16, length: int = 1024, *, last_logits: bool = False) -> float:
    """transformers' forward over ``batch`` prompts of ``length`` tokens, tokens/s.

    By default the forward computes every position's logits (``[16, 1024, 49152]``, as a
    bare ``model(input_ids)`` does), which our engine never does: it computes the logits
    of the rows it samples. ``last_logits`` asks transformers for the last position's only
    (``logits_to_keep=1``, what its ``generate`` passes on the prefill): the like-for-like
    figure, reported beside the first (bench/RESULTS.md, issue 10)."""
    device = hf.device
    ids = torch.randint(0, hf.config.vocab_size, (batch, length), device=device)
    kw = {"logits_to_keep": 1} if last_logits else {}
    with torch.inference_mode():
        return batch * length / cuda_time(lambda: hf(input_ids=ids, use_cache=False, **kw), reps=3, device=device)


def weights_read_floor_ms(model: torch.nn.Module) -> tuple[float, float]:
    """(ms to read every weight once, copy bandwidth GB/s), from a D2D copy of as many bytes."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps=10, warmup=2)
    del src, dst
    return t / 2 * 1e3, 2 * nbytes / t / 1e9


def smollm2(res: dict) -> None:
    dev = torch.device("cuda")
    hf = hf_llama(dev, torch.bfloat16)
    loaded = ours_from_hf(hf, dev, torch.bfloat16)
    configs = {
        "async": dict(async_scheduling="on"),
        "sync": dict(async_scheduling="off"),
        "async_no_prefill_graphs": dict(async_scheduling="on", prefill_graph_max_tokens=0),
        "eager": dict(async_scheduling="on", cuda_graphs=False),
    }
    if QUICK:
        configs = {k: configs[k] for k in ("async", "sync")}
    for name, kw in configs.items():
        eng = engine(loaded, **kw)
        decode(eng, 2, steps=16)  # warm-up
        steps = (DECODE_STEPS if name != "eager" else 64) // (4 if QUICK else 1)
        res[f"ours_{name}"] = {"b1": decode(eng, 1, steps), "b64": decode(eng, 64, steps)}
        if name != "sync":
            res[f"ours_{name}"]["prefill_tok_s"] = prefill(eng)
        if name in ("async", "sync"):
            res[f"ours_{name}"]["prefill_sustained"] = prefill_sustained(eng)
        eng.close()
    res["floor_smollm2_ms"], res["copy_gb_s"] = weights_read_floor_ms(loaded.model)
    del loaded
    res["hf_b1"] = hf_decode(hf, 1, 32 if QUICK else 64)
    res["hf_b64"] = hf_decode(hf, 64, 32 if QUICK else 64)
    res["hf_prefill_tok_s"] = hf_prefill(hf)
    res["hf_prefill_last_logits_tok_s"] = hf_prefill(hf, last_logits=True)
    del hf


def bigger(res: dict, shape: str) -> None:
    dev = torch.device("cuda")
    loaded = random_loaded(shape, dev, torch.bfloat16)
    floor, bw = weights_read_floor_ms(loaded.model)
    out = {"floor_ms": floor, "copy_gb_s": bw}
    for mode in ("on", "off"):
        eng = engine(loaded, async_scheduling=mode, num_blocks=2048, prefill_graph_max_tokens=2048)
        decode(eng, 2, steps=8)
        out[f"b1_async_{mode}"] = decode(eng, 1, 32 if QUICK else 128)
        eng.close()
    res[shape] = out
    del loaded
    torch.cuda.empty_cache()


FUSIONS = {"unfused": (False, False), "fused_decode": (True, False), "skinny": (False, True), "both": (True, True)}


def fusions(res: dict, shape: str, skinny_max_m: int | None) -> None:
    """Decode b1 and b64 under each of ``FUSIONS`` (fused decode attention, skinny GEMM) on
    one set of random weights; the attention backend is swapped on the built model and
    the skinny GEMM's dispatch set through its environment override, as the GPU test does."""
    from kernels.gemv import threshold
    from libs.model.attention import triton_backend

    dev = torch.device("cuda")
    loaded = random_loaded(shape, dev, torch.bfloat16)
    # None: threshold.json decides (the device's limit and each measured shape's own)
    wanted = "threshold.json" if skinny_max_m is None else skinny_max_m
    out: dict = {"skinny_max_m": wanted, "floor_ms": weights_read_floor_ms(loaded.model)[0]}
    g = torch.Generator().manual_seed(3)
    check_prompts = [torch.randint(0, loaded.config.vocab_size, (48,), generator=g).tolist() for _ in range(4)]
    saved = os.environ.get(threshold.ENV)
    try:
        for name, (fused_decode, skinny) in FUSIONS.items():
            if skinny and skinny_max_m is None:
                os.environ.pop(threshold.ENV, None)
            else:
                os.environ[threshold.ENV] = str(skinny_max_m if skinny else 0)
            backend = triton_backend(fused_decode=fused_decode)
            for layer in loaded.model.layers:
                layer.self_attn.backend = backend
            eng = engine(loaded, async_scheduling="on", num_blocks=2048, prefill_graph_max_tokens=2048)
            greedy = eng.generate(check_prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            decode(eng, 2, steps=8)
            steps = 64 if QUICK else 192
            out[name] = {"b1": decode(eng, 1, steps), "b2": decode(eng, 2, steps // 2), "b4": decode(eng, 4, steps // 2),
                         "b64": decode(eng, 64, steps // 2), "tokens": [r.token_ids for r in greedy]}
            eng.close()
            base = out["unfused"]["tokens"]
            out[name]["greedy_equal_rows"] = sum(a == b for a, b in zip(base, out[name]["tokens"]))
            print(f"{shape} {name}: b1 {out[name]['b1']['ms_per_step']:.3f} ms, b64 {out[name]['b64']['tokens_per_s']:,.0f} tok/s, "
                  f"greedy rows equal to unfused {out[name]['greedy_equal_rows']}/{len(base)}", flush=True)
    finally:
        if saved is None:
            os.environ.pop(threshold.ENV, None)
        else:
            os.environ[threshold.ENV] = saved
    res.setdefault("fusions", {})[shape] = out
    del loaded
    torch.cuda.empty_cache()


def report_fusions(res: dict) -> None:
    rows = []
    for shape, out in res.get("fusions", {}).items():
        base = out["unfused"]
        for name in FUSIONS:
            r = out[name]
            rows.append([shape, name, f"{r['b1']['ms_per_step']:.3f}", f"{base['b1']['ms_per_step'] / r['b1']['ms_per_step']:.2f}x",
                         f"{r['b1']['ms_per_step'] / out['floor_ms']:.2f}x",
                         *(f"{r[b]['ms_per_step']:.3f} ({base[b]['ms_per_step'] / r[b]['ms_per_step']:.2f}x)" for b in ("b2", "b4")),
                         f"{r['b64']['tokens_per_s']:,.0f}",
                         f"{r['b64']['tokens_per_s'] / base['b64']['tokens_per_s']:.2f}x", f"{r['greedy_equal_rows']}/{len(r['tokens'])}"])
    if rows:
        print(f"\n{res['device']}: decode-step fusions (async on; skinny GEMM up to M = "
              f"{', '.join(str(o['skinny_max_m']) for o in res['fusions'].values())})\n")
        print(table(["shape", "variant", "b1 ms/step", "b1 vs unfused", "b1 / floor", "b2 ms/step (vs unfused)", "b4 ms/step (vs unfused)",
                     "b64 tokens/s", "b64 vs unfused",
                     "greedy rows = unfused"], rows))


def report(res: dict) -> None:
    f = lambda x, d=2: f"{x:,.{d}f}"  # noqa: E731
    if "ours_async" in res:
        a, s, hf = res["ours_async"], res["ours_sync"], res
        pdl = {True: "PDL on", False: "PDL off"}.get(res.get("pdl"), "PDL not recorded")
        print(f"\n{res['device']}, torch {res['torch']}, bf16, {pdl}, SmolLM2-135M shape (random weights)\n")
        rows = [
            ["decode b1, ms/step", f(a["b1"]["ms_per_step"], 3), f(hf["hf_b1"]["ms_per_step"]), f(hf["hf_b1"]["ms_per_step"] / a["b1"]["ms_per_step"], 1) + "x", "<= 0.9"],
            ["decode b64, tokens/s", f(a["b64"]["tokens_per_s"], 0), f(hf["hf_b64"]["tokens_per_s"], 0), f(a["b64"]["tokens_per_s"] / hf["hf_b64"]["tokens_per_s"], 1) + "x", ">= 45,000"],
            ["prefill 16x1024, tokens/s", f(a["prefill_tok_s"], 0), f(hf["hf_prefill_tok_s"], 0), f(a["prefill_tok_s"] / hf["hf_prefill_tok_s"], 1) + "x", ">= 3x HF"],
            ["weights-read floor (D2D copy), ms", f(res["floor_smollm2_ms"], 4), "", "", ""],
        ]
        if "hf_prefill_last_logits_tok_s" in hf:  # the like-for-like peer: last-position logits only
            last = hf["hf_prefill_last_logits_tok_s"]
            rows.insert(3, ["prefill 16x1024 vs HF with logits_to_keep=1", f(a["prefill_tok_s"], 0), f(last, 0), f(a["prefill_tok_s"] / last, 1) + "x", ""])
        if "prefill_sustained" in a:
            for name, key in (("async", "ours_async"), ("sync", "ours_sync")):
                r = res[key]["prefill_sustained"]
                idle = "" if r["gpu_idle_fraction"] is None else f", GPU idle {100 * r['gpu_idle_fraction']:.1f}%"
                rows.insert(3, [f"prefill, {r['batches']} x 16x1024 arriving a step apart ({name}{idle})", f(r["tokens_per_s"], 0), f(hf["hf_prefill_tok_s"], 0),
                                f(r["tokens_per_s"] / hf["hf_prefill_tok_s"], 1) + "x", ""])
        if "ours_async_no_prefill_graphs" in res:
            rows.insert(3, ["prefill 16x1024 without prefill graphs", f(res["ours_async_no_prefill_graphs"]["prefill_tok_s"], 0), "", "", ""])
        print(table(["measure", "ours (async)", "HF transformers", "ratio", "goal"], rows))
        idle = lambda r: "n/a" if r["gpu_idle_fraction"] is None else f"{100 * r['gpu_idle_fraction']:.1f}%"  # noqa: E731
        rows = []
        for name, key in (("async", "ours_async"), ("sync", "ours_sync"), ("async, eager", "ours_eager")):
            if key not in res:
                continue
            for b in ("b1", "b64"):
                r = res[key][b]
                rows.append([f"{b}, {name}", f(r["ms_per_step"], 3), f(r["tokens_per_s"], 0), idle(r)])
        rows.append(["async / sync, b1 (>= 1.0)", f(s["b1"]["ms_per_step"] / a["b1"]["ms_per_step"]) + "x", "", ""])
        rows.append(["async / sync, b64 (>= 1.0)", f(s["b64"]["ms_per_step"] / a["b64"]["ms_per_step"]) + "x", "", ""])
        print()
        print(table(["decode", "ms/step", "tokens/s", "GPU idle between steps (goal <= 10%)"], rows))
        rows = [[f"{b}, {name}", *(f(res[key][b]["host_us"][p], 0) for p in (*PHASES, "step"))] for name, key in (("async", "ours_async"), ("sync", "ours_sync")) for b in ("b1", "b64")]
        print("\nhost time of a decode step per phase, median us (before this change: not measured on a GPU)\n")
        print(table(["decode", *PHASES, "step"], rows))
    rows = []
    for shape in SHAPES:
        if shape in res and shape != "smollm2-135m":
            r = res[shape]
            for mode in ("on", "off"):
                ms = r[f"b1_async_{mode}"]["ms_per_step"]
                rows.append([shape, f"async {mode}", f(ms, 3), f(r["floor_ms"], 3), f(ms / r["floor_ms"], 2) + "x", f(r["copy_gb_s"], 0)])
    if rows:
        print("\ndecode batch 1 vs the weights-read floor (goal: within 1.5x)\n")
        print(table(["shape", "scheduling", "ms/step", "floor ms", "ratio", "D2D copy GB/s"], rows))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="shorter runs, only the async and sync configurations")
    ap.add_argument("--prefill-sweep", action="store_true", help="also sweep prefill step sizes with and without prefill graphs")
    ap.add_argument("--fusions", action="store_true", help="measure the decode-step fusions (issue 10) instead")
    ap.add_argument("--skinny-max-m", type=int, default=None, help="with --fusions: the skinny GEMM's M limit (default: threshold.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    global QUICK
    QUICK = args.quick
    from kernels.pdl import pdl_enabled

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "quick": QUICK, "pdl": pdl_enabled("cuda")}
    for shape in args.shapes.split(","):
        if args.fusions:
            fusions(res, shape, args.skinny_max_m)
        elif shape == "smollm2-135m":
            smollm2(res)
        else:
            bigger(res, shape)
    report(res)
    report_fusions(res)
    if args.prefill_sweep:
        prefill_sweep(res)
    write_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
