"""The inference engine: block manager, scheduler, model runner, sampler."""

from libs.engine.config import EngineConfig
from libs.engine.engine import CompletionOutput, ExportedKV, GenerationResult, LLMEngine, RequestOutput
from libs.engine.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    TokenOutOfRangeError,
)
from libs.engine.params import SamplingParams
from libs.engine.sequence import KVImport, TokenLogprob

__all__ = [
    "CompletionOutput",
    "DuplicateRequestError",
    "EngineConfig",
    "ExportedKV",
    "GenerationResult",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "KVImport",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "TokenOutOfRangeError",
]
