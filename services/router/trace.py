"""The handoff trace of one request: what happened where, how long it took, what moved.

The router records its own decisions and timings (tokenizing, the prefill decision and
call, each decode attempt with its time to first event, resumptions) and merges what the
instances report: ``PrefillResult`` (byte and block counts, ``timings``, ``trace``) and the
``trace`` on decode's final ``TokenEvent``. The router always asks instances for their
traces, so every request is logged in one line and feeds the metrics; the client gets the
whole trace only when it asks (``"tidepool": {"trace": true}``).

Worker traces are free-form maps (services/prefill and services/decode write them). The
router reads these top-level keys and ignores anything else, or of another type:

=======================  =====================================================
``pool_hit_blocks``      blocks loaded from the pool (int)
``pool_miss_reasons``    blocks not loaded, by reason (``{"absent": 2}``)
``bytes_read``           KV bytes read from the pool (int)
``*_s``                  durations in seconds (prefill's also from
                         ``PrefillResult.timings``): ``queue_s``, ``compute_s``,
                         ``load_s``, ``write_s`` (prefill); ``queue_s``,
                         ``load_s``, ``decode_s`` (decode)
=======================  =====================================================

Totals (``RequestTrace.totals``) sum over prompts, choices and attempts. ``transfer_s``
is all pool time (prefill's ``load_s`` and ``write_s``, decode's ``load_s``); a handoff's
latency, for the metric, is the pool time not overlapped with prefill's compute: prefill's
``write_s`` (its writes after compute ended) plus, for the decode that took over from it,
``load_tail_s`` (its loads after prefill's result, in a streamed handoff) or ``load_s``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from libs.protocol.messages import PrefillResult


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None


@dataclass
class WorkerNumbers:
    """What the router understands of one instance's trace."""

    hit_blocks: int = 0
    miss_reasons: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, trace: dict[str, Any] | None, timings: dict[str, float] | None = None) -> "WorkerNumbers":
        out = cls(timings={k: v for k, v in (timings or {}).items() if _number(v) is not None})
        if not trace:
            return out
        hits = trace.get("pool_hit_blocks")
        out.hit_blocks = hits if type(hits) is int and hits >= 0 else 0
        misses = trace.get("pool_miss_reasons")
        if isinstance(misses, dict):
            out.miss_reasons = {str(r): n for r, n in misses.items() if type(n) is int and n > 0}
        read = trace.get("bytes_read")
        out.bytes_read = read if type(read) is int and read >= 0 else 0
        for key, value in trace.items():
            if key.endswith("_s") and _number(value) is not None:
                out.timings.setdefault(key, float(value))
        return out


@dataclass
class PrefillTrace:
    """The prefill decision of one prompt and, when it ran, its result."""

    decision: str = ""
    reason: str | None = None
    instance: str | None = None
    request_id: str | None = None
    call_s: float | None = None
    called_at: float | None = None  # wall clock when the call started: comparable with the instances' stamps on one host
    pool_query: dict[str, Any] | None = None
    result: PrefillResult | None = None

    def summary(self) -> str:
        """``prefill-1`` when it ran, else the decision and why: ``skip_short_prompt(5 < 32 tokens)``."""
        if self.decision == "prefill":
            return self.instance or "prefill"
        where = f"{self.instance}:" if self.instance else ""
        return f"{where}{self.decision or 'undecided'}" + (f"({self.reason})" if self.reason else "")

    @property
    def numbers(self) -> WorkerNumbers:
        if self.result is None:
            return WorkerNumbers()
        return WorkerNumbers.read(self.result.trace, self.result.timings)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"decision": self.decision}
        for name in ("reason", "instance", "request_id", "pool_query"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.call_s is not None:
            out["call_s"] = round(self.call_s, 6)
        if self.called_at is not None:
            out["called_at"] = self.called_at
        r = self.result
        if r is not None:
            out.update(
                num_cached_tokens=r.num_cached_tokens,
                num_computed_tokens=r.num_computed_tokens,
                bytes_written=r.bytes_written,
                blocks_written=r.blocks_written,
                blocks_failed=r.blocks_failed,
                lease_id=r.lease_id,
                timings=r.timings,
                worker=r.trace,
            )
        return out


@dataclass
class AttemptTrace:
    """One decode stream of one choice (a resumption is a further attempt)."""

    instance: str
    request_id: str
    tokens_before: int  # completion tokens the choice had when this attempt started (1: prefill's first token)
    with_first_token: bool
    streamed: bool = False  # started before prefill's result (await_handoff)
    started: float = field(default_factory=time.perf_counter)
    outcome: str = "running"
    first_event_s: float | None = None
    seconds: float | None = None
    tokens: int = 0
    num_cached_tokens: int = 0
    worker: dict[str, Any] | None = None
    updates: int = 0  # HandoffUpdates forwarded to decode (streamed attempts)

    @property
    def numbers(self) -> WorkerNumbers:
        return WorkerNumbers.read(self.worker)

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "request_id": self.request_id,
            "tokens_before": self.tokens_before,
            "with_first_token": self.with_first_token,
            "streamed": self.streamed,
            "handoff_updates": self.updates,
            "outcome": self.outcome,
            "first_event_s": None if self.first_event_s is None else round(self.first_event_s, 6),
            "seconds": None if self.seconds is None else round(self.seconds, 6),
            "tokens": self.tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "worker": self.worker,
        }


