"""CUDA graphs of the decode step, one per batch size in a fixed set.

A decode step of a small model is hundreds of tiny kernels: launching them one by one
costs more than running them. Each graph replays a whole decode forward (all layers and
the logits) from static input buffers. A batch of ``n`` decodes runs on the smallest
captured size ``>= n``; the padding rows write nowhere (slot -1) and attend to nothing
(length 0), which the Triton kernels treat as no-ops. Anything else (prefill chunks,
batches larger than the largest graph, forked samples) runs eagerly.

The attention kernels size their grids from tensor shapes only, and the block-table
buffer always has ``max_blocks_per_seq`` columns, so one capture serves every context
length up to the model's limit.
"""

from __future__ import annotations

import torch

from libs.engine.inputs import StepInputs
from libs.model.attention import AttentionMetadata
from libs.model.llama import LlamaModel


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: LlamaModel, device: torch.device, *, max_batch: int, max_blocks_per_seq: int, block_size: int):
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        z = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = z(self.max_batch, dtype=torch.long)
        self.positions = z(self.max_batch, dtype=torch.long)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = z(self.max_batch, dtype=torch.int32)
        self.block_tables = z(self.max_batch, max_blocks_per_seq, dtype=torch.int32)
        self.query_start_loc = z(1, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0

    def _num_tokens(self, bs: int) -> int:
        return bs  # one query token per sequence (VerifyGraphs: k + 1)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc,
            num_decodes=bs,
            num_prefill_tokens=0,
            max_seq_len=self.max_blocks * self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (later graphs reuse its memory pool)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                meta, t = self._meta(bs), self._num_tokens(bs)
                for _ in range(2):  # warm-up: compiles Triton kernels, settles allocations
                    self.model.compute_logits(self.model(self.input_ids[:t], self.positions[:t], meta))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    hidden = self.model(self.input_ids[:t], self.positions[:t], meta)
                    self.logits[bs] = self.model.compute_logits(hidden)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def can_run(self, inputs: StepInputs) -> bool:
        n = inputs.num_decodes
        return (
            inputs.num_prefill_tokens == 0
            and 0 < n <= self.max_batch
            and inputs.max_blocks <= self.max_blocks
            and inputs.logits_indices.shape[0] == n  # one sample per row: no forks
        )

    def run(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Copy ``inputs`` into the static buffers, replay, return logits ``[n, vocab]``."""
        n = inputs.num_decodes
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        self.block_tables[:n, : inputs.max_blocks].copy_(inputs.block_tables, non_blocking=True)
        if bs > n:  # padding rows: write nothing, read nothing
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[bs][:n]
