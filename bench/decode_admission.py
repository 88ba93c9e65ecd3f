"""Decode's admission of a handed-off prompt: from the engine getting the request to its
first token back on the event loop, and where that time goes.

On the H100 the PD timeline (bench/gpu_pd.py) shows ~5-6 ms from decode handing a loaded
2048-token prompt to its engine to the first token leaving decode, against ~1 ms for the
47 MB import and ~0.7 ms for a decode step. This runs that part alone, in one process,
the way the decode service drives it: an ``AsyncEngine`` (the engine on its worker thread)
on a uvloop event loop, the prompt's KV in the engine's own pinned staging buffers
(``KVImport``, as decode's loads leave it), ``output_prefix`` = prefill's first token,
greedy, two tokens. Each request is a fresh prompt; its timeline, medians over requests:

- ``engine thread admits``: the worker thread drains the request from its inbox;
- ``first step launched``: the step that imports the KV and decodes the first token was
  handed to the device (the engine's own phase stamps: ``HostPhases.history``);
- ``ids on host``: the step's sampled id read back (the engine's ``ttft_s``);
- ``posted``: the worker thread handed the output to the loop (``call_soon_threadsafe``);
- ``on the loop``: the ``RequestStream`` consumer has it (what decode then sends).

Rows: ``import`` (decode's case), ``local hit`` (the same prompt again: its blocks are in
the engine's prefix cache, no import: the admission and step alone), and ``import, sync``
(async scheduling off: whether reading a step's ids one step late costs the first token).
``--profile`` adds the torch profiler's table of one ``import`` request (host ops and
kernels, by total time); ``--sync-debug`` prints the stack of every call that waits for the
device during one (``torch.cuda.set_sync_debug_mode``).

    python -m bench.decode_admission [--requests 12] [--prompt-len 2048] [--profile] [--sync-debug] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
import uvloop

from bench.common import random_loaded
from libs.engine import EngineConfig, LLMEngine, SamplingParams
from libs.engine.async_engine import AsyncEngine
from libs.engine.sequence import KVImport

WARMUP = 3


class StampedEngine(AsyncEngine):
    """An ``AsyncEngine`` that notes when its worker admits a request and posts outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.admitted: dict[str, float] = {}
        self.posted: list[float] = []

    def _drain_inbox(self) -> None:
        pending = self._inbox.qsize()
        super()._drain_inbox()
        if pending:
            now = time.perf_counter()
            for rid in self._streams:
                self.admitted.setdefault(rid, now)

    def _post(self, fn, *args) -> None:  # noqa: ANN001 - AsyncEngine's signature
        self.posted.append(time.perf_counter())
        super()._post(fn, *args)


def build(args: argparse.Namespace, *, async_scheduling: bool) -> LLMEngine:
    loaded = random_loaded("smollm2-135m", torch.device(args.device), torch.bfloat16)
    cfg = EngineConfig(device=args.device, dtype="bfloat16", max_model_len=4096, num_blocks=2048,
                       async_scheduling="on" if async_scheduling else "off")
    eng = LLMEngine(cfg, loaded=loaded)
    eng.phases.history = []
    return eng