@dataclass
class PromptTrace:
    index: int
    prompt_tokens: int
    prefill: PrefillTrace = field(default_factory=PrefillTrace)
    choices: dict[int, list[AttemptTrace]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "prefill": self.prefill.to_dict(),
            "choices": [
                {"index": i, "attempts": [a.to_dict() for a in attempts]} for i, attempts in sorted(self.choices.items())
            ],
        }


@dataclass
class Totals:
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_failed: int = 0
    blocks_hit: int = 0
    blocks_missed: Counter[str] = field(default_factory=Counter)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    resumptions: int = 0
    handoffs_s: list[float] = field(default_factory=list)  # write_s + load_s of each handoff

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "blocks_written": self.blocks_written,
            "blocks_failed": self.blocks_failed,
            "blocks_hit": self.blocks_hit,
            "blocks_missed": dict(self.blocks_missed),
            "queue_s": round(self.queue_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "transfer_s": round(self.transfer_s, 6),
            "decode_s": round(self.decode_s, 6),
            "resumptions": self.resumptions,
        }


@dataclass
class RequestTrace:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.perf_counter)
    tokenize_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    prompts: list[PromptTrace] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def totals(self) -> Totals:
        t = Totals()
        for p in self.prompts:
            pre = p.prefill.numbers
            r = p.prefill.result
            if r is not None:
                t.bytes_written += r.bytes_written
                t.blocks_written += r.blocks_written
                t.blocks_failed += r.blocks_failed
                t.prefill_s += pre.timings.get("compute_s", p.prefill.call_s or 0.0)
            self._add_pool(t, pre)
            write_s = pre.timings.get("write_s")
            t.transfer_s += pre.timings.get("load_s", 0.0)
            for attempts in p.choices.values():
                t.resumptions += max(0, len(attempts) - 1)
                for n, a in enumerate(attempts):
                    dec = a.numbers
                    self._add_pool(t, dec)
                    t.decode_s += dec.timings.get("decode_s", a.seconds or 0.0)
                    load_s = dec.timings.get("load_s")
                    t.transfer_s += load_s or 0.0
                    exposed = dec.timings.get("load_tail_s", load_s)  # streamed: after prefill's result
                    if n == 0 and r is not None and (write_s is not None or exposed is not None):
                        t.handoffs_s.append((write_s or 0.0) + (exposed or 0.0))
            t.transfer_s += write_s or 0.0
        return t

    @staticmethod
    def _add_pool(t: Totals, numbers: WorkerNumbers) -> None:
        t.bytes_read += numbers.bytes_read
        t.blocks_hit += numbers.hit_blocks
        t.blocks_missed.update(numbers.miss_reasons)
        t.queue_s += numbers.timings.get("queue_s", 0.0)

    def to_dict(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v, 6)

        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "router": {"tokenize_s": ms(self.tokenize_s), "ttft_s": ms(self.ttft_s), "total_s": ms(self.total_s)},
            "totals": self.totals().to_dict(),
            "prompts": [p.to_dict() for p in self.prompts],
        }

    def log_line(self, outcome: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> str:
        """One line per request with the whole story, for grep."""
        t = self.totals()
        prefills = ",".join(p.prefill.summary() for p in self.prompts)
        decodes = ",".join(
            sorted({a.instance for p in self.prompts for attempts in p.choices.values() for a in attempts})
        )
        misses = "+".join(f"{r}:{n}" for r, n in sorted(t.blocks_missed.items())) or "0"

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f}"

        return (
            f"request {self.request_id} {self.endpoint} outcome={outcome} prompt_tokens={prompt_tokens} "
            f"completion_tokens={completion_tokens} cached_tokens={cached_tokens} prefill={prefills or '-'} "
            f"decode={decodes or '-'} resumptions={t.resumptions} tokenize_ms={ms(self.tokenize_s)} "
            f"ttft_ms={ms(self.ttft_s)} total_ms={ms(self.total_s)} queue_ms={ms(t.queue_s)} "
            f"prefill_ms={ms(t.prefill_s)} transfer_ms={ms(t.transfer_s)} decode_ms={ms(t.decode_s)} "
            f"bytes_written={t.bytes_written} bytes_read={t.bytes_read} blocks_hit={t.blocks_hit} "
            f"blocks_missed={misses}"
        )
