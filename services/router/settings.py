"""The router's settings (CLI flags and ``TIDEPOOL_*`` variables; ``--help`` lists them all)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import BaseSettings, setting


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
        None, help="require 'Authorization: Bearer <key>' on the /v1 API (401 otherwise); none: open"
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

    def __post_init__(self) -> None:
        super().__post_init__()
        positive = (
            "heartbeat_timeout_s",
            "lease_ttl_s",
            "cache_store_timeout_s",
            "prefill_timeout_s",
            "decode_connect_timeout_s",
            "decode_read_timeout_s",
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
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open API)")
