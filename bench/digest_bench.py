"""Block digests: the device kernel (kernels/digest) against python-xxhash on the CPU, in one run.

A prompt's blocks, as prefill exports them for the pool: ``--blocks`` blocks of the
SmolLM2-135M shape (30 layers, 3 KV heads of 64, block size 16, bf16: 368,640 bytes of
payload each; 2048 tokens = 128 blocks = 47 MB). Timed:

- ``gpu``: one ``launch_digests`` over every block, straight from the cache (GPU events,
  median of ``--reps``); the work the swap-out now adds to prefill's stream.
- ``cpu``: python-xxhash's xxh3_64 over the same payloads in pinned host memory (as the
  bulk threads hashed them before each send), one thread (the sum of the per-block work,
  which the bulk threads shared), median of ``--reps``.

Both digests are compared, so the timing is only reported for equal results.

And the host's side, which the engine thread pays before it posts prefill's final output
(medians of ``--reps``, no device sync inside the timed call):

- ``launch_host_us``: one ``launch_digests`` call (Triton's launcher);
- ``swap_out_host_us``: ``BlockSwapper.swap_out`` of the blocks, with digests
  (``num_tokens`` given) and without, the way the export gathers a prompt.

    python -m bench.digest_bench --blocks 128 --reps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xxhash

from kernels.digest.triton_digest import launch_digests

SMOLLM2 = (30, 2, 16, 3, 64)  # layers, K/V, block size, kv heads, head dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (the device kernel); the CPU tests cover the kernel in the interpreter")
    n = args.blocks
    cache = torch.randn(n + 8, *SMOLLM2, device="cuda").to(torch.bfloat16)
    ids = torch.randperm(n + 8, device="cuda")[:n].contiguous()
    tokens = torch.full((n,), SMOLLM2[2], dtype=torch.int64, device="cuda")
    out = torch.empty(n, dtype=torch.int64, device="cuda")
    launch_digests(cache, ids, tokens, out)  # compile
    torch.cuda.synchronize()

    gpu_ms = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch_digests(cache, ids, tokens, out)
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))

    host = torch.empty((n, *SMOLLM2), dtype=torch.bfloat16, pin_memory=True)
    host.copy_(cache[ids.cpu()])
    rows = [memoryview(host[j].view(torch.uint8).numpy().reshape(-1)) for j in range(n)]
    cpu_ms, digests = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        digests = [xxhash.xxh3_64_intdigest(r) for r in rows]
        cpu_ms.append((time.perf_counter() - t) * 1e3)
    equal = [d & ((1 << 64) - 1) for d in out.tolist()] == digests
    launch_us, swap_us = host_times(cache, ids, tokens, out, args.reps)
    nbytes = n * host[0].numel() * host.element_size()
    result = {
        "blocks": n, "payload_mb": round(nbytes / 1e6, 2), "digests_equal": equal,
        "gpu_ms": round(statistics.median(gpu_ms), 4), "cpu_ms": round(statistics.median(cpu_ms), 3),
        "cpu_over_gpu": round(statistics.median(cpu_ms) / statistics.median(gpu_ms), 1),
        "gpu_gb_s": round(nbytes / statistics.median(gpu_ms) / 1e6, 1), "cpu_gb_s": round(nbytes / statistics.median(cpu_ms) / 1e6, 1),
        "launch_host_us": launch_us, "swap_out_host_us": swap_us,
        "device": torch.cuda.get_device_name(),
    }
    print(json.dumps(result))
    if not equal:
        raise SystemExit("the device digests differ from xxhash's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def host_times(cache: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, reps: int) -> tuple[float, dict[str, float]]:
    """Host microseconds of one digest launch, and of one swap-out with and without digests."""
    from kernels.swap.swapper import BlockSwapper

    def median_us(fn, after=None) -> float:  # noqa: ANN001
        times = []
        for _ in range(reps + 3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
            if after is not None:
                after()
        return round(statistics.median(times[3:]), 1)

    launch = median_us(lambda: launch_digests(cache, ids, tokens, out))
    n = ids.numel()
    block_ids, counts = ids.tolist(), [int(cache.shape[3])] * n
    swaps = {}
    for name, digests in (("digests", True), ("no digests", False)):
        swapper = BlockSwapper(cache, n, digests=digests)
        bufs: list = []
        swaps[name] = median_us(lambda: bufs.append(swapper.swap_out(block_ids, counts)), after=lambda: bufs.pop().release())
        swapper.close()
    return launch, swaps


if __name__ == "__main__":
    main()