def staged(eng: LLMEngine, prompt_len: int) -> KVImport:
    """The prompt's blocks in the engine's pinned staging, as decode's loads leave them."""
    per = eng.config.swap_max_blocks
    blocks = -(-prompt_len // eng.config.block_size)
    buffers = []
    while blocks:
        buffers.append(eng.swapper.acquire(min(per, blocks)))
        blocks -= buffers[-1].n
    for b in buffers:
        b.host.zero_()  # the values do not change the timing; zeros keep the logits finite
    return KVImport(buffers, first_block=0, num_tokens=prompt_len)


async def one(ae: StampedEngine, rid: str, prompt: list[int], first: int, kv: KVImport | None, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    history = ae.engine.phases.history
    steps0 = len(history)
    t0 = time.perf_counter()
    stream = ae.add_request(rid, prompt, params, output_prefix=[first], kv_import=kv)
    on_loop = None
    ttft = None
    async for out in stream:
        if on_loop is None and any(c.new_token_ids for c in out.outputs):
            on_loop = time.perf_counter()
        if out.finished:
            ttft = out.metrics.get("ttft_s")
    posted = next(p for p in ae.posted if p >= t0)
    admitted = ae.admitted.pop(rid)
    first_step = history[steps0] if len(history) > steps0 else {}
    second_step = history[steps0 + 1] if len(history) > steps0 + 1 else {}
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    return {
        "engine thread admits": ms(admitted),
        "first step launched": ms(admitted) + 1e3 * sum(first_step.get(k, 0.0) for k in ("schedule", "prepare", "launch")),
        "ids on host": ms(admitted) + 1e3 * (ttft or float("nan")),
        "posted": ms(posted),
        "on the loop": ms(on_loop),
        "first step phases us": {k: round(v * 1e6, 1) for k, v in first_step.items()},
        "second step phases us": {k: round(v * 1e6, 1) for k, v in second_step.items()},
        "steps": len(history) - steps0,
    }


async def run_rows(eng: LLMEngine, args: argparse.Namespace, label: str, *, local: bool) -> list[dict]:
    ae = StampedEngine(eng)
    ae.start()
    g = torch.Generator().manual_seed(len(label))
    rows = []
    try:
        for i in range(WARMUP + args.requests):
            prompt = torch.randint(100, eng.vocab_size, (args.prompt_len,), generator=g).tolist()
            if local:  # compute it once: the second time its blocks are a local prefix hit
                await one(ae, f"{label}-{i}-warm", prompt, 7, None, args.max_tokens)
                kv = None
            else:
                kv = staged(eng, args.prompt_len)
            ae.posted.clear()
            row = await one(ae, f"{label}-{i}", prompt, 7, kv, args.max_tokens)
            if i >= WARMUP:
                rows.append(row)
        if args.profile and not local and label == "import":
            from torch.profiler import ProfilerActivity, profile

            prompt = torch.randint(100, eng.vocab_size, (args.prompt_len,), generator=g).tolist()
            kv = staged(eng, args.prompt_len)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                await one(ae, f"{label}-profiled", prompt, 7, kv, args.max_tokens)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        if args.sync_debug and not local and label == "import":
            # Every call that waits for the device, with the stack that made it (the engine
            # thread's steps of one request; steady decode steps make none).
            import traceback
            import warnings

            def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
                print(f"SYNC: {message}", "".join(traceback.format_stack(limit=14)[:-2]), sep="\n", flush=True)

            warnings.showwarning = show
            warnings.simplefilter("always")
            prompt = torch.randint(100, eng.vocab_size, (args.prompt_len,), generator=g).tolist()
            kv = staged(eng, args.prompt_len)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                await one(ae, f"{label}-sync-debug", prompt, 7, kv, args.max_tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        await ae.stop()
    return rows


MARKS = ("engine thread admits", "first step launched", "ids on host", "posted", "on the loop")


def report(label: str, rows: list[dict]) -> str:
    med = {k: statistics.median(r[k] for r in rows) for k in MARKS}
    marks = ", ".join(f"{k} {v:.2f}" for k, v in med.items())
    steps = "; ".join(f"{which} step's host phases (us): " + ", ".join(
        f"{k} {statistics.median(r[f'{which} step phases us'].get(k, 0.0) for r in rows):.0f}" for k in rows[0][f"{which} step phases us"])
        for which in ("first", "second"))
    return f"{label}: ms since add_request (medians of {len(rows)}): {marks}; {steps}; steps per request {rows[0]['steps']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sync-debug", action="store_true", help="print the stack of every device sync of one import request")
    p.add_argument("--max-tokens", type=int, default=2, help="counting prefill's first token (gpu_pd asks 3)")
    p.add_argument("--out")
    args = p.parse_args()
    out: dict[str, list[dict]] = {}
    for label, async_on, local in (("import", True, False), ("local hit", True, True), ("import, sync", False, False)):
        eng = build(args, async_scheduling=async_on)
        try:
            out[label] = uvloop.run(run_rows(eng, args, label, local=local))
        finally:
            eng.close()
        print(report(label, out[label]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
