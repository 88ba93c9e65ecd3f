"""Runs one scheduled step on the device: inputs, block copies and imports, forward, sampling.

The runner owns the model, the paged KV cache and the sampler. It turns a
``SchedulerOutput`` into flat tensors (token ids, positions, cache slots, block tables),
moves them to the device in one non-blocking transfer each, runs the model, and samples
the rows that need a token. Everything per-sequence stays on the host side of this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.swap import BlockSwapper, StagingBuffer, StagingStateError
from kernels.swap import reference as swap_reference
from libs.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from libs.engine.scheduler import SchedulerOutput
from libs.engine.sequence import KVImport, Sequence
from libs.model.attention import AttentionMetadata
from libs.model.llama import LlamaModel


@dataclass
class StepInputs:
    """Host-side inputs of one step; built fresh each step, never shared with the device side."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [P + 1] int32 over the prefill part
    logits_indices: torch.Tensor  # [S] int64, rows of the hidden states to sample from
    num_decodes: int
    num_prefill_tokens: int
    max_seq_len: int


class ModelRunner:
    def __init__(
        self, model: LlamaModel, cache: torch.Tensor, block_size: int, vocab_size: int, device: torch.device, swapper: BlockSwapper
    ):
        self.model = model
        self.cache = cache
        self.swapper = swapper
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(vocab_size, device)

    def _bind(self) -> None:
        # Several engines may share one loaded model (tests, benchmarks); the model's layers
        # must point at this runner's cache before it runs.
        if getattr(self.model, "kv_cache_owner", None) is not self:
            self.model.bind_kv_cache(self.cache)
            self.model.kv_cache_owner = self

    # -- inputs -------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, sample_counts: list[int]) -> StepInputs:
        """Flatten the scheduled sequences (decode-first) into step inputs on the host."""
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        qsl = [0]
        max_blocks = max((len(s.seq.block_table) for s in out.scheduled), default=1)
        tables = np.zeros((len(out.scheduled), max(max_blocks, 1)), dtype=np.int32)
        t = 0
        for i, s in enumerate(out.scheduled):
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
            tables[i, : len(seq.block_table)] = seq.block_table
            seq_lens.append(start + n)
            if i >= out.num_decodes:
                qsl.append(qsl[-1] + n)
            t += n
            logits_indices.extend([t - 1] * sample_counts[i])
        cat = np.concatenate if pos_chunks else (lambda _: np.zeros(0, dtype=np.int64))
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.from_numpy(cat(pos_chunks)),
            slot_mapping=torch.from_numpy(cat(slot_chunks)),
            block_tables=torch.from_numpy(tables),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
            num_decodes=out.num_decodes,
            num_prefill_tokens=t - out.num_decodes,
            max_seq_len=max(seq_lens, default=0),
        )

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return x
        return x.pin_memory().to(self.device, non_blocking=True)

    # -- execution ----------------------------------------------------------------------

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers) src → dst, e.g. a forked sequence's partial block."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.cache[dst] = self.cache[src]

    @torch.inference_mode()
    def import_blocks(self, imp: KVImport, rows: list[int], block_ids: list[int]) -> None:
        """Copy rows ``rows`` of an import's staging (a contiguous range) into ``block_ids``."""
        offset = 0
        for buf in imp.buffers:
            lo, hi = max(rows[0], offset), min(rows[-1] + 1, offset + buf.n)
            if lo < hi:
                ids = block_ids[lo - rows[0] : hi - rows[0]]
                if hi - lo == buf.n:
                    self.swapper.swap_in(buf, ids)
                else:  # only part of this buffer is needed (the rest was a local cache hit)
                    swap_reference.scatter_blocks(buf.host[lo - offset : hi - offset], ids, self.cache)
                    if self.device.type == "cuda":
                        torch.cuda.current_stream().synchronize()  # before the buffer is reused
            offset += buf.n

    def export_blocks(self, block_ids: list[int]) -> list[StagingBuffer] | None:
        """Gather blocks into staging buffers of the swapper, or None if not enough are
        free right now (nothing is held then; try again after others are released)."""
        step = self.swapper.max_blocks
        bufs: list[StagingBuffer] = []
        try:
            for i in range(0, len(block_ids), step):
                bufs.append(self.swapper.swap_out(block_ids[i : i + step]))
        except StagingStateError:
            for b in bufs:
                b.release()
            return None
        return bufs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model; return fp32 logits for ``inputs.logits_indices``."""
        self._bind()
        d = self._to_device
        meta = AttentionMetadata(
            slot_mapping=d(inputs.slot_mapping),
            block_tables=d(inputs.block_tables),
            seq_lens=d(inputs.seq_lens),
            query_start_loc=d(inputs.query_start_loc),
            num_decodes=inputs.num_decodes,
            num_prefill_tokens=inputs.num_prefill_tokens,
            max_seq_len=inputs.max_seq_len,
        )
        hidden = self.model(d(inputs.input_ids), d(inputs.positions), meta)
        return self.model.compute_logits(hidden[d(inputs.logits_indices)])

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        batch = SamplingBatch(
            params=[s.params for s in seqs],
            generators=[s.generator for s in seqs],
            prompt_ids=[s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs],
            output_ids=[s.output_token_ids if s.params.has_penalties else [] for s in seqs],
        )
        return self.sampler(logits, batch)
