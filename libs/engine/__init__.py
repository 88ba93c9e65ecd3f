"""The inference engine: block manager, scheduler, model runner, sampler.

``LLMEngine`` (engine.py) is the step loop services drive; ``LLM`` (llm.py) adds the
offline ``generate``/``stream`` API on top of it.
"""

from libs.engine.config import EngineConfig
from libs.engine.engine import LLMEngine
from libs.engine.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    TokenOutOfRangeError,
)
from libs.engine.kv_export import ExportedKV
from libs.engine.llm import LLM
from libs.engine.outputs import CompletionOutput, GenerationResult, RequestOutput
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
    "LLM",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "TokenOutOfRangeError",
]
