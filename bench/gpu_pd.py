"""The whole PD path on one GPU machine, and where a 2048-token prompt's TTFT goes.

Redis, cache_store, router, prefill and decode run as processes (services.launch), prefill
and decode on the GPU, with random weights of SmolLM2-135M's shape saved as a Hugging Face
checkpoint (the 98 MB GGUF cannot travel to the lent GPU). Each request streams a
completion of a fresh 2048-token prompt; its trace splits the handoff into:

- prefill compute (queue + compute on the prefill instance),
- pool write (prefill → Redis, under the lease),
- pool read (decode ← Redis, checked, scattered into its cache),
- the first decode step (decode's first token after the load).

    python -m bench.gpu_pd --tokenizer DIR [--prompt-len 2048] [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path

import aiohttp
import torch

from bench.common import hf_llama, table
from bench.loadgen import sse_chunks
from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.processes import free_port


def make_checkpoint(folder: Path, tokenizer_dir: Path) -> None:
    hf = hf_llama(torch.device("cpu"), torch.bfloat16)
    hf.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True, "tidepool": {"trace": True}}
    t0 = time.perf_counter()
    first = second = None
    trace = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_chunks(r):
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter() - t0
                if first is None:
                    first = now
                elif second is None:
                    second = now
            if "tidepool" in chunk:
                trace = chunk["tidepool"]["trace"]
    p = trace["prompts"][0]
    pre, dec = p["prefill"], p["choices"][0]["attempts"][0]["worker"]
    t = pre["timings"]
    return {
        "client_ttft_s": first,
        "client_second_token_s": second,
        "prefill_compute_s": t.get("queue_s", 0.0) + t.get("compute_s", 0.0),
        "pool_write_s": t.get("write_s", 0.0),
        "pool_read_s": dec.get("load_s", 0.0),
        "first_decode_step_s": (dec.get("first_token_s") or 0.0) - dec.get("load_s", 0.0),
        "bytes_written": pre.get("bytes_written", 0),
        "bytes_read": dec.get("bytes_read", 0),
        "decision": pre.get("decision"),
    }


async def drive(url: str, prompt_len: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        for _ in range(2):  # warm-up: kernels, graphs, connections
            await one(s, url, model, torch.randint(0, 49152, (prompt_len,), generator=g).tolist())
        return [await one(s, url, model, torch.randint(0, 49152, (prompt_len,), generator=g).tolist()) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json etc.")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a dry run of the script)")
    args = ap.parse_args()
    folder = Path("/tmp/tidepool-random-smollm2")
    if not folder.exists():
        make_checkpoint(folder, Path(args.tokenizer))
    cfg = ClusterConfig(
        router_port=free_port(), model=str(folder), device=args.device, threads=4 if args.device == "cuda" else 1, pool_gb=8,
        log_dir=Path("/tmp/tidepool-logs"), worker_args=["--max-model-len", "4096", "--kv-cache-gb", "4" if args.device == "cuda" else "1"],
        router_args=["--prefill-threshold-tokens", "0"],
    )
    with LocalCluster(cfg) as cluster:
        rows = asyncio.run(drive(cluster.url, args.prompt_len, args.requests))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    assert all(r["decision"] == "prefill" for r in rows)
    parts = ["prefill_compute_s", "pool_write_s", "pool_read_s", "first_decode_step_s"]
    handoff = med["pool_write_s"] + med["pool_read_s"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(f"\n{device}: {args.prompt_len}-token prompts, median of {len(rows)} (bf16, random SmolLM2-135M weights)\n")
    print(table(["part", "ms", "share of the sum"], [[p.removesuffix("_s").replace("_", " "), f"{med[p] * 1e3:.2f}", f"{100 * med[p] / sum(med[q] for q in parts):.1f}%"] for p in parts]
                + [["sum (prefill to decode's first token)", f"{sum(med[q] for q in parts) * 1e3:.2f}", ""],
                   ["client TTFT (first token, from prefill)", f"{med['client_ttft_s'] * 1e3:.2f}", ""],
                   ["client time to second token (decode's first)", f"{med['client_second_token_s'] * 1e3:.2f}", ""],
                   ["pool write + read vs client TTFT", f"{handoff * 1e3:.2f}", f"{100 * handoff / med['client_ttft_s']:.1f}%"]]))
    print(f"\nKV moved per request: {med['bytes_written'] / 1e6:.1f} MB written, {med['bytes_read'] / 1e6:.1f} MB read")
    if args.out:
        Path(args.out).write_text(json.dumps({"median": med, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
