"""The converted-model cache: a GGUF's tensors, already converted, as memory-mapped safetensors.

Why: recovery from a crashed worker is only as fast as the worker's start, and most of a
cold start is conversion. For the embedded 98 MB SmolLM2 GGUF, gguf-py parses the metadata
(49,152 tokenizer strings, one numpy memmap each) in about 2 s and dequantizes Q4_1/Q8_0 to
float32 in about another 2 s; llama.cpp maps the same file in 0.1 s. The cache keeps what
conversion produced, the HF-named float32 state dict (``read_gguf``'s output, Q/K rows
already unpermuted; 4-bit weights as their ``q``/``scale``/``minimum`` parts), in one
safetensors file that a warm start memory-maps (zero copies until the model takes the
values), plus the GGUF's metadata as JSON, which is all the router needs for its tokenizer.

Key. An entry is named by an xxh3-128 of:

- the source's weight digest (``source.weights_digest``, the same bytes that name the KV
  namespace): a changed file is a different entry;
- the stored dtype (float32) and the variant (``q4`` when 4-bit weights are kept);
- the conversion's *layout*: ``LAYOUT_VERSION``, the gguf-py version, and the bytes of the
  modules that do the conversion (weights.py, quantized.py, gguf_meta.py, config.py). Editing the
  conversion code makes a new entry, so a stale cache can never hide a conversion change
  from the tests that compare it with transformers.

Integrity. An entry is a directory written under a temporary name and renamed into place,
so a reader sees all of it or none (several workers starting cold at once each write one;
the first rename wins and the others are discarded). The metadata records an xxh3 of the
tensor file, checked on every load (about 20 ms per 500 MB): a corrupt or truncated entry is
logged, removed and rebuilt from the source, never loaded. A cached model is bit-identical
to a converted one, so its KV blocks are shared under the same namespace.

``cache_dir`` is a setting of every service that loads a model (``--cache-dir``, default
``$XDG_CACHE_HOME/tidepool`` or ``~/.cache/tidepool``; ``none`` turns the cache off). Entries
are never evicted: remove the directory to reclaim the space (about 4 bytes per parameter).
This module imports torch only to read or write tensors, so the router can use it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import xxhash

from libs.model.config import ModelConfig, MoEConfig

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when the stored tensors' names or meaning change
STORED_DTYPE = "float32"
_TENSORS = "model.safetensors"
_META = "meta.json"
_Q4_PARTS = ("q", "scale", "minimum")
_CONVERSION_MODULES = ("weights.py", "quantized.py", "gguf_meta.py", "config.py")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tidepool``, else ``~/.cache/tidepool``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tidepool"


def resolve_cache_dir(setting: str | None) -> Path | None:
    """A ``cache_dir`` setting as a path: ``"auto"`` is the default directory; ``None``
    (what the settings parser makes of ``none``), ``"off"`` or ``""`` turns the cache off."""
    if setting is None or setting.strip().lower() in ("", "none", "off"):
        return None
    if setting == "auto":
        return default_cache_dir()
    return Path(setting).expanduser()


def _layout_digest() -> str:
    import gguf

    h = xxhash.xxh3_128()
    h.update(f"layout {LAYOUT_VERSION} gguf {getattr(gguf, '__version__', '?')}".encode())
    here = Path(__file__).parent
    for name in _CONVERSION_MODULES:
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(memoryview(mm))
    return h.hexdigest()


class WeightCache:
    """Entries under ``root/gguf/<key>/``: ``model.safetensors`` and ``meta.json``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _entry(self, source_digest: str, variant: str) -> Path:
        h = xxhash.xxh3_128()
        h.update(f"{source_digest} {STORED_DTYPE} {variant} {_layout_digest()}".encode())
        return self.root / "gguf" / h.hexdigest()

    def _meta_entry(self, source_digest: str) -> Path:
        return self.root / "gguf-meta" / f"{source_digest}-{LAYOUT_VERSION}.json"

    # -- metadata only (the router's tokenizer) -------------------------------------------

    def load_metadata(self, source_digest: str) -> dict[str, Any] | None:
        path = self._meta_entry(source_digest)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("weight cache: unreadable metadata %s (%s); reading the GGUF", path, e)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            return None

    def store_metadata(self, source_digest: str, meta: dict[str, Any]) -> None:
        path = self._meta_entry(source_digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as e:  # a read-only or full disk costs speed only
            log.warning("weight cache: could not store metadata in %s: %s", path.parent, e)

    # -- converted tensors ----------------------------------------------------------------

    def load(self, source_digest: str, variant: str) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]] | None:
        """``(config, state, metadata)`` as ``read_gguf`` returns them, or None on a miss."""
        entry = self._entry(source_digest, variant)
        if not (entry / _META).exists():
            return None
        try:
            info = json.loads((entry / _META).read_text())
            if _file_digest(entry / _TENSORS) != info["tensors_digest"]:
                raise ValueError("tensor file digest mismatch")
            from safetensors.torch import load_file

            flat = load_file(str(entry / _TENSORS))  # memory-mapped, no copy
            cfg = _config(info["config"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("weight cache: dropping corrupt entry %s (%s); converting the GGUF again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return cfg, _unflatten(flat), info["metadata"]

    def store(self, source_digest: str, variant: str, cfg: ModelConfig, state: dict[str, Any], meta: dict[str, Any]) -> Path | None:
        """Write an entry atomically; returns its path, or None if it could not be written."""
        entry = self._entry(source_digest, variant)
        tmp: Path | None = None
        try:
            from safetensors.torch import save_file

            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
            save_file(_flatten(state), str(tmp / _TENSORS))
            info = {
                "source_digest": source_digest,
                "variant": variant,
                "dtype": STORED_DTYPE,
                "layout_version": LAYOUT_VERSION,
                "tensors_digest": _file_digest(tmp / _TENSORS),
                "config": asdict(cfg),
                "metadata": meta,
            }
            (tmp / _META).write_text(json.dumps(info))
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / _META).exists():  # not another writer's finished entry
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            tmp = None
            self.store_metadata(source_digest, meta)
            return entry
        except (OSError, TypeError, ValueError) as e:
            log.warning("weight cache: could not store %s: %s", entry, e)
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _config(d: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` back from its JSON (``asdict``): nested dataclasses, tuples."""
    moe = d.get("moe")
    if moe is not None:
        moe = MoEConfig(**{**moe, "dense_layers": tuple(moe.get("dense_layers", ()))})
    return ModelConfig(**{**d, "moe": moe})


def _flatten(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors as they are; an ``Int4Weight`` as ``<name>::q4.<part>`` tensors."""
    from libs.model.quantized import Int4Weight

    flat: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, Int4Weight):
            for part in _Q4_PARTS:
                flat[f"{name}::q4.{part}"] = getattr(value, part).contiguous()
        else:
            flat[name] = value.contiguous()
    return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    from libs.model.quantized import Int4Weight

    state: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        base, sep, part = name.partition("::q4.")
        if sep:
            parts.setdefault(base, {})[part] = value
        else:
            state[name] = value
    for base, p in parts.items():
        if set(p) != set(_Q4_PARTS):
            raise ValueError(f"incomplete 4-bit weight {base!r} in the cache")
        state[base] = Int4Weight(**p)
    return state
