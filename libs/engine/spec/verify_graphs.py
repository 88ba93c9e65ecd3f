"""CUDA graphs of the speculative step: the verify forward and the draft's decode steps.

A verify batch where every sequence feeds its last token and ``k`` drafts is ``B`` chunks
of exactly ``Q = k + 1`` query tokens with logits at every position: a fixed shape per
batch size, so ``VerifyGraphs`` captures it once per size as ``DecodeGraphs`` does a
decode step (the Triton prefill kernel lays out its query tiles without a host sync, so it
captures). Padding rows write nothing (slot -1). Steps of another shape
(plain decodes in the same batch, a sequence with fewer drafts, prefill chunks) run
eagerly. With the model-based proposers every speculating sequence has ``k`` drafts except
near ``max_tokens``, so this is the steady state of a decode instance.

The draft's steps after its first are single-token decode steps of the draft network:
``DecodeGraphs`` captures them over the network as it does over the target.
"""

from __future__ import annotations

import torch

from libs.engine.cuda_graphs import DecodeGraphs
from libs.engine.inputs import StepInputs
from libs.model.attention import AttentionMetadata


class VerifyGraphs(DecodeGraphs):
    def __init__(self, model, device: torch.device, *, num_query_tokens: int, max_batch: int, max_blocks_per_seq: int, block_size: int):
        super().__init__(model, device, max_batch=max_batch, max_blocks_per_seq=max_blocks_per_seq, block_size=block_size)
        self.Q = num_query_tokens
        T = self.max_batch * self.Q
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.positions = torch.zeros(T, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device) * self.Q
        # Padding rows: Q queries over Q keys of whatever blocks their table rows name (valid
        # ids, finite values), writing nothing; a length of 0 would make them 0/0 in the
        # prefill kernel (harmless to real rows, but NaN has no business in a graph).
        self.seq_lens.fill_(self.Q)

    def _num_tokens(self, bs: int) -> int:
        return bs * self.Q

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * self.Q],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            num_decodes=0,
            num_prefill_tokens=bs * self.Q,
            max_seq_len=self.max_blocks * self.block_size,
            num_verify_tokens=bs * self.Q,
        )

    def can_run(self, inputs: StepInputs) -> bool:
        n = inputs.block_tables.shape[0]
        return (
            inputs.num_decodes == 0
            and 0 < n <= self.max_batch
            and inputs.num_verify_tokens == inputs.num_prefill_tokens == n * self.Q
            and inputs.max_blocks <= self.max_blocks
        )

    def run(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        n = inputs.block_tables.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        t = n * self.Q
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:t].copy_(inputs.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        self.block_tables[:n, : inputs.max_blocks].copy_(inputs.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[t : bs * self.Q].fill_(-1)
            self.seq_lens[n:bs].fill_(self.Q)
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[bs][:t]


def enable_spec_graphs(runner, spec, *, max_batch: int, max_blocks_per_seq: int) -> None:
    """Capture the verify forward on ``runner`` and the draft network's decode steps."""
    runner._bind()
    runner.verify_graphs = VerifyGraphs(
        runner.model, runner.device, num_query_tokens=spec.config.k + 1, max_batch=max_batch,
        max_blocks_per_seq=max_blocks_per_seq, block_size=runner.block_size,
    )
    runner.verify_graphs.capture()
    proposer = spec.proposer
    if getattr(proposer, "network", None) is not None:
        proposer._bind()
        proposer.graphs = DecodeGraphs(proposer.network, runner.device, max_batch=max_batch, max_blocks_per_seq=max_blocks_per_seq, block_size=runner.block_size)
        proposer.graphs.capture()
        runner._bind()
