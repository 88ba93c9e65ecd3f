"""Runs one step on the device: its inputs' copy, the forward, sampling, the ids' copy back.

The runner owns the model, the paged KV cache, the sampler, the staging swapper, the
step staging and (on CUDA) the captured graphs. ``execute(step)`` is the device work of
one step, submitted through the device queue (libs/engine/device_queue.py); it reads
only the step (immutable) and device state that steps update in order:

- ``SlotState``: per device slot (one per running sequence, libs/engine/input_batch.py),
  the last sampled token, which the next step gathers as its input id, and, when some
  request uses penalties, its output-token counts and prompt-token mask. Sampling writes
  them, so a step never waits for the host to learn what the previous one sampled.
- the KV cache.

The one thing that comes back to the host is the sampled ids (and requested logprobs),
copied into pinned memory at the end of the step; ``StepResult.event`` marks when they
have landed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.swap import BlockSwapper, StagingBuffer, StagingStateError
from libs.engine.cuda_graphs import ForwardGraphs, graph_batch_sizes, prefill_token_buckets
from libs.engine.prompt_logprobs import PromptLogprobs, score
from libs.engine.sampler import Sampler, SamplingTensors
from libs.engine.sequence import KVImport
from libs.engine.step_inputs import Layout, PackViews, Step, StepStaging
from libs.engine.step_timer import StepTimer
from libs.model.llama import LlamaModel


def to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """An int64 list on ``device`` without a stream sync (a copy from pageable memory
    would wait for the stream; pinned memory does not)."""
    t = torch.tensor(ids, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass
class StepResult:
    """What a step hands back: on the host (pinned) once ``event`` has completed."""

    tokens: torch.Tensor  # [S] int64
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    captured: list[torch.Tensor] | None
    event: "torch.Event | None" = None
    forward_s: float = 0.0  # host time in the forward (launches on CUDA, compute on the CPU)
    timing: tuple = (None, None)  # the step's CUDA events (StepTimer)
    spec_error: BaseException | None = None  # the verification's inputs failed (libs/engine/spec)
    prompt_scores: list[PromptLogprobs] | None = None  # of ``Step.prompt_rows``, on the host


class SlotState:
    """Device state of each batch slot, grown as slots are added (in step order)."""

    def __init__(self, device: torch.device, vocab_size: int):
        self.device = device
        self.vocab_size = vocab_size
        self.last_sampled = torch.zeros(64, dtype=torch.long, device=device)
        self.counts: torch.Tensor | None = None  # [slots, V] float32: output token counts
        self.prompt_seen: torch.Tensor | None = None  # [slots, V] bool

    def reserve(self, num_slots: int) -> None:
        cap = self.last_sampled.shape[0]
        if num_slots <= cap:
            return
        new = max(num_slots, 2 * cap)
        self.last_sampled = torch.cat([self.last_sampled, self.last_sampled.new_zeros(new - cap)])
        if self.counts is not None:
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - cap, self.vocab_size)])
            self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(new - cap, self.vocab_size)])

    def init_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Counts and prompt mask of a sequence joining the batch (penalty requests only)."""
        V, slots = self.vocab_size, self.last_sampled.shape[0]
        if self.counts is None:
            self.counts = torch.zeros(slots, V, dtype=torch.float32, device=self.device)
            self.prompt_seen = torch.zeros(slots, V, dtype=torch.bool, device=self.device)
        self.counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        out = to_device([t for t in output_ids if t < V], self.device)
        if out.numel():
            self.counts[slot].index_add_(0, out, torch.ones(out.numel(), device=self.device))
        prompt = to_device([t for t in prompt_ids if t < V], self.device)
        if prompt.numel():
            self.prompt_seen[slot].index_fill_(0, prompt, True)

    def set_last(self, slot: int, token: int) -> None:
        # fill_ takes the token as a kernel argument; ``last_sampled[slot] = token`` copies
        # it from pageable memory and waits for the stream (behind a PD import: ~0.6 ms).
        self.last_sampled[slot : slot + 1].fill_(token)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sampled ``tokens`` of distinct ``slots``: the next step's input ids, and counted."""
        self.last_sampled.index_copy_(0, slots, tokens)
        self.count(slots, tokens)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add ``tokens`` (times ``weights``, default 1) to their slots' output counts."""
        if self.counts is not None:
            w = torch.ones(tokens.shape[0], dtype=self.counts.dtype, device=self.device) if weights is None else weights
            self.counts.index_put_((slots, tokens), w, accumulate=True)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, cache: torch.Tensor, block_size: int, vocab_size: int, device: torch.device,
        swapper: BlockSwapper, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, max_blocks_per_seq: int = 1,
    ):
        self.model = model
        self.cache = cache
        self.swapper = swapper
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(vocab_size, device)
        self.state = SlotState(device, vocab_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        sizes = Layout(max_num_batched_tokens, max_num_seqs, max_blocks_per_seq, 2 * max_num_seqs, 64, 2 * max_num_seqs).sizes()
        self.staging = StepStaging(device, sizes)
        self.graphs: ForwardGraphs | None = None
        self.timer = StepTimer(device)
        # A step's sampled ids land in pinned buffer ``index & 1``, and its event of the same
        # parity says when: at most two steps are in flight (libs/engine/device_queue.py),
        # so a step's buffer and event are free again by the time the step after next
        # launches (a fresh ``torch.cuda.Event`` a step cost ~15 us of host time).
        self._out = [torch.empty(1024, dtype=torch.long, pin_memory=True) for _ in range(2)] if device.type == "cuda" else []
        self._out_events = [torch.Event(device) for _ in range(2)] if device.type == "cuda" else []

    def _bind(self) -> None:
        # Several engines may share one loaded model (tests, benchmarks); the model's layers
        # must point at this runner's cache before it runs.
        if getattr(self.model, "kv_cache_owner", None) is not self:
            self.model.bind_kv_cache(self.cache)
            self.model.kv_cache_owner = self

    def enable_graphs(self, max_batch: int, prefill_max_tokens: int, prefill_seqs: int, *, emulate: bool = False) -> ForwardGraphs:
        """Capture decode graphs for batch sizes up to ``max_batch`` and prefill graphs for
        token counts up to ``prefill_max_tokens`` (0: none) over ``prefill_seqs`` sequences.
        The device packs are resized first so every graph's views stay put. ``emulate``:
        no capture, the graph layouts run eagerly (libs/engine/cuda_graphs.py)."""
        self._bind()
        W = self.max_blocks_per_seq
        decode = graph_batch_sizes(max_batch) if max_batch > 0 else []
        prefill = prefill_token_buckets(prefill_max_tokens) if prefill_max_tokens > 0 else []
        if emulate and self.staging.device_packs is None:
            # An emulated graph must read what a captured one reads, the device packs, so
            # the CPU gets them too (a copy per step): a step whose inputs do not land
            # there then shows up on the CPU as it would on the GPU.
            self.staging.set_device_packs(tuple(torch.zeros(1, dtype=dt, device=self.device) for dt in (torch.int64, torch.int32, torch.float32)))
        if self.staging.device_packs is not None:
            layouts = [ForwardGraphs.decode_layout(b, W) for b in decode] + [ForwardGraphs.prefill_layout(t, prefill_seqs, W) for t in prefill]
            # Room for the sampling part behind the forward inputs of any graph layout (a
            # verify step, libs/engine/spec, samples at every one of its tokens).
            room = [
                Layout(L.tokens, L.seqs, L.width, max(4 * L.seqs, L.tokens), max(256, 2 * L.tokens), 4 * L.seqs, max(4 * L.seqs, L.tokens)).sizes()
                for L in layouts
            ]
            current = tuple(p.numel() for p in self.staging.device_packs)
            want = tuple(max([c, *(r[i] for r in room)]) for i, c in enumerate(current))
            self.staging.set_device_packs(tuple(torch.zeros(n, dtype=p.dtype, device=self.device) for n, p in zip(want, self.staging.device_packs)))
        self.graphs = ForwardGraphs(self.model, self.staging, self.device, width=W, block_size=self.block_size, emulate=emulate, greedy=self.sampler.greedy)
        self.graphs.capture(decode, prefill, prefill_seqs)
        return self.graphs

    def release_graphs(self) -> None:
        """Destroy the captured graphs (``ForwardGraphs.release``): before the process group
        whose collectives they captured is destroyed. Steps run eagerly afterwards."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # -- KV movement ------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers) src → dst, e.g. a forked sequence's partial block."""
        if copies:
            src = to_device([c[0] for c in copies], self.device)
            dst = to_device([c[1] for c in copies], self.device)
            self.cache[dst] = self.cache[src]

    def import_all(self, imports: list[tuple[KVImport, list[int], list[int]]]) -> None:
        """A step's PD imports (the scheduler's ``(import, rows, block ids)``), each
        import's staging released once its rows are in the cache, or on failure."""
        for imp, rows, blocks in imports:
            try:
                self.import_blocks(imp, rows, blocks)
            finally:
                imp.release()

    @torch.inference_mode()
    def import_blocks(self, imp: KVImport, rows: list[int], block_ids: list[int]) -> None:
        """Copy rows ``rows`` of an import's staging (a contiguous range) into ``block_ids``."""
        offset = 0
        for buf in imp.buffers:
            lo, hi = max(rows[0], offset), min(rows[-1] + 1, offset + buf.n)
            if lo < hi:
                # Only part of a buffer may be needed (the rest was a local cache hit); the
                # buffer's event orders its reuse after this copy.
                self._swap_in(buf, block_ids[lo - rows[0] : hi - rows[0]], lo - offset)
            offset += buf.n

    def _swap_in(self, buf: StagingBuffer, block_ids: list[int], first_row: int) -> None:
        self.swapper.swap_in(buf, block_ids, first_row=first_row)

    def export_blocks(self, block_ids: list[int], num_tokens: list[int] | None = None) -> list[StagingBuffer] | None:
        """Gather blocks into staging buffers of the swapper, or None if not enough are
        free right now (nothing is held then; try again after others are released).
        ``num_tokens`` (per block): their pool digests too, where the swapper computes them."""
        step = self.swapper.max_blocks
        bufs: list[StagingBuffer] = []
        try:
            for i in range(0, len(block_ids), step):
                bufs.append(self._swap_out(block_ids[i : i + step], None if num_tokens is None else num_tokens[i : i + step]))
        except StagingStateError:
            for b in bufs:
                b.release()
            return None
        return bufs

    def _swap_out(self, block_ids: list[int], num_tokens: list[int] | None) -> StagingBuffer:
        return self.swapper.swap_out(block_ids, num_tokens)

    # -- the step -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: Step, pre_ops: list[Callable[[], None]]) -> StepResult:
        """One step's device work, in order: ``pre_ops`` (imports, new slots' state, fork
        copies), the inputs' copy, the forward, sampling, and the ids' copy to the host."""
        self._bind()
        self.state.reserve(step.num_slots)
        for op in pre_ops:
            op()
        started = self.timer.start()
        v = self.staging.upload(step.pack, step.layout, params=step.params)
        t = time.perf_counter()
        scores: list[PromptLogprobs] | None = [] if step.prompt_rows else None
        logits = self._forward(step, v, scores)
        forward_s = time.perf_counter() - t
        st = self._sampling_tensors(step, v)
        spec_error = None
        if step.spec is None:
            samples = self.sampler.sample(logits, st, greedy=self._graph_greedy(step))
            self.state.record(v.sample_slots, samples.tokens)
        else:  # speculative verification (libs/engine/spec/verify.py): records its own state
            samples, spec_error = step.spec.sample(self.sampler, self.state, logits, st, v.sample_slots)
        captured = [logits[i].float().clone() for i in step.captures] if step.captures else None
        result = self._to_host(samples.tokens, samples.logprobs, captured, step.index)
        result.forward_s = forward_s
        result.spec_error = spec_error
        result.timing = (started, self.timer.stop())
        result.prompt_scores = scores
        return result

    def _graph_greedy(self, step: Step) -> torch.Tensor | None:
        """The argmax of the step's rows that its decode graph computed, or None (no graph)."""
        if step.path != "decode_graph" or self.graphs is None:
            return None
        tokens = self.graphs.greedy_tokens(step.layout.seqs)
        return None if tokens is None else tokens[: step.num_decodes]

    def _forward(self, step: Step, v: PackViews, scores: list[PromptLogprobs] | None = None) -> torch.Tensor:
        """fp32 logits of the sampled rows, ``[S, vocab]``."""
        nd = step.num_decodes
        if nd:  # decode rows feed what the last step sampled for them
            torch.index_select(self.state.last_sampled, 0, v.decode_slots[:nd], out=v.input_ids[:nd])
        return self.forward_pass(step, v, scores)

    def forward_pass(self, step: Step, v: PackViews, scores: list[PromptLogprobs] | None = None) -> torch.Tensor:
        """The forward on inputs in place (``v``, input ids included): the logits of the
        sampled rows. Under tensor parallelism every rank runs this on the same inputs
        (libs/engine/tp: ``step`` is then a ``ForwardPlan``, the fields read here). The
        step's ``score_spans`` (prompt logprobs) go through the LM head on every rank;
        ``scores`` (rank 0's) receives their results."""
        nd = step.num_decodes
        if step.path == "decode_graph":
            return self.graphs.replay("decode", step.layout.seqs, v)[:nd]  # type: ignore[union-attr]
        if step.path == "prefill_graph":
            hidden = self.graphs.replay("prefill", step.layout.tokens, v)  # type: ignore[union-attr]
        else:
            meta = v.metadata(nd, step.num_tokens - nd, step.max_seq_len, step.num_verify_tokens)
            meta.query_start_loc = v.query_start_loc[: step.num_prefill_seqs + 1]
            hidden = self.model(v.input_ids, v.positions, meta)
            if step.num_samples == step.num_tokens == nd:  # decode only: every row is sampled
                return self.model.compute_logits(hidden)
        if step.score_spans:
            out = score(hidden, step.score_spans, self.model.compute_logits, self.sampler.vocab_size, step.prompt_rows)
            if scores is not None:
                scores.extend(out)
        return self.model.compute_logits(hidden.index_select(0, v.logits_indices))

    def _sampling_tensors(self, step: Step, v: PackViews) -> SamplingTensors:
        st = SamplingTensors(
            temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, min_p=v.min_p,
            presence=v.presence, frequency=v.frequency, repetition=v.repetition,
            all_greedy=step.all_greedy, any_greedy=step.any_greedy, any_top_k=step.any_top_k,
            any_top_p=step.any_top_p, any_min_p=step.any_min_p, any_penalties=step.any_penalties,
            any_repetition=step.any_repetition,
        )
        if step.any_penalties:
            st.counts = self.state.counts.index_select(0, v.sample_slots)  # type: ignore[union-attr]
            if step.any_repetition:
                st.prompt_seen = self.state.prompt_seen.index_select(0, v.sample_slots)  # type: ignore[union-attr]
        if step.layout.bans:
            st.ban = (v.ban_rows, v.ban_cols)
        if step.layout.biases:
            st.bias = (v.bias_rows, v.bias_cols, v.bias_vals)
        if step.bitmask is not None:  # filled on a host thread while the forward was launched
            rows, masks = step.bitmask
            host = masks.result()
            st.bitmask = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
            st.bitmask_rows = to_device(rows, self.device)
        if step.generators:
            st.generators = step.generators
        if step.logprob_samples:
            st.logprob_rows = v.logprob_rows
            st.max_logprobs = step.max_logprobs
        return st

    def _to_host(self, tokens: torch.Tensor, lp, captured, index: int) -> StepResult:
        if self.device.type != "cuda":
            return StepResult(tokens, lp, captured)
        S = tokens.shape[0]
        k = index & 1
        if self._out[k].shape[0] < S:
            self._out[k] = torch.empty(2 * S, dtype=torch.long, pin_memory=True)
        out = self._out[k][:S]
        out.copy_(tokens, non_blocking=True)
        host = lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)  # noqa: E731
        lp = tuple(host(t) for t in lp) if lp is not None else None
        captured = [host(t) for t in captured] if captured else None
        event = self._out_events[k]
        event.record()
        return StepResult(out, lp, captured, event)
