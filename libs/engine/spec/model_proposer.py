"""Drafting with a network: ``k`` autoregressive steps of a small model (or the target's
first layers), batched over every speculating sequence.

``DraftNetwork`` is the draft's forward, embeddings → layers → final norm → LM head: its
own checkpoint's model (``draft_model``) or the target's first layers (``self_draft``). Its head may be pruned to a draft vocabulary (libs/engine/spec/vocab.py);
its embeddings always take *target* ids, so each draft token is mapped to its target id
before it is fed back and before it is returned.

Where the draft's KV lives:

- ``self_draft`` shares the target's cache: its layers *are* the target's first layers, so
  their KV for every token the target has computed is already there; the draft writes its
  own positions (the slots the verify step will overwrite with the same layers' values).
- ``draft_model`` has its own cache, indexed by the target's block ids (one block table
  serves both models). A sequence's draft KV is valid for the leading tokens it has fed
  that the sequence still has; the rest (the prompt on first use, imported or prefix-cached
  blocks, tokens emitted by plain decode steps) is caught up in the first draft step, which
  is then a chunked prefill of the draft.

Each step runs through the target's attention backend. The first (mixed) one is laid out
by ``draft_step`` and runs eagerly; the others are decode steps (one token per sequence),
which replay CUDA graphs of the draft network when the engine captures them
(``enable_graphs``): they are laid out in the draft's own step staging as the target's
decode steps are (libs/engine/step_inputs.py, libs/engine/cuda_graphs.py), their input
ids copied on the device from the previous draft step's tokens. Draft tokens stay on the
device between steps; one host sync reads all of them at the end. A staging pack is
rewritten two steps after its upload, so on CUDA the host first waits for that upload's
event (the draft's steps are never read back in between).

Sampling: a greedy request's drafts are the draft's argmax (``q`` unused); a sampled
request's drafts are drawn from ``q = softmax(logits / T)`` with the request's own
generator, and ``q`` (mapped into the target vocabulary) goes to the rejection sampler.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from libs.engine.cuda_graphs import ForwardGraphs, graph_batch_sizes
from libs.engine.spec.proposer import DraftRequest, Drafts
from libs.engine.step_inputs import Layout, StepStaging
from libs.engine.spec.vocab import DraftVocab
from libs.model.attention import AttentionMetadata
from libs.model.cpu_linear import pack, packed_linear
from libs.model.llama import LlamaModel


class DraftNetwork(nn.Module):
    """A ``LlamaModel``'s first ``num_layers`` layers, its final norm, and an LM head that
    may be pruned to a draft vocabulary (then it outputs draft ids)."""

    def __init__(self, model: LlamaModel, num_layers: int, head_weight: torch.Tensor):
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.head_weight = head_weight  # [N or V, hidden]: pruned rows, or the model's head itself
        # Where the model runs its linears through oneDNN (libs/model/cpu_linear.py), so does
        # the draft head: the model's own packed head, or the pruned rows packed here.
        self.head_packed: torch.Tensor | None = None
        if model.packed_head is not None:
            own = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            self.head_packed = model.packed_head if head_weight is own else pack(head_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_packed is not None:
            return packed_linear(hidden, self.head_packed).float()
        return F.linear(hidden, self.head_weight).float()


class ModelProposer:
    def __init__(
        self,
        name: str,
        network: DraftNetwork,
        *,
        vocab: DraftVocab | None,
        block_size: int,
        device: torch.device,
        shares_target_cache: bool,
        bind=None,
    ):
        self.name = name
        self.network = network
        self.vocab = vocab.to(device) if vocab is not None else None
        self.block_size = block_size
        self.device = device
        self.shares_target_cache = shares_target_cache
        self._bind = bind or (lambda: None)  # points the network's layers at its cache
        self.graphs: ForwardGraphs | None = None  # decode-step graphs (enable_graphs)
        self.staging: StepStaging | None = None
        self._graph_width = 0
        self._uploads: deque = deque()  # CUDA events of the last two staging uploads
        # Own-cache drafts: (first position, target ids fed from there) per sequence.
        self._fed: dict[int, tuple[int, list[int]]] = {}
        self.num_forwards = 0
        self.num_catch_up_tokens = 0  # draft tokens computed beyond the one new token

    def forget(self, seq_id: int) -> None:
        self._fed.pop(seq_id, None)

    def draft_computed(self, seq) -> int:
        """Leading tokens of ``seq`` whose draft KV is valid."""
        if self.shares_target_cache:
            return seq.num_computed_tokens
        rec = self._fed.get(seq.seq_id)
        if rec is None:
            return 0
        base, fed = rec
        toks, valid = seq.token_ids, base
        for i, t in enumerate(fed):
            if base + i >= len(toks) or toks[base + i] != t:
                break
            valid = base + i + 1
        return min(valid, seq.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> Drafts:
        if not requests:
            return Drafts([])
        self._bind()
        B, K = len(requests), max(r.max_drafts for r in requests)
        seqs = [r.seq for r in requests]
        generators = [s.generator for s in seqs]
        greedy = [s.params.greedy for s in seqs]
        temps = torch.tensor([max(s.params.temperature, 1e-5) for s in seqs], device=self.device).unsqueeze(1)
        tokens = torch.zeros((B, K), dtype=torch.long, device=self.device)  # target ids
        probs: torch.Tensor | None = None if all(greedy) else torch.zeros((B, K, self._target_width), device=self.device)

        # Step 0: whatever the draft has not computed yet, ending with the last token.
        firsts = []
        for s in seqs:
            start = self.draft_computed(s)
            firsts.append((start, s.token_ids[start:]))
            self.num_catch_up_tokens += s.num_tokens - start - 1
        order = sorted(range(B), key=lambda i: len(firsts[i][1]) != 1)  # decode-shaped first
        rows = [(firsts[i][0], len(firsts[i][1]), seqs[i].block_table) for i in order]
        ids = torch.tensor([t for i in order for t in firsts[i][1]], dtype=torch.long, device=self.device)
        logits = torch.empty((B, self._draft_width), device=self.device)
        logits[torch.tensor(order, device=self.device)] = self._run(ids, *draft_step(rows, self.block_size, self.device))
        active = list(range(B))
        for j in range(K):
            draft_ids, q = self._sample(logits, [generators[i] for i in active], [greedy[i] for i in active], temps[active])
            target_ids = self.vocab.to_target_ids(draft_ids) if self.vocab is not None else draft_ids
            idx = torch.tensor(active, device=self.device)
            tokens[idx, j] = target_ids
            if q is not None:  # (None when every row still drafting is greedy)
                probs[idx, j] = self.vocab.to_target_probs(q) if self.vocab is not None else q
            active_next = [i for i in active if requests[i].max_drafts > j + 1]
            if not active_next:
                break
            keep = torch.tensor([active.index(i) for i in active_next], device=self.device)
            rows = [(seqs[i].num_tokens + j, 1, seqs[i].block_table) for i in active_next]
            logits = self._decode(target_ids[keep], rows)
            active = active_next

        drafts = [row[: r.max_drafts] for row, r in zip(tokens.tolist(), requests)]  # the host sync
        if not self.shares_target_cache:
            for (start, first), d, s in zip(firsts, drafts, seqs):
                self._fed[s.seq_id] = (start, [*first, *d[:-1]])
        return Drafts(drafts, probs)

    @property
    def _draft_width(self) -> int:
        return self.network.head_weight.shape[0]

    @property
    def _target_width(self) -> int:
        return self.vocab.target_vocab_size if self.vocab is not None else self._draft_width

    def enable_graphs(self, *, max_batch: int, width: int, emulate: bool = False) -> None:
        """Capture the draft's decode steps for batch sizes up to ``max_batch`` over block
        tables of ``width`` columns. ``emulate``: run their padded layouts eagerly (CPU)."""
        sizes = graph_batch_sizes(max_batch)
        self.staging = StepStaging(self.device, Layout(sizes[-1], sizes[-1], width).sizes())
        self._graph_width = width
        self._bind()
        self.graphs = ForwardGraphs(self.network, self.staging, self.device, width=width, block_size=self.block_size, emulate=emulate)
        self.graphs.capture(sizes, [], 0)

    def _decode(self, input_ids: torch.Tensor, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """A draft decode step (one token per row): a graph replay when one fits."""
        n = len(rows)
        if self.graphs is None or n > self.graphs.decode_sizes[-1]:
            return self._run(input_ids, *draft_step(rows, self.block_size, self.device))
        cap = next(s for s in self.graphs.decode_sizes if s >= n)
        layout = Layout(cap, cap, self._graph_width)
        if len(self._uploads) == 2:
            self._uploads.popleft().synchronize()  # that pack's copy is done: rewrite it
        pack, v = self.staging.host(layout)
        bs = self.block_size
        v.input_ids[:] = 0
        v.positions[:] = 0
        v.slot_mapping[:] = -1
        v.seq_lens[:] = 0
        v.block_tables[:] = 0
        for i, (pos, _, table) in enumerate(rows):
            v.block_tables[i, : len(table)] = table
            v.positions[i] = pos
            v.slot_mapping[i] = table[pos // bs] * bs + pos % bs
            v.seq_lens[i] = pos + 1
        dv = self.staging.upload(pack, layout, params=False)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._uploads.append(event)
        dv.input_ids[:n].copy_(input_ids)
        self.num_forwards += 1
        return self.graphs.replay("decode", cap, dv)[:n]

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor) -> torch.Tensor:
        """The draft's logits at each row's last token."""
        self.num_forwards += 1
        hidden = self.network(input_ids, positions, meta)
        return self.network.compute_logits(hidden.index_select(0, last))

    def _sample(self, logits: torch.Tensor, generators, greedy: list[bool], temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids (draft vocabulary) and, for sampled rows, ``q`` over the draft vocabulary."""
        if all(greedy):
            return logits.argmax(dim=-1), None
        q = torch.softmax(logits / temps, dim=-1)
        noise = torch.empty_like(q).exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:  # a seeded request's draws come from its own generator
                noise[i].exponential_(generator=gen)
        sampled = (q / noise).argmax(dim=-1)
        g = torch.tensor(greedy, device=logits.device)
        return torch.where(g, logits.argmax(dim=-1), sampled), q


