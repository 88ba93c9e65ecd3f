"""Swap bandwidth: moving scattered KV blocks between the paged cache and pinned host memory.

SmolLM2's layout (30 layers, 3 kv heads, head dim 64, block size 16, bf16: 360 KiB a
block) in a cache of 4096 blocks; 64 and 512 random, duplicate-free block ids; both
directions. Each row is GB/s of block bytes moved, timed with CUDA events around the
enqueue (so host-side launch cost counts when it is the bottleneck), median of --reps
after --warmup, in one process so the baselines and ours see the same machine:

- pinned peak: one cudaMemcpyAsync of the same byte count, device buffer <-> pinned host;
- per block per layer: one cudaMemcpyAsync per block, layer and K/V;
- index_select per layer: torch index_select/index_copy_ per layer into device staging,
  plus one copy;
- torch reference: one index_select/index_copy_ over whole blocks, plus one copy;
- ours (BlockSwapper, Triton): staged (kernel + one copy), mapped (the kernel reads or
  writes pinned memory directly), one copy per block (the run path on singletons), and a
  consecutive run of the same length (the single-copy path).

Run on a GPU: ``python3 bench/swap_bench.py [--markdown bench/results/swap.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.swap import BlockSwapper, reference  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPE = torch.bfloat16


def median_ms(fn: Callable[[], None], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Case:
    """Buffers for one block count, shared by every method so each moves the same bytes."""

    def __init__(self, cache: torch.Tensor, n: int) -> None:
        self.cache = cache
        self.n = n
        self.ids = torch.randperm(cache.shape[0])[:n]
        self.ids_dev = self.ids.cuda()
        self.id_list = self.ids.tolist()
        start = int(torch.randint(cache.shape[0] - n, ()))
        self.run_ids = torch.arange(start, start + n)
        shape = (n, *cache.shape[1:])
        self.host = torch.empty(shape, dtype=DTYPE, pin_memory=True)
        self.host.copy_(torch.randn(shape).to(DTYPE))
        self.device = torch.empty(shape, dtype=DTYPE, device="cuda")
        self.layer_major = torch.empty((LAYERS, n, *cache.shape[2:]), dtype=DTYPE, device="cuda")
        self.nbytes = self.host.numel() * self.host.element_size()


def baselines(case: Case, out: bool) -> dict[str, Callable[[], None]]:
    cache, host, device, layer_major = case.cache, case.host, case.device, case.layer_major
    ids_dev, id_list = case.ids_dev, case.id_list

    def peak() -> None:
        if out:
            host.copy_(device, non_blocking=True)
        else:
            device.copy_(host, non_blocking=True)

    def per_block_per_layer() -> None:
        for row, block in enumerate(id_list):
            for layer in range(LAYERS):
                for kv in range(2):
                    if out:
                        host[row, layer, kv].copy_(cache[block, layer, kv], non_blocking=True)
                    else:
                        cache[block, layer, kv].copy_(host[row, layer, kv], non_blocking=True)

    def index_select_per_layer() -> None:
        if out:
            for layer in range(LAYERS):
                torch.index_select(cache[:, layer], 0, ids_dev, out=layer_major[layer])
            host.view(layer_major.shape).copy_(layer_major, non_blocking=True)
        else:
            layer_major.copy_(host.view(layer_major.shape), non_blocking=True)
            for layer in range(LAYERS):
                cache[:, layer].index_copy_(0, ids_dev, layer_major[layer])

    def torch_reference() -> None:
        if out:
            reference.gather_blocks(cache, case.ids, device)
            host.copy_(device, non_blocking=True)
        else:
            device.copy_(host, non_blocking=True)
            reference.scatter_blocks(device, case.ids, cache)

    return {
        "pinned peak (one cudaMemcpyAsync)": peak,
        "per block per layer (cudaMemcpyAsync each K, V)": per_block_per_layer,
        "index_select per layer + one copy": index_select_per_layer,
        "torch reference (whole blocks) + one copy": torch_reference,
    }


def ours(case: Case, out: bool, swappers: dict[str, BlockSwapper]) -> dict[str, Callable[[], None]]:
    def swap(swapper: BlockSwapper, ids: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if out:
                swapper.swap_out(ids).release()
            else:
                buf = swapper.acquire(ids.numel())
                swapper.swap_in(buf, ids)
                buf.release()

        return run

    return {
        "**ours: staged** (kernel + one copy)": swap(swappers["staged"], case.ids),
        "ours: mapped (kernel on pinned memory)": swap(swappers["mapped"], case.ids),
        "ours: one copy per block": swap(swappers["per_block"], case.ids),
        "ours: consecutive ids (single copy)": swap(swappers["staged"], case.run_ids),
    }


def check_ours(case: Case, swappers: dict[str, BlockSwapper]) -> None:
    """Every strategy must move the right bytes, both ways, before its time counts."""
    for name, swapper in swappers.items():
        with swapper.swap_out(case.ids) as buf:
            if not torch.equal(buf.host, case.cache[case.ids_dev].cpu()):
                raise AssertionError(f"{name}: swap-out moved the wrong bytes")
        before = case.cache.clone()
        targets = case.ids.flip(0)
        with swapper.acquire(case.n) as buf:
            buf.host.copy_(case.host)
            swapper.swap_in(buf, targets)
        torch.cuda.synchronize()
        before[targets.cuda()] = case.host.cuda()
        if not torch.equal(case.cache, before):
            raise AssertionError(f"{name}: swap-in wrote the wrong bytes")


def host_us(fn: Callable[[], None], calls: int = 300) -> float:
    """Host time per call of ``fn`` (enqueue cost), on a swap too small to keep the GPU busy."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_costs(cache: torch.Tensor, swappers: dict[str, BlockSwapper]) -> dict[str, float]:
    """What sits in front of every swap on the host, for two scattered blocks."""
    from kernels.swap import triton_swap
    from kernels.swap.checks import as_block_ids

    ids = [5, cache.shape[0] - 7]
    ids_dev = torch.tensor(ids, device="cuda")
    staging = torch.empty(len(ids), *cache.shape[1:], dtype=cache.dtype, device="cuda")
    staged = swappers["staged"]
    return {
        "check ids (as_block_ids)": host_us(lambda: as_block_ids(ids, cache.shape[0], unique=True)),
        "Triton launch (launch_gather)": host_us(lambda: triton_swap.launch_gather(cache, ids_dev, staging)),
        "torch.index_select launch": host_us(lambda: torch.index_select(cache, 0, ids_dev, out=staging)),
        "swap_out, staged": host_us(lambda: staged.swap_out(ids).release()),
        "swap_out, one run": host_us(lambda: staged.swap_out([9, 10]).release()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--counts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--slow-reps", type=int, default=3, help="reps of the per-block-per-layer baseline")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("swap_bench needs a CUDA GPU")

    cache = torch.randn(args.num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    max_n = max(args.counts)
    swappers = {
        "staged": BlockSwapper(cache, max_n, scattered="staged"),
        "mapped": BlockSwapper(cache, max_n, scattered="mapped"),
        "per_block": BlockSwapper(cache, max_n, scattered="staged", max_direct_runs=max_n),
    }
    block_bytes = cache[0].numel() * cache.element_size()
    rows: dict[str, dict[str, float]] = {}
    for n in args.counts:
        case = Case(cache, n)
        check_ours(case, swappers)
        for out in (True, False):
            direction = "D2H" if out else "H2D"
            methods = {**baselines(case, out), **ours(case, out, swappers)}
            for name, fn in methods.items():
                slow = name.startswith("per block per layer")
                reps, warmup = (args.slow_reps, 1) if slow else (args.reps, args.warmup)
                try:
                    ms = median_ms(fn, reps, warmup)
                    rows.setdefault(name, {})[f"{direction} {n}"] = case.nbytes / ms / 1e6
                except Exception as exc:  # noqa: BLE001 - report the failing method, keep the rest
                    print(f"{name} {direction} {n}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    rows.setdefault(name, {})[f"{direction} {n}"] = float("nan")
                print(f"{direction} n={n:4d} {name:52s} {rows[name][f'{direction} {n}']:7.2f} GB/s", flush=True)
    overheads = host_costs(cache, swappers)
    for swapper in swappers.values():
        swapper.close()

    columns = [f"{d} {n}" for d in ("D2H", "H2D") for n in args.counts]
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"Device: {props.name}; torch {torch.__version__}; "
        f"triton {__import__('triton').__version__}; {datetime.date.today().isoformat()}",
        f"Layout: SmolLM2 ({LAYERS} layers, {KV_HEADS} kv heads, head dim {HEAD_DIM}, block size "
        f"{BLOCK_SIZE}, bf16, {block_bytes // 1024} KiB a block), cache of {args.num_blocks} blocks, "
        f"random duplicate-free ids. GB/s of block bytes (1 GB = 1e9 B), median of {args.reps} "
        f"({args.slow_reps} for per-block-per-layer) after warm-up, CUDA events.",
        "",
        "| method | " + " | ".join(f"{c} blocks" for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.1f}" for c in columns) + " |")
    lines += ["", "Host time per call (µs), two scattered blocks, mean of 300 calls after 20 warm-up calls:", ""]
    lines += ["| step | µs |", "|---|---:|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in overheads.items()]
    table = "\n".join(lines)
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
