"""Runs one step on the device: block imports and copies, the forward pass, sampling.

The runner owns the model, the paged KV cache, the sampler, the staging swapper and
(on CUDA) the decode CUDA graphs. Inputs come from ``libs.engine.inputs`` (built from an
immutable ``StepPlan``, possibly ahead of time on another thread); the runner only
launches work. Reading sampled tokens back is the caller's single host sync per step.
"""

from __future__ import annotations

import torch

from kernels.swap import BlockSwapper, StagingBuffer, StagingStateError
from kernels.swap import reference as swap_reference
from libs.engine.cuda_graphs import DecodeGraphs
from libs.engine.inputs import StepInputs
from libs.engine.prompt_logprobs import PromptLogprobs, PromptRows, score
from libs.engine.sampler import DeviceSamples, Sampler, SamplingBatch
from libs.engine.sequence import KVImport, Sequence
from libs.model.attention import AttentionMetadata
from libs.model.llama import LlamaModel


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
        self.graphs: DecodeGraphs | None = None

    def _bind(self) -> None:
        # Several engines may share one loaded model (tests, benchmarks); the model's layers
        # must point at this runner's cache before it runs.
        if getattr(self.model, "kv_cache_owner", None) is not self:
            self.model.bind_kv_cache(self.cache)
            self.model.kv_cache_owner = self

    def enable_cuda_graphs(self, max_batch: int, max_blocks_per_seq: int) -> None:
        """Capture the decode forward for batch sizes up to ``max_batch`` (CUDA only)."""
        self._bind()
        self.graphs = DecodeGraphs(self.model, self.device, max_batch=max_batch, max_blocks_per_seq=max_blocks_per_seq, block_size=self.block_size)
        self.graphs.capture()

    # -- KV movement ------------------------------------------------------------------------

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

    # -- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, input_ids: torch.Tensor, prompt_rows: list[PromptRows] = ()) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """Run the model (a captured graph when one fits); fp32 logits of the sampled rows,
        and the scores of ``prompt_rows`` (libs/engine/prompt_logprobs.py)."""
        self._bind()
        if not prompt_rows and self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs, input_ids), []
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc,
            num_decodes=inputs.num_decodes,
            num_prefill_tokens=inputs.num_prefill_tokens,
            max_seq_len=inputs.max_seq_len,
        )
        hidden = self.model(input_ids, inputs.positions, meta)
        scores = score(hidden, prompt_rows, self.model.compute_logits, self.sampler.vocab_size) if prompt_rows else []
        return self.model.compute_logits(hidden[inputs.logits_indices]), scores

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: tuple[list[int], torch.Tensor] | None = None) -> DeviceSamples:
        """Sample one token per sequence; ``bitmask``: (constrained rows, their grammar masks)."""
        batch = SamplingBatch(
            params=[s.params for s in seqs],
            generators=[s.generator for s in seqs],
            prompt_ids=[s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs],
            output_ids=[s.output_token_ids if s.params.has_penalties else [] for s in seqs],
            banned_ids=[s.min_tokens_banned() for s in seqs],
            bitmask_rows=bitmask[0] if bitmask is not None else None,
            bitmask=bitmask[1] if bitmask is not None else None,
        )
        return self.sampler.sample(logits, batch)
