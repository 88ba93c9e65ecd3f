"""CUDA graphs of the forward: decode steps by batch size, prefill steps by token count.

A step of a small model is hundreds of small kernels; launching them one by one from
Python costs more than running them. Each graph replays a whole forward from the views
of the step's device pack (libs/engine/step_inputs.py) for one capacity, so replaying
needs nothing but the step's one copy per dtype, which the engine does anyway.

- Decode graphs, one per batch size in ``graph_batch_sizes``: a decode-only step of
  ``n`` sequences is laid out with the smallest captured size ``>= n``; the padding rows
  write nowhere (slot -1) and attend to nothing (length 0). The graph includes the LM
  head, the logits of every row, and (given the sampler's ``greedy``) each row's argmax
  of them: a step whose rows all take the argmax of unprocessed logits then launches no
  sampling kernel of its own, whose Python launch cost (~90 us on an H200 host) was a
  fifth of a batch-1 step's host time (bench/RESULTS.md, issue 10).
- Prefill graphs, one per token bucket (powers of two up to the step budget): any step
  with prompt chunks whose tokens and sequences fit. Every sequence of it, decode rows
  included, is a query of the prefill attention kernel (a decode row is a query of
  length 1), over ``seqs`` sequence slots, the unused ones empty; the graph stops at the
  final hidden states, and the sampled rows' logits are computed after it (their count
  varies with the step).

``emulate=True`` runs the function each graph would capture eagerly on the step's padded
layout instead (any device): the CPU tests check the graph layouts and their padding
that way, the GPU tests check replay against eager.

Both kinds are possible because the Triton kernels size their grids from tensor shapes
and host ints only (kernels/attention/triton_attention.py), and every graph's block
table has ``width`` columns, the longest context's, so one capture serves every context
length. Anything else (batches larger than the largest graph, steps whose pack does not
fit the graph-sized device buffers) runs eagerly.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from libs.engine.step_inputs import Layout, PackViews, StepStaging
from libs.model.graph_capture import for_graph
from libs.model.llama import LlamaModel


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def prefill_token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    sizes, t = [], smallest
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]


class ForwardGraphs:
    """Captured forwards keyed by ``("decode", batch)`` and ``("prefill", tokens)``."""

    def __init__(
        self, model: LlamaModel, staging: StepStaging, device: torch.device, *, width: int, block_size: int, emulate: bool = False,
        greedy: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if device.type != "cuda" and not emulate:
            raise ValueError("CUDA graphs need a CUDA device")
        self.emulate = emulate
        self.model = model
        self.staging = staging
        self.device = device
        self.width = width
        self.block_size = block_size
        self.decode_sizes: list[int] = []
        self.prefill_tokens: list[int] = []
        self.prefill_seqs = 0
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.greedy = greedy  # logits -> each row's argmax token (the sampler's), or None
        self.greedy_outputs: dict[int, torch.Tensor] = {}  # decode graph's batch -> its rows' argmax
        self.pool = None
        self.replays = {"decode": 0, "prefill": 0}

    @staticmethod
    def decode_layout(batch: int, width: int) -> Layout:
        return Layout(batch, batch, width)

    @staticmethod
    def prefill_layout(tokens: int, seqs: int, width: int) -> Layout:
        return Layout(tokens, seqs, width)

    def _decode_forward(self, v: PackViews, batch: int) -> torch.Tensor:
        meta = v.metadata(batch, 0, self.width * self.block_size)
        logits = self.model.compute_logits(self.model(v.input_ids, v.positions, meta))
        if self.greedy is not None:
            self.greedy_outputs[batch] = self.greedy(logits)
        return logits

    def greedy_tokens(self, batch: int) -> torch.Tensor | None:
        """The argmax of every row of the decode graph of ``batch`` (as of its last
        replay), or None without ``greedy``."""
        return self.greedy_outputs.get(batch)

    def _prefill_forward(self, v: PackViews, tokens: int) -> torch.Tensor:
        return self.model(v.input_ids, v.positions, v.metadata(0, tokens, self.width * self.block_size))

    @torch.inference_mode()
    def capture(self, decode_sizes: list[int], prefill_tokens: list[int], prefill_seqs: int) -> None:
        """Capture every graph, largest first (later graphs reuse its memory pool)."""
        self.decode_sizes, self.prefill_tokens, self.prefill_seqs = decode_sizes, prefill_tokens, prefill_seqs
        if self.emulate:
            return
        jobs: list[tuple[tuple[str, int], Layout, Callable[[PackViews], torch.Tensor]]] = []
        for t in reversed(prefill_tokens):
            jobs.append((("prefill", t), self.prefill_layout(t, prefill_seqs, self.width), lambda v, t=t: self._prefill_forward(v, t)))
        for bs in reversed(decode_sizes):
            jobs.append((("decode", bs), self.decode_layout(bs, self.width), lambda v, bs=bs: self._decode_forward(v, bs)))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # No garbage collection while capturing: collecting an earlier engine's graphs or
        # pinned buffers mid-capture (a CUDAGraph reset, a host free) is an operation the
        # capture forbids, and it invalidates the capture (seen on the H100 when tests
        # build engines one after another: "operation not permitted when stream is
        # capturing (function reset)"). Collect first, as vLLM does, then pause the GC.
        gc.collect()
        paused = gc.isenabled()
        gc.disable()
        try:
            self._capture_all(jobs, stream)
        finally:
            if paused:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture_all(self, jobs: list[tuple[tuple[str, int], Layout, Callable[[PackViews], torch.Tensor]]], stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            for key, layout, fn in jobs:
                v = self.staging.device_views(layout)
                # Inputs that touch nothing: warm-up runs really execute (the KV cache is
                # live memory), the capture only records.
                v.input_ids.zero_()
                v.positions.zero_()
                v.slot_mapping.fill_(-1)
                v.seq_lens.zero_()
                v.query_start_loc.zero_()
                v.block_tables.zero_()
                graph = torch.cuda.CUDAGraph()
                with for_graph():  # the warm-up takes the capture's kernels (libs/model/graph_capture.py)
                    for _ in range(2):  # compiles the Triton kernels, settles allocations
                        fn(v)
                    # thread_local: another thread's CUDA calls (an earlier engine's worker, a
                    # pool thread freeing pinned memory) do not invalidate this capture.
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                        self.outputs[key] = fn(v)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[key] = graph

    def release(self) -> None:
        """Destroy the captured graphs now (``CUDAGraph.reset``), their outputs and pool with
        them; the object replays nothing afterwards. NCCL keeps resources for collectives
        captured in a graph until the graph is destroyed, and a process group destroyed while
        such a graph lives waits for them: on two H200s a rank with live graphs hung in
        ``destroy_process_group`` (bench/RESULTS.md, "Tensor parallelism")."""
        if self.graphs:  # captured ones (an emulation captures nothing)
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.greedy_outputs.clear()
        self.pool = None

    def replay(self, kind: str, capacity: int, views: PackViews) -> torch.Tensor:
        """Replay the graph of ``capacity``; its inputs are the current device pack
        (``views``, which only an emulated replay reads directly)."""
        key = (kind, capacity)
        self.replays[kind] += 1
        if self.emulate:
            # A captured graph reads the device pack, whatever ``views`` are: so does its
            # emulation where there is one (tests give the CPU device packs to check that
            # every graph step's inputs land there).
            if self.staging.device_packs is not None:
                layout = self.decode_layout(capacity, self.width) if kind == "decode" else self.prefill_layout(capacity, self.prefill_seqs, self.width)
                views = self.staging.device_views(layout)
            return self._decode_forward(views, capacity) if kind == "decode" else self._prefill_forward(views, capacity)
        self.graphs[key].replay()
        return self.outputs[key]
