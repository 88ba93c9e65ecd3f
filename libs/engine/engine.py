"""The engine: requests in, tokens out, one ``step()`` at a time.

``LLMEngine`` glues the scheduler, block manager, persistent batch and model runner
together (as nano-vllm's ``LLMEngine`` does) and keeps the step loop and the requests'
lifecycle; each other concept has its own module: the offline API ``LLM``
(libs/engine/llm.py), admission checks (libs/engine/validation.py), the steps in flight
and the batch's bookkeeping at launch (libs/engine/in_flight.py), output assembly
(libs/engine/outputs.py), PD export (libs/engine/kv_export.py; imports run as a step's
pre-ops, ``ModelRunner.import_all``), ``n > 1`` sampling (libs/engine/forks.py) and
grammars (libs/structured). It is driven from one thread (services drive it from a worker
thread, see ``AsyncEngine``); every public method validates its input and raises a typed
``InvalidRequestError`` before anything is queued.

A step has five host phases (libs/engine/step_timer.py): **schedule** (the scheduler's
changes), **prepare** (apply them to the persistent batch, libs/engine/input_batch.py,
and lay out the step's inputs, libs/engine/step_inputs.py), **launch** (hand the device
work to the device queue, libs/engine/device_queue.py, then advance the batch as if the
step had run: computed counts, one token in flight per sampled row,
libs/engine/in_flight.py), **sample** (wait for a step's sampled ids: the one host
sync) and **output** (append the ids, stop checks, request outputs).

Async scheduling (``EngineConfig.async_scheduling``) changes only which step's ids are
read: each call launches step N + 1 and then reads step N, so the device computes N + 1
while the host handles N's tokens, and step N + 1's input ids are what step N sampled,
gathered on the device. Corrections come one step late, as in vLLM's async scheduling:
a sequence that stopped on a token in step N was already in step N + 1, whose token for
it is discarded (never emitted); one that reached its length limit is retired at launch
and never scheduled again. Without async scheduling each call reads its own step.

Speculative decoding (``EngineConfig.speculative_config``, libs/engine/spec) needs each
step's tokens before the next is laid out, so it runs with synchronous scheduling only:
in ``_prepare`` the proposer drafts for the step's decoding rows, which the step then
verifies as chunks with a sample row per position; ``_process`` appends each sequence's
emitted burst, cut at its first stop, and ``SpecDecoder.settle`` rolls the rejected
positions' KV back.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable
from typing import Sequence as Seq

import numpy as np
import torch

from kernels.swap import BlockSwapper
from kernels.swap.heads import HeadSlice
from libs.engine.block_manager import BlockManager
from libs.engine.config import EngineConfig
from libs.engine.device_queue import DeviceQueue
from libs.engine.errors import DuplicateRequestError, InvalidRequestError
from libs.engine.forks import Forks
from libs.engine.input_batch import InputBatch
from libs.engine.kv_export import ExportQueue
from libs.engine.model_runner import ModelRunner, StepResult
from libs.engine.in_flight import InFlight
from libs.engine.outputs import RequestOutput, aborted_output, family_done, request_output
from libs.engine.params import SamplingParams
from libs.engine import prompt_logprobs
from libs.engine.sampler import logprob_lists
from libs.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from libs.engine.sequence import KVImport, Sequence, SequenceStatus
from libs.engine.spec import create_spec_decoder, parse_speculative_config
from libs.engine.step_inputs import Chunk, Step, StepBuilder
from libs.engine.validation import validate_request
from libs.engine.step_timer import HostPhases
from libs.engine.tp.group import JoinInfo, TensorParallelGroup
from libs.engine.tp.runner import TensorParallelRunner
from libs.kvpool.layout import KVLayout
from libs.model import LoadedModel, MoEOptions, load_model, make_backend
from libs.structured import CompiledGrammar, GrammarCompiler, GrammarMatcher, GrammarSpec
from libs.structured.bitmask import BitmaskFiller


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, join: JoinInfo | None = None):
        """``join``: this process is rank ``join.rank`` (not 0) of a tensor-parallel
        instance (libs/engine/tp); without it, ``tensor_parallel_size > 1`` makes this
        process rank 0, which starts the others."""
        self.config = config = config or EngineConfig()
        config.apply_threads()
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        self.spec_config = spec_cfg = parse_speculative_config(config.speculative_config)
        self.tp: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its own shard of the model: pass no LoadedModel")
            self.tp = TensorParallelGroup.join(config, join) if join is not None else TensorParallelGroup.start(config)
            device = self.tp.device
        # Ranks 1..N-1 only execute what rank 0 sends (libs/engine/tp/worker.py): no steps of
        # their own, so no async scheduling; their graphs are captured when rank 0's are.
        self.async_scheduling = config.resolve_async_scheduling(device) and join is None
        if loaded is None:
            loaded = load_model(
                config.model, dtype=dtype, device=device, backend=make_backend(config.attention_backend, device),
                quantized_weights=config.quantized_weights, quantization=config.quantization,
                moe=MoEOptions(strategy=config.moe_strategy, fake_balance=config.moe_fake_balance),
                cache_dir=Path(config.weight_cache_dir) if config.weight_cache_dir else None,
                tp=self.tp.group if self.tp is not None else None, packed_linears=config.packed_linears,
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_config = mc = loaded.config
        self.device, self.dtype = device, dtype
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # A pool block holds every KV head; this process's cache only the model's own
        # (all of them, except under tensor parallelism).
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, dtype)
        heads = HeadSlice(loaded.model.kv_heads[0], loaded.model.kv_heads[1] - loaded.model.kv_heads[0], mc.num_kv_heads, loaded.model.kv_written)
        cache_layout = dataclasses.replace(self.layout, num_kv_heads=heads.count)
        self.namespace = loaded.fingerprint.namespace(config.block_size)
        # Speculative decoding (libs/engine/spec): a draft checkpoint is loaded before the
        # cache is sized, and its own cache (same block ids) is budgeted with the target's.
        draft = draft_block_nbytes = None
        if spec_cfg is not None and spec_cfg.method == "draft_model":
            from libs.engine.spec.draft_model import draft_layout, load_draft

            draft = load_draft(spec_cfg.model, loaded, make_backend(config.attention_backend, device))
            draft_block_nbytes = draft_layout(draft, config.block_size).block_nbytes
        num_blocks = config.resolve_num_blocks(device, cache_layout.block_nbytes + (draft_block_nbytes or 0))
        if self.tp is not None:  # block ids must mean the same blocks on every rank
            self.tp.wait_loaded()
            num_blocks = self.tp.agree_min(num_blocks)
        cache = cache_layout.allocate(num_blocks, device)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.namespace, enable_prefix_caching=config.enable_prefix_caching)
        budget = config.resolve_batched_tokens(device, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=config.enable_chunked_prefill),
            self.block_manager,
        )
        max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        # Staging for PD handoff: exports (prefill) and imports (decode) move through here.
        # Under TP its rows are shared by the ranks, each moving its own heads of a block.
        host_buffers = None
        if self.tp is not None:
            host_buffers = self.tp.shared_staging((config.swap_max_blocks, *self.layout.block_shape), dtype, config.swap_buffers)
        self.swapper = BlockSwapper(
            cache, max_blocks=config.swap_max_blocks, num_buffers=config.swap_buffers, heads=heads, host_buffers=host_buffers,
            digests=config.swap_digests,
        )
        runner_args = (loaded.model, cache, config.block_size, mc.vocab_size, device, self.swapper)
        runner_kw = dict(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget, max_blocks_per_seq=max_blocks_per_seq)
        if self.tp is not None and self.tp.rank == 0:  # the other ranks run what this one sends
            self.runner: ModelRunner = TensorParallelRunner(*runner_args, tp=self.tp, **runner_kw)
        else:
            self.runner = ModelRunner(*runner_args, **runner_kw)
        self.batch = InputBatch(config.max_num_seqs, max_blocks_per_seq)
        self.builder = StepBuilder(self.batch, self.runner.staging, config.block_size, mc.vocab_size)
        self.exports = ExportQueue(self.block_manager, config.block_size, self.runner.export_blocks)
        self.forks = Forks(self.scheduler, self.block_manager, config.block_size)
        self.spec = None if spec_cfg is None else create_spec_decoder(
            spec_cfg, loaded=loaded, draft=draft, block_manager=self.block_manager, bind_target=self.runner._bind, device=device,
        )
        self._failed: list[RequestOutput] = []  # requests the engine failed alone (speculation)
        if device.type == "cuda" and config.cuda_graphs and loaded.model.layers[0].self_attn.backend.name == "triton" and join is None:
            self.enable_graphs()
        self.queue = DeviceQueue(device, asynchronous=self.async_scheduling)
        self._pre_ops: list = []  # device work for the next step (fork copies)
        self._in_flight = InFlight(
            self.batch, self.scheduler, self.forks, async_scheduling=self.async_scheduling,
            on_copy=lambda copy: self._pre_ops.append(lambda: self.runner.copy_blocks([copy])),
        )
        self.timer = self.runner.timer
        self.phases = HostPhases()
        # Called with each step right after its device work is enqueued (AsyncEngine tells
        # waiting requests: a service may then do its own Python work while the device runs).
        self.on_launch: Callable[[Step], None] | None = None
        self.vocab_size = mc.vocab_size
        self.bitmasks = BitmaskFiller(mc.vocab_size)
        self._grammars: GrammarCompiler | None = None
        self._requests: dict[str, list[Sequence]] = {}
        self._params: dict[str, SamplingParams] = {}
        self._aborted: list[str] = []
        self._finished_early: list[str] = []
        self._capturing = 0  # sequences waiting for their first logits to be kept
        torch.manual_seed(config.seed)
        # Counters (read by metrics).
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_discarded_tokens = 0  # sampled one step past a stop (async scheduling)

    @property
    def num_prompt_tokens_computed(self) -> int:
        return self._in_flight.num_prompt_tokens_computed

    def enable_graphs(self, *, emulate: bool = False) -> None:
        """Capture the decode and prefill graphs (on at start on CUDA). ``emulate`` runs
        their padded layouts eagerly instead, on any device (tests)."""
        cfg = self.config
        budget = self.scheduler.config.max_num_batched_tokens
        g = self.runner.enable_graphs(
            max_batch=min(cfg.max_num_seqs, cfg.graph_max_batch),
            prefill_max_tokens=min(cfg.prefill_graph_max_tokens, budget),
            prefill_seqs=cfg.max_num_seqs,
            emulate=emulate,
        )
        b = self.builder
        b.decode_graph_sizes, b.prefill_graph_tokens, b.graph_seqs, b.graph_width = g.decode_sizes, g.prefill_tokens, g.prefill_seqs, g.width
        draft_graphs = getattr(self.spec.proposer, "enable_graphs", None) if self.spec is not None else None
        if draft_graphs is not None:  # a drafting network's decode steps (libs/engine/spec/model_proposer.py)
            draft_graphs(max_batch=min(cfg.max_num_seqs, cfg.graph_max_batch), width=g.width, emulate=emulate)
            self.runner._bind()

    # -- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams, *, num_output_tokens: int = 0) -> None:
        """Raise a typed error if the request cannot be served (libs/engine/validation.py). Nothing is queued."""
        validate_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=self.config.block_size, num_blocks=self.block_manager.num_blocks, num_output_tokens=num_output_tokens,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        output_prefix: Seq[int] = (),
        kv_import: KVImport | None = None,
        export_kv: bool = False,
        grammar: GrammarMatcher | None = None,
        stream_export: bool = False,
    ) -> None:
        """Queue a request.

        ``output_prefix``: tokens already generated elsewhere (decode continues after the
        prefill's first token). ``kv_import``: KV of the leading blocks loaded from the
        pool. ``export_kv``: gather the prompt's KV when the request finishes (prefill);
        with ``stream_export`` its full blocks are handed out as chunks complete them
        (libs/engine/kv_export.py). ``grammar``: constrain the output (structured
        outputs); a fresh matcher from :meth:`start_grammar` that has already accepted
        ``output_prefix``.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already running", param="request_id")
        prompt = list(prompt_token_ids)
        self.validate(prompt + list(output_prefix) if output_prefix else prompt, params, num_output_tokens=len(output_prefix))
        if output_prefix and params.n != 1:
            raise InvalidRequestError("n must be 1 when continuing from an output prefix", param="n")
        seq = self._new_sequence(request_id, 0, prompt, params)
        for t in output_prefix:
            seq.append_token(t, None)
        seq.new_token_ids.clear()
        seq.pending_forks = params.n - 1
        if kv_import is not None and prompt_logprobs.needs_scoring(seq):
            kv_import.release()  # a scored prompt is computed, not loaded
            kv_import = None
        seq.kv_import = kv_import
        seq.export_kv = export_kv
        seq.grammar = grammar
        if export_kv and stream_export:
            self.exports.stream(seq)
        self._requests[request_id] = [seq]
        self._params[request_id] = params
        reason = seq.check_stop(self.max_model_len) if output_prefix else None
        if reason is not None:
            # The prefix already ends the request (max_tokens 1, or the first token is EOS):
            # nothing to compute; report it at the next step.
            if kv_import is not None:
                kv_import.release()
            self.scheduler.finish(seq, reason)
            self._finished_early.append(request_id)
            return
        self.scheduler.add(seq)

    # -- structured outputs -------------------------------------------------------------

    @property
    def grammars(self) -> GrammarCompiler:
        """This engine's grammar compiler (cached compiles; built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size)
        return self._grammars

    def start_grammar(self, grammar: GrammarSpec | CompiledGrammar, replay: Seq[int] = ()) -> GrammarMatcher:
        """A fresh grammar state for a request, advanced by ``replay`` (tokens generated
        before: prefill's first token, a resumed stream's output). Raises ``GrammarError``
        (a malformed spec) or ``GrammarMismatchError`` (replayed tokens that do not follow)."""
        return self.grammars.start(grammar, replay)

    def _new_sequence(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> Sequence:
        child_params = params.for_child(index) if params.n > 1 else params
        seq = Sequence(request_id, index, prompt, child_params, eos_token_ids=self.tokenizer.eos_token_ids)
        seq.max_len = min(seq.max_len, self.max_model_len)
        if child_params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(child_params.seed % (2**64))
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed immediately. Tokens it has
        in flight are discarded when they come back."""
        if request_id not in self._requests:
            return False
        if request_id in self._aborted:  # aborted already; reported at the next step
            return True
        family = self._requests[request_id]
        self._drop_family(family)
        self._aborted.append(request_id)
        return True

    def _drop_family(self, family: list[Sequence]) -> None:
        """Abort a request's sequences: blocks freed, rows and exports and draft state dropped."""
        for seq in self.scheduler.abort(family):
            if seq.batch is not None:
                self.batch.remove(seq)
        for seq in family:
            self.exports.discard(seq)
            if self.spec is not None:
                self.spec.forget(seq)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """End one request with an error (its blocks are freed now, reported at the end of
        this step with finish reason ``error``); the engine goes on with the others."""
        family = self._requests.get(request_id)
        if family is None or request_id in self._aborted:
            return
        self._drop_family(family)
        for seq in family:
            seq.finish_reason = "error"
        out = self._aborted_output(request_id)
        for c in out.outputs:
            c.finish_reason = "error"
        out.error = f"{type(error).__name__}: {error}"
        self._failed.append(out)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched whose ids are not read yet (async scheduling: up to two)."""
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, read one step's tokens back (this one, or with
        async scheduling the one before). Returns what each request produced."""
        outputs = self._step()
        for o in outputs:
            if o.finished:
                self._requests.pop(o.request_id, None)
                self._params.pop(o.request_id, None)
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = [self._aborted_output(rid) for rid in self._aborted]
        outputs += [self._request_output(rid) for rid in self._finished_early if rid in self._requests]
        self._aborted, self._finished_early = [], []
        outputs.extend(self._drain_exports())
        touched: dict[str, None] = {}
        forward = 0.0
        newest = self._in_flight.newest
        if newest is not None and newest.bitmask is not None:
            # Structured outputs: a grammar's next mask depends on the token in flight, so
            # that token is read before anything else is scheduled (no overlap for them).
            forward, _ = self._read(touched, outputs)
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        t2 = t3 = t1
        launched = not out.is_empty
        if launched:
            step, pre_ops = self._prepare(out)
            t2 = time.perf_counter()
            if step.num_tokens:
                self._in_flight.launch(step, self.queue.submit(lambda: self.runner.execute(step, pre_ops)))
                if self.on_launch is not None:
                    self.on_launch(step)
            else:  # drafting failed every request of the step: nothing left to run
                self._pre_ops[:0] = pre_ops
                launched = False
            t3 = time.perf_counter()
            if launched:
                self._key_chunks(step)
        touched.update((s.request_id, None) for s in out.preempted)
        t4 = t5 = t3
        if self._in_flight and (not self.async_scheduling or len(self._in_flight) > 1 or not launched):
            forward, t4 = self._read(touched, outputs)
        outputs.extend(self._request_output(rid) for rid in touched if rid in self._requests)
        if self._failed:
            outputs.extend(self._failed)
            self._failed = []
        t5 = time.perf_counter()
        if launched or forward:
            self.phases.record(
                {"schedule": t1 - t0, "prepare": t2 - t1, "launch": t3 - t2, "sample": t4 - t3, "output": t5 - t4, "forward": forward, "step": t5 - t0}
            )
        return outputs

    def _key_chunks(self, step: Step) -> None:
        """The prefix-cache keys of the full blocks this step's prompt chunks cover, hashed
        while the GPU runs the step (admission looked up only as far as the cache hit, and
        ``commit`` publishes them when the step's ids are read)."""
        if self.block_manager.enable_prefix_caching:
            for c in step.chunks:
                if not c.verify:
                    self.block_manager.update_keys(c.seq)

    def _read(self, touched: dict[str, None], outputs: list[RequestOutput]) -> tuple[float, float]:
        """Wait for the oldest step in flight and process its ids (streamed KV pieces it
        completed go to ``outputs``). Returns its forward time and when its ids were on
        the host."""
        done, pending = self._in_flight.pop()
        try:
            res = pending.result()
        except BaseException:
            self._fail_in_flight(done)
            raise
        synced = time.perf_counter()
        self._process(done, res, touched)
        if done.chunks and self.exports.streaming:
            # PD streamed export: hand out the full blocks this step's chunks completed
            # (the step's KV is in the cache; a sequence preempted since has no blocks).
            outputs.extend(
                self.exports.export_completed_blocks(
                    (c.seq, c.start + c.num_tokens) for c in done.chunks if c.seq.status is SequenceStatus.RUNNING and not c.verify
                )
            )
        self.num_steps += 1
        return res.forward_s, synced

    def _prepare(self, out: SchedulerOutput) -> tuple[Step, list]:
        """Apply the scheduler's changes to the batch; lay out the step."""
        b = self.batch
        pre_ops, self._pre_ops = self._pre_ops, []
        for seq in out.preempted:
            if seq.batch is not None:
                b.remove(seq)
        if out.imports:
            imports = list(out.imports)
            pre_ops.append(lambda: self.runner.import_all(imports))
        now = time.monotonic()
        chunks: list[Chunk] = []
        new_decodes: list[Sequence] = []
        admitted = set(map(id, out.admitted))
        for c in out.chunks:
            seq = c.seq
            if id(seq) in admitted:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
                slot = b.add(seq, decode=c.is_decode)
                self._init_slot(seq, slot, pre_ops, last_token=c.is_decode)
            if c.is_decode:
                new_decodes.append(seq)
                continue
            children: list[Sequence] = []
            if c.num_samples > 1:  # n > 1: the siblings are sampled from this row
                for _ in range(seq.pending_forks):
                    child = self.forks.spawn(seq, self._requests[seq.request_id], self._params[seq.request_id], self._new_sequence)
                    self._init_slot(child, b.add(child, decode=False), pre_ops, last_token=False)
                    children.append(child)
                seq.pending_forks = 0
            chunks.append(Chunk(seq, seq.num_computed_tokens, c.num_tokens, c.num_samples, children))
        for seq in out.grown:
            if seq.batch is not None:
                b.sync_blocks(seq)
        num_decodes, leave = out.num_decodes, set(map(id, out.skipped))
        spec = self._propose(out, admitted) if self.spec is not None else None
        if spec is not None:
            if spec.failed:  # those requests left the batch
                chunks = [c for c in chunks if not c.seq.is_finished]
                num_decodes = b.num_decodes - len(out.skipped)
            leave.update(map(id, spec.seqs))  # they verify, as chunks
        if leave:
            rows = np.asarray([r for r, s in enumerate(b.decode_seqs) if id(s) not in leave], dtype=np.int64)
            num_decodes = len(rows)
        else:
            rows = slice(0, b.num_decodes)
        if spec is not None and spec.seqs:
            chunks = [
                Chunk(s, s.num_computed_tokens, 1 + len(d), 1 + len(d), [], token_ids=[s.token_ids[-1], *d], verify=True)
                for s, d in zip(spec.seqs, spec.drafts)
            ] + chunks
        step = self.builder.build(self.scheduler.step - 1, rows, num_decodes, chunks)
        step.decode_rows, step.new_decodes = rows, new_decodes
        if spec is not None and spec.seqs:
            step.spec = self.spec.verification(spec, num_decodes)
        if self._capturing:
            step.captures = [i for i, s in enumerate(step.sample_seqs) if s.capture_logits and s.captured_logits is None]
        if any(c.seq.params.prompt_logprobs is not None for c in chunks):
            step.prompt_rows = prompt_logprobs.plan(((c.seq, c.start, c.num_tokens) for c in chunks), first_row=step.num_decodes)
            step.score_spans = prompt_logprobs.spans(step.prompt_rows)
        if b.num_constrained:
            rows_c = [i for i, s in enumerate(step.sample_seqs) if s.grammar is not None]
            if rows_c:  # masks filled on a host thread while the forward is launched
                step.bitmask = (rows_c, self.bitmasks.submit([step.sample_seqs[i].grammar for i in rows_c]))
        return step, pre_ops

    def _propose(self, out: SchedulerOutput, admitted: set[int]):
        """Speculation's drafts for this step's decoding rows (libs/engine/spec/verify.py);
        requests whose drafting failed are failed here and leave the step."""
        spec = self.spec
        for seq in out.preempted:  # their blocks are gone, and with them any draft KV
            spec.forget(seq)
        skipped = set(map(id, out.skipped))
        candidates = [s for s in self.batch.decode_seqs if id(s) not in skipped and id(s) not in admitted and s.grammar is None]
        budget = self.scheduler.config.max_num_batched_tokens - out.num_batched_tokens
        step = spec.propose(candidates, budget)
        for rid, error in step.failed:
            self._fail_request(rid, error)
        for seq in step.seqs:
            self.batch.sync_blocks(seq)
        return step

    def _init_slot(self, seq: Sequence, slot: int, pre_ops: list, *, last_token: bool) -> None:
        """Device state of a sequence joining the batch: its last token when its first step
        decodes it, its penalty state when it has penalties (queued before the step)."""
        state = self.runner.state
        if last_token:
            token = seq.token_ids[-1]
            pre_ops.append(lambda: state.set_last(slot, token))
        if seq.params.has_penalties:
            prompt, output = list(seq.prompt_token_ids), list(seq.output_token_ids)
            pre_ops.append(lambda: state.init_penalties(slot, prompt, output))

    def _process(self, step: Step, res: StepResult, touched: dict[str, None]) -> None:
        """A step's ids are on the host: append them, check stops, commit full blocks."""
        self.timer.account(res.timing)
        prompt_logprobs.record(step.prompt_rows, res.prompt_scores)
        tokens = res.tokens.tolist()
        lps: dict[int, object] = {}
        if res.logprobs is not None:
            picked = [tokens[i] for i in step.logprob_samples]
            lps = dict(zip(step.logprob_samples, logprob_lists(res.logprobs, picked, step.logprob_ks)))
        if res.captured:
            for i, logits in zip(step.captures, res.captured):
                seq = step.sample_seqs[i]
                if seq.captured_logits is None:
                    seq.captured_logits = logits.float()
                    self._capturing -= 1
        bs = self.config.block_size
        caching = self.block_manager.enable_prefix_caching
        if caching:  # the chunks' full blocks join the prefix cache, finished or not
            for c in step.chunks:
                if c.seq.block_table:
                    self.block_manager.commit(c.seq)
        now = time.monotonic()
        generated = 0
        for i, (seq, t) in enumerate(zip(step.sample_seqs, tokens)):
            if t < 0:  # a verify position past its sequence's emitted burst (PLACEHOLDER)
                continue
            if seq.status is SequenceStatus.FINISHED:  # stopped or aborted one step back (or earlier in its burst)
                self.num_discarded_tokens += 1
                continue
            seq.token_ids.append(t)
            seq.new_token_ids.append(t)
            if seq.batch is None:
                seq.num_pending -= 1
            if lps:
                lp = lps.get(i)
                if lp is not None:
                    seq.logprobs.append(lp)
                    seq.new_logprobs.append(lp)
            generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            touched[seq.request_id] = None
            if caching and len(seq.token_ids) // bs > seq.num_committed_blocks and seq.block_table:
                self.block_manager.commit(seq)
            if seq.grammar is not None and not seq.grammar.accept(t):
                self._finish(seq, "error")  # cannot happen: the mask allowed it
            elif seq.grammar is not None or t in seq.stop_ids or len(seq.token_ids) >= seq.max_len:
                reason = seq.check_stop(self.max_model_len)
                if reason is not None:
                    self._finish(seq, reason)
        self.num_generated_tokens += generated
        if step.spec is not None:
            self._settle(step, tokens, res.spec_error)

    def _settle(self, step: Step, tokens: list[int], error: BaseException | None) -> None:
        """A verify step's sequences, after their bursts were appended."""
        if error is not None:
            self.spec.num_prepare_errors += 1
        row = step.num_decodes
        for c in step.chunks:
            if not c.verify:
                break
            if error is not None:
                self._fail_request(c.seq.request_id, error)
            else:
                emitted = sum(1 for t in tokens[row : row + c.num_tokens] if t >= 0)
                self.spec.settle(c.seq, emitted, c.num_tokens - 1, self.batch, self.scheduler)
            row += c.num_tokens

    def _fail_in_flight(self, failed: Step) -> None:
        """A step's device work raised: every request with a sequence in a step that will
        not come back is aborted (reported at the next step), then the error propagates."""
        if self.spec is not None:
            self.spec.drain()
        steps = self._in_flight.drain(failed)
        victims = {s.request_id for st in steps for s in st.sample_seqs} | {c.seq.request_id for st in steps for c in st.chunks}
        for rid in victims:
            self.abort_request(rid)

    def close(self) -> None:
        """Stop the device queue's worker and free staging (the engine is unusable afterwards)."""
        self.queue.close()
        self.bitmasks.close()
        if self.spec is not None:
            self.spec.close()
        self.swapper.close()
        self.runner.release_graphs()  # before any process group its graphs captured goes
        if self.tp is not None:
            self.tp.close()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.forget(seq)
        if seq.batch is not None:
            self.batch.remove(seq)
        if seq.export_kv and seq.index == 0:
            self.exports.add(seq)  # the request finishes once its prompt's KV is gathered
            return
        self.block_manager.free(seq)

    def _drain_exports(self) -> list[RequestOutput]:
        done = self.exports.drain()
        return [self._request_output(s.request_id) for s in done if s.request_id in self._requests and family_done(self._requests[s.request_id])]

    @property
    def num_pending_exports(self) -> int:
        return len(self.exports)

    def capture_first_logits(self, seq: Sequence) -> None:
        """Keep the fp32 logits of ``seq``'s next sampled row (tests, debugging)."""
        seq.capture_logits = True
        self._capturing += 1

    def _request_output(self, request_id: str) -> RequestOutput:
        return request_output(request_id, self._requests[request_id], self.exports)

    def _aborted_output(self, request_id: str) -> RequestOutput:
        self._params.pop(request_id, None)
        return aborted_output(request_id, self._requests.pop(request_id, []))
