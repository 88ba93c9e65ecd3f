"""The router's settings (CLI flags and ``TIDEPOOL_*`` variables; ``--help`` lists them all)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import BaseSettings, setting
from services.router.body import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH


@dataclass(frozen=True, kw_only=True)
class RouterSettings(BaseSettings):
    """The public OpenAI-compatible API: tokenizes, places requests on prefill and decode, streams."""

    model: str | None = setting(
        None,
        help="tokenizer and chat template source: a .gguf file or Hugging Face folder (no weights "
        "are loaded); default: the embedded SmolLM2-135M-Instruct",
    )
    cache_dir: str | None = setting(
        "auto",
        help="where a GGUF's metadata (the tokenizer) is cached for fast restarts; auto: "
        "$XDG_CACHE_HOME/tidepool or ~/.cache/tidepool; none: off",
    )
    served_model_name: str | None = setting(
        None, help="the model name clients send and /v1/models lists; default: the model's own name"
    )
    chat_template: str | None = setting(
        None,
        help="a Jinja chat template replacing the model's (and the Hermes tools template): a file "
        "path, or the template text itself",
    )
    grammar_cache_size: int = setting(256, help="compiled structured-output grammars kept (LRU) for validation")
    api_key: str | None = setting(
        None, help="require 'Authorization: Bearer <key>' on the /v1 API (401 otherwise); none: open", secret=True
    )
    heartbeat_timeout_s: float = setting(
        5.0, help="an instance without a heartbeat for this long is dropped (instances beat every ~1 s)"
    )
    prefill_threshold_tokens: int = setting(
        32, help="prompts shorter than this skip prefill: decode computes them itself"
    )
    lease_ttl_s: float = setting(30.0, help="handoff lease TTL prefill puts on the blocks it writes for decode")
    cache_store_url: str | None = setting(
        None, help="cache_store base URL; when set, a prompt whose blocks are all in the pool skips prefill"
    )
    cache_store_timeout_s: float = setting(
        0.5, help="longest wait for cache_store's answer before prefilling anyway"
    )
    stream_handoff: bool = setting(
        True,
        help="streamed handoff: prefill reports its progress and decode loads the blocks already "
        "durable while prefill computes the rest (docs/HANDOFF.md); off: decode starts after prefill's result",
    )
    prefill_timeout_s: float = setting(
        60.0, help="longest wait for a PrefillResult; after it decode serves the whole request"
    )
    decode_connect_timeout_s: float = setting(
        5.0, help="longest wait for a TCP connection to a decode instance"
    )
    decode_read_timeout_s: float = setting(
        120.0,
        help="longest silence from a decode instance (before its answer or inside its stream) before "
        "the stream counts as broken and is resumed elsewhere",
    )
    decode_retries: int = setting(
        2, help="times a broken decode stream is resumed on another (or a re-registered) instance"
    )
    retry_wait_s: float = setting(
        30.0,
        help="how long a request waits for a usable decode instance to (re)appear: long enough for a "
        "supervisor to restart a crashed one (a resumed stream continues on it)",
    )
    # -- input limits and overload (services/router/body.py, executor.py, admission.py) --
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, help="largest request body on the /v1 API, in bytes; a larger one gets 413 before it is read"
    )
    body_timeout_s: float = setting(
        60.0, help="longest time a request body may take to arrive; a slower one gets 408 and frees its slot"
    )
    max_json_depth: int = setting(
        DEFAULT_MAX_JSON_DEPTH, help="deepest nesting of arrays and objects in a request body; deeper gets 400"
    )
    prepare_threads: int = setting(
        2, help="threads that parse, validate, render chat templates and tokenize requests, off the event loop"
    )
    prepare_queue: int = setting(
        64, help="requests being prepared or waiting for a prepare thread; past it a request gets 429 with Retry-After"
    )
    max_running_requests: int = setting(
        512, help="requests the router serves at once, from reading the body to the last byte; more wait for a slot"
    )
    max_waiting_requests: int = setting(
        1024, help="requests waiting for a slot; past it a request gets 429 with Retry-After at once"
    )
    queue_timeout_s: float = setting(
        30.0, help="longest wait for a slot (and for a decode instance with room) before a 429"
    )
    retry_after_s: int = setting(1, help="the Retry-After (seconds) of a 429")

    def __post_init__(self) -> None:
        super().__post_init__()
        positive = (
            "heartbeat_timeout_s",
            "lease_ttl_s",
            "cache_store_timeout_s",
            "prefill_timeout_s",
            "decode_connect_timeout_s",
            "decode_read_timeout_s",
            "queue_timeout_s",
            "body_timeout_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"prefill_threshold_tokens must be >= 0, got {self.prefill_threshold_tokens}")
        if self.decode_retries < 0:
            raise ValueError(f"decode_retries must be >= 0, got {self.decode_retries}")
        if self.retry_wait_s < 0:
            raise ValueError(f"retry_wait_s must be >= 0, got {self.retry_wait_s}")
        for name in ("max_body_bytes", "max_json_depth", "prepare_threads", "max_running_requests", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prepare_queue < self.prepare_threads:
            raise ValueError(f"prepare_queue ({self.prepare_queue}) must be >= prepare_threads ({self.prepare_threads})")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open API)")
