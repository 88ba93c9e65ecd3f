"""Rank 0's model runner under tensor parallelism: every piece of device work, mirrored.

The engine on rank 0 schedules and samples exactly as at TP=1; its runner is this
subclass, which before each piece of device work sends the other ranks what to do
(libs/dist/channel.py) and then does its own part:

- ``forward``: the step's inputs (every tensor of ``StepInputs`` and the input ids, which
  after async prepare live on the device: they go by a device broadcast) — the *plan*
  of the step. Each rank runs the same forward (the same CUDA graph, when one fits, since
  the choice depends on the inputs alone), and the all-reduces inside pair up. Only rank
  0 samples: the LM head's all-gather gives it every logit.
- ``copy_blocks`` (a forked sequence's partial block): the same copy in every cache.
- block imports and exports (PD handoff, pool hits): each rank moves its own KV heads
  between its cache and the shared staging rows (kernels/swap/heads.py), so the rows
  hold whole blocks; a ``sync`` then waits, with the collective timeout, until every rank's
  copies have landed, so a row is never reused or read while a rank still copies it.

Any failure inside a mirrored operation leaves the ranks out of step (some are in a
collective the others will never join), so it fails the whole group
(``TensorParallelGroup.fail``: the service takes the instance down) and every later call
raises ``TensorParallelError`` at once instead of touching a broken group. A collective
that does not finish within ``tp_timeout_s`` raises, so a hung rank ends the same way.

The other ranks' side is libs/engine/tp/worker.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from kernels.swap import StagingBuffer
from libs.engine.inputs import StepInputs
from libs.engine.model_runner import ModelRunner
from libs.engine.sequence import KVImport
from libs.engine.tp.group import TensorParallelError, TensorParallelGroup


def mirrored(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` only on a healthy group, and fail the group if it raises."""

    @functools.wraps(method)
    def run(self: "TensorParallelRunner", *args: Any, **kwargs: Any) -> Any:
        if self.tp.failure is not None:
            raise TensorParallelError(f"tensor parallelism failed earlier: {self.tp.failure}")
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            reason = f"{method.__name__} failed on rank 0: {type(e).__name__}: {e}"
            self.tp.fail(reason)
            raise TensorParallelError(reason) from e

    return run


def encode_inputs(inputs: StepInputs, input_ids: torch.Tensor) -> tuple[dict, dict]:
    """``(args, tensors)`` of a forward message: scalar fields and tensor fields."""
    args, tensors = {}, {"input_ids": input_ids}
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if f.name == "input_ids":
            continue
        if value is None or isinstance(value, torch.Tensor):
            tensors[f.name] = value
        else:
            args[f.name] = value
    return args, tensors


def decode_inputs(args: dict, tensors: dict) -> tuple[StepInputs, torch.Tensor]:
    fields = {**args, **{k: v for k, v in tensors.items() if k != "input_ids"}}
    return StepInputs(input_ids=None, **fields), tensors["input_ids"]


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, tp: TensorParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = tp

    def _send(self, op: str, args: dict | None = None, tensors: dict | None = None) -> None:
        self.tp.channel.send(op, args, tensors)

    def sync(self) -> None:
        """Every rank's block copies have landed (rank 0's own too)."""
        self._send("sync")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.tp.barrier()

    @torch.inference_mode()
    @mirrored
    def forward(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        args, tensors = encode_inputs(inputs, input_ids)
        self._send("forward", args, tensors)
        return super().forward(inputs, input_ids)

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
    def export_blocks(self, block_ids: list[int]) -> list[StagingBuffer] | None:
        before = self.tp.channel.messages
        try:
            return super().export_blocks(block_ids)
        finally:
            if self.tp.channel.messages != before:
                self.sync()  # the rows are read (written to the pool) once the engine returns them

    def _swap_out(self, block_ids: list[int]) -> StagingBuffer:
        buf = super()._swap_out(block_ids)
        self._send("gather", {"index": buf.index, "ids": list(block_ids)})
        return buf
