"""Engine configuration: explicit, typed, and resolved once against the machine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from libs.engine.spec.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


# Where "auto" turns async scheduling on: where a benchmark showed it faster (bench/RESULTS.md,
# issue 10's section; python -m bench.async_scheduling).
# CPU: measured, not faster at batch 1 (the worker thread and the engine thread share the
# GIL and, on small machines, the cores), so off. CUDA (H100, 2026-11-23): SmolLM2-135M's
# shape decodes 1.33-1.57x faster at batch 1, 8 and 64 (bench.async_scheduling; 1.45x and
# 1.55x in bench.gpu_engine), and tests/gpu/test_engine_gpu.py (async equals sync token for
# token through aborts and preemption, nothing emitted past a stop) passed on the H100 at
# 487b0ac, so on. A 2-layer toy model, whose 0.35 ms steps leave nothing to hide behind,
# runs 0.94-0.98x: the one case where it does not pay.
ASYNC_SCHEDULING_DEFAULTS: dict[str, bool] = {"cuda": True, "cpu": False}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know; ``auto`` values are resolved by ``resolve()``.

    - ``model``: a .gguf file or a Hugging Face folder; None = the embedded SmolLM2-135M.
    - ``dtype``: ``auto`` is float32 on the CPU and bfloat16 on CUDA.
    - KV cache size: ``num_blocks`` if set, else ``kv_cache_gb`` of memory (default: 1 GiB
      on the CPU, ``gpu_memory_utilization`` of the free memory on CUDA after loading).
    - ``max_num_batched_tokens``: the per-step token budget that chunked prefill fills.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.80
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    num_threads: int | None = None
    seed: int = 0
    # CPU + GGUF only: run the file's 4-bit (Q4_0/Q4_1) linear weights natively instead of
    # dequantizing them (libs/model/quantized.py): ~4x less memory traffic per decode step.
    quantized_weights: bool = False
    # CPU float32: linear layers and the LM head through oneDNN over weights packed at load
    # (libs/model/cpu_linear.py); off: torch's BLAS. Same arithmetic, faster at small batches.
    packed_linears: bool = True
    # Mixture-of-experts models (libs/model/moe): how experts run (auto, loop, contiguous,
    # masked, hybrid, grouped_mm), and FakeBalanceExpert routing for load benchmarks only.
    moe_strategy: str = "auto"
    moe_fake_balance: bool = False
    # Weights as block-scaled FP8 (libs/model/fp8.py): "fp8" quantizes at load (or loads an
    # FP8 checkpoint), "none" runs dense, "auto" follows the checkpoint. FP8 tensor cores
    # (SM 8.9+) run Triton kernels; elsewhere the same weights run dequantized.
    quantization: str = "auto"
    # A GGUF's converted tensors are kept here and memory-mapped on the next start
    # (libs/model/weight_cache.py); None converts on every start.
    weight_cache_dir: str | None = None
    # CUDA only: decode steps replay captured graphs (batch sizes up to graph_max_batch),
    # steps with prompt chunks replay prefill graphs (token counts up to
    # prefill_graph_max_tokens, capped by the step budget; 0 disables them). The default
    # covers a budget raised to 16384: on the H100 a 16 x 1024-token step launched eagerly
    # spends 17-20 ms of host time on its 340 launches against 12.8 ms of GPU work, its
    # graph 1.3 ms (bench/prefill_host.py; smaller steps gain more, bench.gpu_engine
    # --prefill-sweep).
    cuda_graphs: bool = True
    graph_max_batch: int = 128
    prefill_graph_max_tokens: int = 16384
    # Async scheduling (libs/engine/engine.py): step N + 1 is scheduled and launched before
    # step N's tokens are read back. "auto" turns it on only where it was measured faster:
    # see ASYNC_SCHEDULING_DEFAULTS.
    async_scheduling: str = "auto"  # auto, on, off
    # Speculative decoding (libs/engine/spec): vLLM-shaped JSON (or a dict / a parsed
    # SpeculativeConfig); None is off. It needs synchronous scheduling: "auto" async
    # scheduling resolves to off with it, "on" is refused.
    speculative_config: "str | dict | SpeculativeConfig | None" = None
    # Tensor parallelism (libs/engine/tp): this many ranks, one process each, started by
    # this one. A collective (or a barrier) not done within tp_timeout_s fails the instance;
    # an idle rank waits for its next step up to tp_idle_timeout_s (a dead rank 0 ends the
    # wait at once).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    tp_idle_timeout_s: float = 7 * 24 * 3600.0
    # How the TP ranks sum a row-parallel layer's partial outputs (libs/dist/one_shot.py):
    # "auto" takes small sums (decode steps) through a one-shot all-reduce over symmetric
    # memory where every rank can run it (CUDA), the rest through NCCL; "one_shot" insists on
    # it; "nccl" always uses the process group's own all-reduce (gloo's on the CPU).
    tp_all_reduce: str = "auto"  # auto, one_shot, nccl
    # PD handoff staging: buffers of swap_max_blocks blocks each (pinned on CUDA).
    swap_max_blocks: int = 64
    swap_buffers: int = 4
    # Exported blocks' pool digests computed on the device by the swap (kernels/digest), so
    # prefill's writes skip hashing them on the CPU. None: wherever it runs natively (CUDA
    # with the Triton swap kernels); True: also on the CPU, through the torch reference
    # (slow; tests); False: never.
    swap_digests: bool | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_timeout_s <= 0 or self.tp_idle_timeout_s <= 0:
            raise ValueError("tp_timeout_s and tp_idle_timeout_s must be > 0")
        if self.tp_all_reduce not in ("auto", "one_shot", "nccl"):
            raise ValueError(f"tp_all_reduce must be auto, one_shot or nccl, got {self.tp_all_reduce!r}")
        if self.tp_all_reduce == "one_shot" and self.tensor_parallel_size > 1 and self.resolve_device().type != "cuda":
            raise ValueError("tp_all_reduce one_shot needs CUDA devices (it sums through GPU memory the ranks map): use auto or nccl on the CPU")
        if self.speculative_config and self.tensor_parallel_size > 1:
            # The proposers, verify steps and KV rollback (libs/engine/spec) run in rank 0's
            # process; the TP runner does not mirror them to ranks 1..N-1.
            raise ValueError("speculative decoding cannot be combined with tensor parallelism: use --tensor-parallel-size 1 with --speculative-config")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[self.dtype]
        if device.type == "cpu" and dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("on the CPU the dtype must be float32 or bfloat16")
        return dtype

    def resolve_batched_tokens(self, device: torch.device, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        else:
            budget = 8192 if device.type == "cuda" else 1024
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit in one step.
            budget = max(budget, max_model_len)
        return budget

    def resolve_num_blocks(self, device: torch.device, block_nbytes: int) -> int:
        """KV blocks of ``block_nbytes`` (every cache a block id addresses) to allocate:
        ``num_blocks``, else ``kv_cache_gb``'s worth, else a share of the GPU's free memory
        (1 GiB on the CPU)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_gb is not None:
            budget = self.kv_cache_gb * 2**30
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * self.gpu_memory_utilization
        else:
            budget = 2**30
        return max(16, int(budget // block_nbytes))

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.speculative_config:
            # A verify step's emitted tokens (1 to k + 1 per sequence) decide the next step's
            # positions and blocks: speculation runs with synchronous scheduling only.
            if self.async_scheduling == "on":
                raise ValueError("async scheduling and speculative decoding cannot be combined: use --async-scheduling off (or auto) with --speculative-config")
            return False
        if self.async_scheduling == "auto":
            return ASYNC_SCHEDULING_DEFAULTS.get(device.type, False)
        return self.async_scheduling == "on"

    def apply_threads(self) -> None:
        """Set torch's CPU thread count explicitly (DESIGN.md: processes sharing cores
        collapse otherwise). OMP_WAIT_POLICY must already be in the environment."""
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
