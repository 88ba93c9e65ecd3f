"""Model loading (GGUF, safetensors), tokenizer and chat template, and the Llama decoder.

Names are imported lazily: ``from libs.model import load_tokenizer`` (the router's need)
must not pay for importing torch, which only the loader and the model itself use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionMetadata": "libs.model.attention",
    "PagedAttention": "libs.model.attention",
    "make_backend": "libs.model.attention",
    "ModelConfig": "libs.model.config",
    "LoadedModel": "libs.model.loader",
    "ModelFingerprint": "libs.model.loader",
    "load_model": "libs.model.loader",
    "MoEOptions": "libs.model.moe",
    "DEFAULT_MODEL_NAME": "libs.model.source",
    "ModelNotFoundError": "libs.model.source",
    "default_model_path": "libs.model.source",
    "load_config": "libs.model.source",
    "load_tokenizer": "libs.model.source",
    "model_name": "libs.model.source",
    "resolve_model_path": "libs.model.source",
    "ChatTemplateError": "libs.model.tokenizer",
    "IncrementalDetokenizer": "libs.model.tokenizer",
    "Tokenizer": "libs.model.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'libs.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
