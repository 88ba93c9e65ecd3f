"""The offline API: whole prompts in, finished results out (``tidepool generate``, tests).

``LLM`` is the step engine (``LLMEngine``) plus loops that drive it to completion, as in
nano-vllm, where ``LLM`` wraps ``LLMEngine``. Services drive ``LLMEngine`` directly from a
worker thread (libs/engine/async_engine.py) and never use these loops.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence as Seq

import torch

from libs.engine.engine import LLMEngine
from libs.engine.errors import InvalidRequestError
from libs.engine.outputs import GenerationResult
from libs.engine.params import SamplingParams
from libs.structured import GrammarSpec


class LLM(LLMEngine):
    """An ``LLMEngine`` with blocking ``generate``/``stream`` loops over its ``step()``."""

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]] | None = None,
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]] | None = None,
        grammar: GrammarSpec | None = None,
    ) -> list[GenerationResult]:
        """Run prompts (text or token ids) or chat conversations to completion, batched.

        Returns one result per prompt and per sample (``n``), in input order. All inputs
        are validated before any is queued. ``grammar`` constrains every output to it
        (structured outputs; a malformed one raises ``GrammarError``).
        """
        token_lists = self._encode_inputs(prompts, messages)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(token_lists)
        else:
            params_list = list(params)
            if len(params_list) != len(token_lists):
                raise InvalidRequestError("params must be one SamplingParams or one per prompt", param="params")
        for ids, p in zip(token_lists, params_list):
            self.validate(ids, p)
        compiled = self.grammars.compile(grammar) if grammar is not None else None
        ids_by_req: dict[str, int] = {}
        for i, (ids, p) in enumerate(zip(token_lists, params_list)):
            rid = f"generate-{id(self)}-{time.monotonic_ns()}-{i}"
            self.add_request(rid, ids, p, grammar=self.start_grammar(compiled) if compiled is not None else None)
            ids_by_req[rid] = i
        collected: dict[str, dict[int, GenerationResult]] = {rid: {} for rid in ids_by_req}
        scored: dict[str, Any] = {}
        while any(rid in self._requests for rid in ids_by_req):
            for o in self.step():
                if o.request_id not in collected:
                    continue
                if o.prompt_logprobs is not None:
                    scored[o.request_id] = o.prompt_logprobs
                for c in o.outputs:
                    r = collected[o.request_id].setdefault(
                        c.index, GenerationResult(token_lists[ids_by_req[o.request_id]], [], "", "", [], o.num_cached_tokens, c.index)
                    )
                    r.token_ids.extend(c.new_token_ids)
                    r.logprobs.extend(c.new_logprobs)
                    if c.finish_reason:
                        r.finish_reason = c.finish_reason
        results = []
        for rid in ids_by_req:
            for idx in sorted(collected[rid]):
                r = collected[rid][idx]
                r.text = self.tokenizer.decode(r.token_ids)
                r.prompt_logprobs = scored.get(rid)
                results.append(r)
        return results

    def first_step_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[vocab]`` for the token after the prompt, computed through the
        normal request path (scheduler, cache, batching): what tests compare with a
        reference implementation."""
        rid = f"logits-{id(self)}-{time.monotonic_ns()}"
        self.add_request(rid, prompt_token_ids, SamplingParams(temperature=0, max_tokens=1))
        seq = self._requests[rid][0]
        self.capture_first_logits(seq)
        while rid in self._requests:
            self.step()
        return seq.captured_logits[: self.vocab_size]

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        """Yield new token ids of one request as they are produced (used by the CLI)."""
        rid = f"stream-{id(self)}-{time.monotonic_ns()}"
        self.add_request(rid, prompt_token_ids, params)
        try:
            while rid in self._requests:
                for o in self.step():
                    if o.request_id == rid:
                        if o.error is not None:
                            raise RuntimeError(f"the engine failed the request: {o.error}")
                        for c in o.outputs:
                            if c.new_token_ids:
                                yield c.new_token_ids
        finally:
            if rid in self._requests:
                self.abort_request(rid)
                self.step()

    def _encode_inputs(self, prompts: Any, messages: Any) -> list[list[int]]:
        if (prompts is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompts or messages")
        if messages is not None:
            convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
            return [self.tokenizer.encode_chat(c) for c in convs]
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}", param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, (list, tuple)):
                out.append(list(p))
            else:
                raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}", param="prompt")
        return out
