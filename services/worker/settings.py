"""Settings of a prefill or decode instance (CLI flags and TIDEPOOL_* variables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libs.kvpool.config import PoolConfig
from libs.model.moe.options import STRATEGIES
from services.common import BaseSettings, setting


@dataclass(frozen=True, kw_only=True)
class WorkerSettings(BaseSettings):
    """A prefill or decode instance: one engine, one pool client, registered with the router."""

    model: str | None = setting(None, help="a .gguf file or Hugging Face folder; default: the embedded SmolLM2-135M-Instruct")
    device: str = setting("auto", help="cpu, cuda, cuda:N or auto")
    dtype: str = setting("auto", help="float32, bfloat16 or auto (float32 on CPU, bfloat16 on CUDA)")
    threads: int = setting(1, help="torch CPU threads for this process (instances sharing cores must not oversubscribe)")
    block_size: int = setting(16, help="tokens per KV block; must match every instance sharing the pool")
    num_blocks: int | None = setting(None, help="KV cache blocks; default from kv_cache_gb or GPU memory")
    kv_cache_gb: float | None = setting(None, help="KV cache size in GiB (default 1 on CPU, 80%% of free GPU memory)")
    max_model_len: int | None = setting(None, help="longest prompt + completion; default: the model's")
    max_num_seqs: int = setting(64, help="running sequences per step at most")
    max_num_batched_tokens: int | None = setting(None, help="tokens per step at most (chunked prefill); default 1024 CPU / 8192 CUDA")
    enable_prefix_caching: bool = setting(True, help="reuse KV blocks of identical prefixes inside this instance")
    attention_backend: Literal["auto", "torch", "triton"] = setting("auto", help="attention kernels")
    cache_dir: str | None = setting(
        "auto",
        help="where a GGUF's converted weights are cached and memory-mapped on the next start "
        "(a warm start skips conversion); auto: $XDG_CACHE_HOME/tidepool or ~/.cache/tidepool; none: off",
    )
    quantized_weights: bool = setting(False, help="CPU + GGUF: decode with the file's 4-bit weights (approximate, ~2x faster decode)")
    packed_linears: bool = setting(True, help="CPU float32: linear layers through oneDNN over weights packed at load (off: torch's BLAS)")
    moe_strategy: Literal[STRATEGIES] = setting("auto", help="MoE models: how experts run (libs/model/moe/strategy.py)")
    moe_fake_balance: bool = setting(False, help="MoE models: FakeBalanceExpert routing, for load benchmarks only (changes the output)")
    quantization: Literal["auto", "none", "fp8"] = setting(
        "auto", help="fp8: block-scaled FP8 weights (quantized at load, or an FP8 checkpoint's); none: dense; auto: as the checkpoint is. Prefill and decode must agree"
    )
    tensor_parallel_size: int = setting(
        1, help="tensor-parallel ranks of this instance: one process each, started and watched by this one (CUDA: GPUs cuda:k..k+N-1)"
    )
    tp_timeout_s: float = setting(
        60.0, help="a tensor-parallel collective not done in this time fails the instance, which deregisters and exits"
    )
    tp_all_reduce: Literal["auto", "one_shot", "nccl"] = setting(
        "auto", help="how tensor-parallel ranks sum partial outputs: auto: small sums by a one-shot over GPU symmetric memory where available, else NCCL (gloo on the CPU)"
    )
    async_scheduling: Literal["auto", "on", "off"] = setting(
        "auto", help="launch step N+1 before step N's tokens are read back (auto: on only where measured faster; see README)"
    )
    swap_buffers: int = setting(8, help="staging buffers for pool transfers (bounds concurrent handoffs)")
    swap_max_blocks: int = setting(64, help="blocks per staging buffer")
    swap_digests: Literal["auto", "on", "off"] = setting(
        "auto", help="exported blocks' pool checksums computed on the GPU by the swap (auto: on CUDA; off: hashed on the CPU)"
    )
    redis_url: str = setting("redis://127.0.0.1:6379/0", help="the pool's Redis")
    redis_password: str | None = setting(None, help="Redis password (prefer the env variable)", secret=True)
    key_prefix: str = setting("tidepool", help="prefix of every pool key in Redis")
    pool_workers: int = setting(4, help="concurrent pool write calls (each of up to --pool-write-batch blocks)")
    pool_write_batch: int = setting(16, help="blocks per pool write call (pipelined per Redis node)")
    pool_sockets: int = setting(4, help="bulk-path sockets per Redis node: pipelines to one node in flight at once (1-32)")
    pool_bulk_model: Literal["threads", "asyncio"] = setting(
        "threads", help="how block values move: threads (blocking recv_into, GIL released) or asyncio (BufferedProtocol)"
    )
    pool_check_s: float = setting(
        1.0, help="seconds between pings of the pool's Redis; while it is down requests skip the pool (recompute)"
    )
    router_url: str | None = setting(None, help="router to register with (heartbeats every heartbeat_s); none: standalone")
    advertise_url: str | None = setting(None, help="URL the router reaches this instance at; default http://<host>:<port>")
    instance_id: str | None = setting(None, help="stable id for this instance; default: random")
    heartbeat_s: float = setting(1.0, help="seconds between heartbeats to the router")
    load_timeout_s: float = setting(10.0, help="longest wait for pool reads or staging before recomputing instead")
    max_queue_depth: int = setting(
        256,
        help="requests this instance holds at once (running, waiting and loading: its queue_depth); "
        "past it a new one gets 429 with Retry-After and the router places it elsewhere or waits",
    )
    retry_after_s: int = setting(1, help="the Retry-After (seconds) of a 429")
    handoff_timeout_s: float = setting(
        120.0, help="decode: longest wait for prefill's last progress update in a streamed handoff before failing the request (the router resumes it)"
    )
    speculative_config: str | None = setting(
        None,
        help='decode only: speculative decoding as vLLM-shaped JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4} '
        "(methods ngram, draft_model, self_draft; see README); off by default. Prefill ignores it. "
        "Speculation runs with synchronous scheduling: --async-scheduling on is refused with it.",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.tensor_parallel_size < 1 or self.tp_timeout_s <= 0:
            raise ValueError("tensor_parallel_size must be >= 1 and tp_timeout_s > 0")
        if min(self.max_queue_depth, self.retry_after_s, self.pool_workers, self.pool_write_batch, self.pool_sockets) < 1:
            raise ValueError("max_queue_depth, retry_after_s, pool_workers, pool_write_batch and pool_sockets must be >= 1")
        if self.pool_sockets > PoolConfig.max_connections:
            raise ValueError(f"pool_sockets must be <= {PoolConfig.max_connections}")
        if min(self.heartbeat_s, self.load_timeout_s, self.pool_check_s, self.handoff_timeout_s) <= 0:
            raise ValueError("heartbeat_s, load_timeout_s, pool_check_s and handoff_timeout_s must be > 0")
        from libs.engine.spec.config import parse_speculative_config

        if parse_speculative_config(self.speculative_config) is not None and self.async_scheduling == "on":  # a bad JSON ends start-up with status 2
            raise ValueError("speculative_config cannot be combined with async_scheduling on: speculation needs synchronous scheduling (use auto or off)")
