"""The engine: requests in, tokens out, one ``step()`` at a time.

``LLMEngine`` glues the scheduler, block manager and model runner together (as nano-vllm's
``LLMEngine`` does); the offline API over it is ``LLM`` (libs/engine/llm.py), PD export is
libs/engine/kv_export.py and ``n > 1`` sampling libs/engine/forks.py. It is synchronous
and single-threaded by design (services drive it from a worker thread, see
``AsyncEngine``); every public method validates its input and raises a typed
``InvalidRequestError`` before anything is queued.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence as Seq

import torch

from kernels.swap import BlockSwapper
from libs.engine.async_runner import AsyncRunner
from libs.engine.block_manager import BlockManager
from libs.engine.config import EngineConfig
from libs.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError, TokenOutOfRangeError
from libs.engine.forks import Forks
from libs.engine.inputs import StepInputs, StepPlan, build_inputs
from libs.engine.kv_export import ExportQueue
from libs.engine.model_runner import ModelRunner
from libs.engine.outputs import CompletionOutput, RequestOutput
from libs.engine.step_timer import StepTimer
from libs.engine.params import SamplingParams
from libs.engine import prompt_logprobs
from libs.engine.scheduler import Scheduler, SchedulerConfig
from libs.engine.sequence import KVImport, Sequence
from libs.structured import CompiledGrammar, GrammarCompiler, GrammarMatcher, GrammarSpec
from libs.structured.bitmask import BitmaskFiller
from libs.kvpool.layout import KVLayout
from libs.model import LoadedModel, MoEOptions, load_model, make_backend


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        config.apply_threads()
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        if loaded is None:
            loaded = load_model(
                config.model, dtype=dtype, device=device, backend=make_backend(config.attention_backend, device),
                quantized_weights=config.quantized_weights, quantization=config.quantization,
                moe=MoEOptions(strategy=config.moe_strategy, fake_balance=config.moe_fake_balance),
                cache_dir=Path(config.weight_cache_dir) if config.weight_cache_dir else None,
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_config = mc = loaded.config
        self.device, self.dtype = device, dtype
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, dtype)
        self.namespace = loaded.fingerprint.namespace(config.block_size)
        num_blocks = self._num_blocks(device)
        cache = self.layout.allocate(num_blocks, device)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.namespace, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.resolve_batched_tokens(device, self.max_model_len),
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        # Staging for PD handoff: exports (prefill) and imports (decode) move through here.
        self.swapper = BlockSwapper(cache, max_blocks=config.swap_max_blocks, num_buffers=config.swap_buffers)
        self.runner = ModelRunner(loaded.model, cache, config.block_size, mc.vocab_size, device, self.swapper)
        self.exports = ExportQueue(self.block_manager, config.block_size, self.runner.export_blocks)
        self.forks = Forks(self.scheduler, self.block_manager, self.runner.copy_blocks, config.block_size)
        if device.type == "cuda" and config.cuda_graphs and loaded.model.layers[0].self_attn.backend.name == "triton":
            self.runner.enable_cuda_graphs(
                max_batch=min(config.max_num_seqs, config.graph_max_batch),
                max_blocks_per_seq=-(-self.max_model_len // config.block_size),
            )
        self._prepare = AsyncRunner("prepare-inputs") if config.resolve_async_prepare(device) else None
        self._ahead: tuple[StepPlan, StepInputs, torch.Tensor] | None = None
        self.timer = StepTimer(device)
        self.prepared_ahead_hits = 0
        self.prepared_ahead_misses = 0
        self.vocab_size = mc.vocab_size
        self.bitmasks = BitmaskFiller(mc.vocab_size)
        self._grammars: GrammarCompiler | None = None
        self._requests: dict[str, list[Sequence]] = {}
        self._params: dict[str, SamplingParams] = {}
        self._aborted: list[str] = []
        self._finished_early: list[str] = []
        torch.manual_seed(config.seed)
        # Counters (read by metrics).
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0

    def _num_blocks(self, device: torch.device) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * 2**30
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * cfg.gpu_memory_utilization
        else:
            budget = 2**30
        return max(16, int(budget // self.layout.block_nbytes))

    # -- requests -----------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams, *, num_output_tokens: int = 0) -> None:
        """Raise a typed error if the request cannot be served. Nothing is queued."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", param="params")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)]
        if bad:  # (a list, not next(..., None): None itself is a bad token)
            raise TokenOutOfRangeError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise TokenOutOfRangeError(f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="logit_bias")
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise TokenOutOfRangeError(f"stop token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="stop_token_ids")
        # ``prompt_token_ids`` may end with ``num_output_tokens`` already generated (an
        # output prefix): they count toward max_tokens, not on top of it.
        n_total = len(prompt_token_ids)
        n_prompt = n_total - num_output_tokens
        if n_total >= self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n_total}",
                param="prompt",
            )
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{n_prompt + params.max_tokens} ({n_prompt} in the prompt, {params.max_tokens} to generate)",
                param="max_tokens",
            )
        needed = -(-self.max_model_len // self.config.block_size) if params.max_tokens is None else -(-(n_prompt + params.max_tokens) // self.config.block_size)
        if needed > self.block_manager.num_blocks:
            raise PromptTooLongError(
                f"the request needs up to {needed} KV blocks but the cache holds {self.block_manager.num_blocks}",
                param="max_tokens",
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
        self.validate(list(prompt_token_ids) + list(output_prefix), params, num_output_tokens=len(output_prefix))
        if output_prefix and params.n != 1:
            raise InvalidRequestError("n must be 1 when continuing from an output prefix", param="n")
        seq = self._new_sequence(request_id, 0, list(prompt_token_ids), params)
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
        reason = self._stop_reason(seq) if output_prefix else None
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
        compiled = grammar if isinstance(grammar, CompiledGrammar) else self.grammars.compile(grammar)
        matcher = compiled.matcher()
        matcher.replay(replay)
        return matcher

    def _stop_reason(self, seq: Sequence) -> str | None:
        """Why ``seq`` stops after its last token: the usual reasons, or a complete grammar."""
        reason = seq.check_stop(self.max_model_len)
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            reason = "stop"
        return reason

    def _new_sequence(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> Sequence:
        child_params = params.for_child(index) if params.n > 1 else params
        seq = Sequence(request_id, index, prompt, child_params, eos_token_ids=self.tokenizer.eos_token_ids)
        if child_params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(child_params.seed % (2**64))
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed immediately."""
        if request_id not in self._requests:
            return False
        self.scheduler.abort(request_id)
        for seq in self._requests[request_id]:
            self.exports.discard(seq)
        self._aborted.append(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step. Returns what each request produced."""
        outputs = self._step()
        for o in outputs:
            if o.finished:
                self._requests.pop(o.request_id, None)
                self._params.pop(o.request_id, None)
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs = [self._aborted_output(rid) for rid in self._aborted]
        outputs += [self._request_output(rid) for rid in self._finished_early if rid in self._requests]
        self._aborted, self._finished_early = [], []
        outputs.extend(self._drain_exports())
        out = self.scheduler.schedule()
        if out.is_empty:
            return outputs
        now = time.monotonic()
        sample_seqs: list[Sequence] = []
        forks: list[tuple[Sequence, Sequence]] = []
        counts: list[int] = []
        for s in out.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
            counts.append(s.num_samples)
            if s.num_samples:
                sample_seqs.append(s.seq)
                for _ in range(s.seq.pending_forks):
                    child = self.forks.spawn(s.seq, self._requests[s.seq.request_id], self._params[s.seq.request_id], self._new_sequence)
                    forks.append((s.seq, child))
                    sample_seqs.append(child)
                s.seq.pending_forks = 0

        self._import(out.imports)
        plan = StepPlan.from_schedule(out, counts, self.config.block_size)
        inputs, input_ids = self._inputs_for(plan)
        scoring = prompt_logprobs.plan((s.seq, s.seq.num_computed_tokens, s.num_tokens) for s in out.scheduled)
        constrained = [row for row, seq in enumerate(sample_seqs) if seq.grammar is not None]
        # Grammar masks are filled on a host thread while the device runs the forward pass.
        masks = self.bitmasks.submit([sample_seqs[row].grammar for row in constrained]) if constrained else None
        self.timer.start()
        try:
            logits, scores = self.runner.forward(inputs, input_ids, scoring)
        finally:
            bitmask = masks.result() if masks is not None else None
        samples = self.runner.sample(logits, sample_seqs, (constrained, bitmask) if constrained else None) if sample_seqs else None
        self.timer.stop()
        predicted = plan.next_decode() if self._prepare is not None and samples is not None else None
        if predicted is not None:
            # The device is busy with this step: build the next one's inputs meanwhile.
            self._prepare.submit(build_inputs, predicted, self.device)
        try:
            sampled = self.runner.sampler.collect(samples) if samples is not None else None
            self.num_steps += 1
            for row, seq in enumerate(sample_seqs):
                if seq.capture_logits and seq.captured_logits is None:
                    seq.captured_logits = logits[row].float().cpu()
        finally:
            ahead = self._prepare.sync() if predicted is not None else None  # re-raises its errors
        self._ahead = (predicted, ahead, samples.tokens) if ahead is not None else None
        self.timer.account()

        prompt_logprobs.record(scoring, scores)
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            self.block_manager.commit(s.seq)
            if s.seq.num_computed_tokens <= s.seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += s.num_tokens
        # PD streamed export: hand out the blocks this step's chunks completed.
        outputs.extend(self.exports.export_completed_blocks(s.seq for s in out.scheduled))
        for parent, child in forks:
            self.forks.attach(parent, child)
        touched: dict[str, None] = {}
        if sampled is not None:
            now = time.monotonic()
            for seq, tok, lp in zip(sample_seqs, sampled.token_ids, sampled.logprobs):
                if seq.is_finished:  # a child that could not be attached
                    continue
                seq.append_token(tok, lp)
                self.num_generated_tokens += 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if seq.grammar is not None and not seq.grammar.accept(tok):
                    self._finish(seq, "error")  # cannot happen: the mask allowed it
                    touched[seq.request_id] = None
                    continue
                reason = self._stop_reason(seq)
                if reason is not None:
                    self._finish(seq, reason)
                touched[seq.request_id] = None
        for seq in out.preempted:
            touched.setdefault(seq.request_id, None)
        outputs.extend(self._request_output(rid) for rid in touched if rid in self._requests)
        return outputs

    def _inputs_for(self, plan: StepPlan) -> tuple[StepInputs, torch.Tensor]:
        """This step's inputs: the ones built ahead if the prediction held, else fresh."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and plan.matches(ahead[0]):
            self.prepared_ahead_hits += 1
            return ahead[1], ahead[2]
        if ahead is not None:
            self.prepared_ahead_misses += 1
        inputs = build_inputs(plan, self.device)
        return inputs, inputs.input_ids

    def close(self) -> None:
        """Stop the helper thread and free staging (the engine is unusable afterwards)."""
        if self._prepare is not None:
            self._prepare.close()
        self.bitmasks.close()
        self.swapper.close()

    def _import(self, imports: list) -> None:
        for imp, rows, blocks in imports:
            try:
                self.runner.import_blocks(imp, rows, blocks)
            finally:
                imp.release()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.export_kv and seq.index == 0:
            self.exports.add(seq)  # the request finishes once its prompt's KV is gathered
            return
        self.block_manager.free(seq)

    def _drain_exports(self) -> list[RequestOutput]:
        done = self.exports.drain()
        return [self._request_output(s.request_id) for s in done if s.request_id in self._requests and self._all_done(s.request_id)]

    def _all_done(self, request_id: str) -> bool:
        family = self._requests[request_id]
        return all(s.is_finished and not s.export_pending for s in family) and family[0].pending_forks == 0

    @property
    def num_pending_exports(self) -> int:
        return len(self.exports)

    def _request_output(self, request_id: str) -> RequestOutput:
        family = self._requests[request_id]
        outs = []
        for seq in family:
            ids, lps = seq.take_new()
            if ids or seq.is_finished:
                outs.append(CompletionOutput(seq.index, ids, lps, seq.finish_reason, seq.num_output_tokens))
        head = family[0]
        finished = self._all_done(request_id)
        metrics = {}
        if head.first_scheduled_time is not None:
            metrics["queue_s"] = head.first_scheduled_time - head.arrival_time
        if head.first_token_time is not None:
            metrics["ttft_s"] = head.first_token_time - head.arrival_time
        return RequestOutput(
            request_id,
            outs,
            finished,
            head.num_prompt_tokens,
            head.num_cached_tokens,
            head.num_imported_tokens,
            self.exports.result(head) if finished else None,
            metrics,
            prompt_logprobs.take_complete(head),
        )

    def _aborted_output(self, request_id: str) -> RequestOutput:
        family = self._requests.pop(request_id, [])
        self._params.pop(request_id, None)
        head = family[0] if family else None
        outs = [CompletionOutput(s.index, *s.take_new(), "abort", s.num_output_tokens) for s in family]
        return RequestOutput(request_id, outs, True, head.num_prompt_tokens if head else 0, head.num_cached_tokens if head else 0)
