"""Rank 0's model runner under tensor parallelism: every piece of device work, mirrored.

The engine on rank 0 schedules, lays out steps on its persistent batch and samples exactly
as at TP=1; its runner is this subclass, which before each piece of device work sends the
other ranks what to do (libs/dist/channel.py) and then does its own part:

- the forward (``forward_pass``): the step's *plan*, a ``ForwardPlan`` (its layout and
  path: eager, decode graph or prefill graph) and the views of the step's pack that the
  forward reads (``FORWARD_VIEWS``), taken from rank 0's device pack once the decode rows'
  input ids have been gathered there from what the last step sampled. So what the other
  ranks get is exactly what rank 0's forward consumes: on CUDA the views go by device
  broadcasts (no host copy, no stream sync: async scheduling needs none), on the CPU in
  the message itself. Each rank copies them into its own step staging (the views its
  graphs were captured on) and runs the same forward, so the all-reduces inside pair up.
  Only rank 0 samples (the LM head's all-gather gives it every logit); the other ranks
  keep no sampling state.
- graph capture (``enable_graphs``): every rank captures the same graphs, in the same
  order, when rank 0 does.
- ``copy_blocks`` (a forked sequence's partial block): the same copy in every cache.
- block imports and exports (PD handoff, pool hits): each rank moves its own KV heads
  between its cache and the shared staging rows (kernels/swap/heads.py), so the rows
  hold whole blocks; a ``sync`` then waits, with the collective timeout, until every rank's
  copies have landed, so a row is never reused or read while a rank still copies it.

Async scheduling is supported: on CUDA a step's work (and its messages) is issued from the
engine thread; on the CPU the device queue's worker thread runs the steps while the engine
thread may export blocks, so one lock keeps each mirrored operation (a whole step, an
export) in one piece: the order of messages is the order of the work on every rank.

Any failure inside a mirrored operation leaves the ranks out of step (some are in a
collective the others will never join), so it fails the whole group
(``TensorParallelGroup.fail``: the service takes the instance down) and every later call
raises ``TensorParallelError`` at once instead of touching a broken group. A collective
that does not finish within ``tp_timeout_s`` raises, so a hung rank ends the same way.

The other ranks' side is libs/engine/tp/worker.py.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple

import torch

from kernels.swap import StagingBuffer
from libs.engine.cuda_graphs import ForwardGraphs
from libs.engine.model_runner import ModelRunner, StepResult
from libs.engine.sequence import KVImport
from libs.engine.step_inputs import Layout, PackViews, Step, StepStaging
from libs.engine.tp.group import TensorParallelError, TensorParallelGroup

# The views of a step's pack that ``ModelRunner.forward_pass`` reads (eager, or a graph
# replaying from the same memory); decode_slots and the sampling part are rank 0's alone.
FORWARD_VIEWS = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_lens", "query_start_loc", "block_tables")


class ForwardPlan(NamedTuple):
    """What a rank other than 0 needs of a ``Step`` to run its forward (the fields of
    ``Step`` that ``forward_pass`` reads, same names)."""

    layout: Layout
    path: str
    num_decodes: int
    num_tokens: int
    num_prefill_seqs: int
    max_seq_len: int
    score_spans: tuple = ()  # prompt logprobs: LM-head passes every rank runs (prompt_logprobs.py)
    num_verify_tokens: int = 0  # verify chunks' tokens (libs/engine/spec; 0 under TP, which refuses speculation)

    @property
    def num_samples(self) -> int:
        return self.layout.samples

    @property
    def prompt_rows(self) -> None:
        return None  # only rank 0 scores

    @classmethod
    def of(cls, step: "Step | ForwardPlan") -> "ForwardPlan":
        return cls(Layout(*step.layout), step.path, step.num_decodes, step.num_tokens, step.num_prefill_seqs, step.max_seq_len, tuple(step.score_spans), step.num_verify_tokens)

    def to_args(self) -> dict:
        return {"layout": list(self.layout), "path": self.path, "nd": self.num_decodes, "tokens": self.num_tokens,
                "prefill_seqs": self.num_prefill_seqs, "max_seq_len": self.max_seq_len,
                "scores": [list(s) for s in self.score_spans], "verify_tokens": self.num_verify_tokens}

    @classmethod
    def from_args(cls, a: dict) -> "ForwardPlan":
        spans = tuple((int(r), int(n)) for r, n in a.get("scores", ()))
        return cls(Layout(*a["layout"]), a["path"], a["nd"], a["tokens"], a["prefill_seqs"], a["max_seq_len"], spans, int(a.get("verify_tokens", 0)))


def receive_views(staging: StepStaging, layout: Layout, tensors: dict[str, torch.Tensor]) -> PackViews:
    """The forward's inputs as received, in this rank's own staging: on CUDA its device
    pack (the memory its graphs read) when the layout fits, on the CPU a host pack (which
    is the device's there)."""
    packs = staging.device_packs
    sizes = layout.sizes()
    if packs is None:
        pack, _ = staging.host(layout)
        v = pack.tensor_views.get(layout)
    elif all(n <= p.numel() for n, p in zip(sizes, packs)):
        v = staging.device_views(layout)
    else:  # a step larger than any graph: eager, on buffers of its own
        v = layout.views(*(torch.empty(max(n, 1), dtype=p.dtype, device=p.device) for n, p in zip(sizes, packs)))
    for name in FORWARD_VIEWS:
        getattr(v, name).copy_(tensors[name])
    return v


def mirrored(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` only on a healthy group, under the runner's lock, and fail the group
    if it raises."""

    @functools.wraps(method)
    def run(self: "TensorParallelRunner", *args: Any, **kwargs: Any) -> Any:
        if self.tp.failure is not None:
            raise TensorParallelError(f"tensor parallelism failed earlier: {self.tp.failure}")
        try:
            with self.lock:
                return method(self, *args, **kwargs)
        except TensorParallelError as e:  # a rank died or timed out in the middle of it
            self.tp.fail(str(e))
            raise
        except Exception as e:
            reason = f"{method.__name__} failed on rank 0: {type(e).__name__}: {e}"
            self.tp.fail(reason)
            raise TensorParallelError(reason) from e

    return run


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, tp: TensorParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = tp
        self.lock = threading.RLock()  # one mirrored operation at a time (see the docstring)

    def _send(self, op: str, args: dict | None = None, tensors: dict | None = None) -> None:
        self.tp.channel.send(op, args, tensors)

    def sync(self) -> None:
        """Every rank's block copies have landed (rank 0's own too)."""
        self._send("sync")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.tp.barrier()

    @mirrored
    def enable_graphs(self, max_batch: int, prefill_max_tokens: int, prefill_seqs: int, *, emulate: bool = False) -> ForwardGraphs:
        args = {"max_batch": max_batch, "prefill_max_tokens": prefill_max_tokens, "prefill_seqs": prefill_seqs, "emulate": emulate}
        self._send("graphs", args)
        return super().enable_graphs(max_batch, prefill_max_tokens, prefill_seqs, emulate=emulate)

    def execute(self, step: Step, pre_ops: list[Callable[[], None]]) -> StepResult:
        if self.tp.failure is not None:
            raise TensorParallelError(f"tensor parallelism failed earlier: {self.tp.failure}")
        with self.lock:  # the step's imports, copies and forward are one piece
            return super().execute(step, pre_ops)

    @torch.inference_mode()
    @mirrored
    def forward_pass(self, step: "Step | ForwardPlan", v: PackViews, scores: list | None = None) -> torch.Tensor:
        self._send("forward", ForwardPlan.of(step).to_args(), {name: getattr(v, name) for name in FORWARD_VIEWS})
        return super().forward_pass(step, v, scores)

    @torch.inference_mode()
    @mirrored
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self._send("copy", {"copies": [list(c) for c in copies]})
        super().copy_blocks(copies)

    @torch.inference_mode()
    @mirrored
    def import_blocks(self, imp: KVImport, rows: list[int], block_ids: list[int]) -> None:
        try:
            super().import_blocks(imp, rows, block_ids)
        finally:
            self.sync()  # the engine releases the staging right after this

    def _swap_in(self, buf: StagingBuffer, block_ids: list[int], first_row: int) -> None:
        self._send("scatter", {"index": buf.index, "first_row": first_row, "ids": list(block_ids)})
        super()._swap_in(buf, block_ids, first_row)

    @mirrored
    def export_blocks(self, block_ids: list[int], num_tokens: list[int] | None = None) -> list[StagingBuffer] | None:
        before = self.tp.channel.messages
        try:
            return super().export_blocks(block_ids, num_tokens)
        finally:
            if self.tp.channel.messages != before:
                self.sync()  # the rows are read (written to the pool) once the engine returns them

    def _swap_out(self, block_ids: list[int], num_tokens: list[int] | None) -> StagingBuffer:
        buf = super()._swap_out(block_ids, num_tokens)
        self._send("gather", {"index": buf.index, "ids": list(block_ids)})
        return buf
