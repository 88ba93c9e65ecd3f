"""Model loading (GGUF, safetensors), tokenizer and chat template, and the Llama decoder."""

from libs.model.attention import AttentionMetadata, PagedAttention, make_backend
from libs.model.config import ModelConfig
from libs.model.loader import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    ModelFingerprint,
    ModelNotFoundError,
    default_model_path,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from libs.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

__all__ = [
    "AttentionMetadata",
    "ChatTemplateError",
    "DEFAULT_MODEL_NAME",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "ModelFingerprint",
    "ModelNotFoundError",
    "PagedAttention",
    "Tokenizer",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "make_backend",
    "resolve_model_path",
]