def draft_step(rows: list[tuple[int, int, list[int]]], block_size: int, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Positions, attention metadata and the last token's row of each of ``rows`` (first
    position, tokens fed, block table), one-token rows first: a draft step."""
    bs, n = block_size, len(rows)
    num_decodes = next((i for i, r in enumerate(rows) if r[1] != 1), n)
    width = max(len(r[2]) for r in rows) or 1
    tables = np.zeros((n, width), dtype=np.int32)
    positions = np.concatenate([np.arange(start, start + m, dtype=np.int64) for start, m, _ in rows])
    slots = np.empty_like(positions)
    seq_lens = np.empty(n, dtype=np.int32)
    t = 0
    for i, (start, m, table) in enumerate(rows):
        tables[i, : len(table)] = table
        pos = positions[t : t + m]
        slots[t : t + m] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens[i] = start + m
        t += m
    lengths = np.asarray([m for _, m, _ in rows], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lengths[num_decodes:])]).astype(np.int32)
    move = (lambda a: torch.from_numpy(a)) if device.type == "cpu" else (lambda a: torch.from_numpy(a).pin_memory().to(device, non_blocking=True))
    meta = AttentionMetadata(
        slot_mapping=move(slots), block_tables=move(tables), seq_lens=move(seq_lens), query_start_loc=move(qsl),
        num_decodes=num_decodes, num_prefill_tokens=t - num_decodes, max_seq_len=int(seq_lens.max()),
    )
    return move(positions), meta, move(np.cumsum(lengths) - 1)
