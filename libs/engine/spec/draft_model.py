"""``draft_model``: a separate, smaller checkpoint of the same family proposes the drafts.

The draft is loaded like the target (a GGUF file or a Hugging Face folder), on the same
device, in the same dtype, with the same attention backend, and checked against the target
at load: the two must share a tokenizer (same vocabulary, token for token, and the same
EOS), or every draft id would mean something else to the target. A mismatch is a
``ValueError`` at start-up, not garbage later.

Its KV cache is its own, ``[num_blocks, draft layers, 2, block_size, kv heads, head_dim]``
with the target's number of blocks, so the target's block ids index it directly (one block
table per sequence serves both). How a sequence's draft KV is kept valid is described in
libs/engine/spec/model_proposer.py.

``write_truncated_checkpoint`` makes a draft folder from a target: its first ``n`` layers,
embeddings, norm and tokenizer, as safetensors (``python -m libs.engine.spec.draft_model``).
It needs no training, so it is what the tests and the CPU benchmark use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from libs.engine.spec.model_proposer import DraftNetwork, ModelProposer
from libs.engine.spec.vocab import DraftVocab
from libs.kvpool.layout import KVLayout
from libs.model import LoadedModel, load_model
from libs.model.attention import PagedAttention


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    t, d = target.tokenizer, draft.tokenizer
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"draft model {draft.name!r} has a vocabulary of {draft.config.vocab_size} tokens, the target {target.config.vocab_size}")
    tv, dv = t.backend.get_vocab(with_added_tokens=True), d.backend.get_vocab(with_added_tokens=True)
    if tv != dv:
        diff = next((tok for tok in tv if dv.get(tok) != tv[tok]), None) or next(iter(set(dv) - set(tv)), None)
        raise ValueError(f"draft model {draft.name!r} has a different tokenizer than the target (first difference: {diff!r})")
    if set(t.eos_token_ids) != set(d.eos_token_ids):
        raise ValueError(f"draft model {draft.name!r} ends on {sorted(d.eos_token_ids)}, the target on {sorted(t.eos_token_ids)}")


def load_draft(path: str, target: LoadedModel, backend: PagedAttention) -> LoadedModel:
    """The draft checkpoint, on the target's device and dtype, checked against the target."""
    draft = load_model(path, dtype=target.dtype, device=target.device, backend=backend)
    check_same_tokenizer(target, draft)
    return draft


def draft_layout(draft: LoadedModel, block_size: int) -> KVLayout:
    mc = draft.config
    return KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size, draft.dtype)


def draft_model_proposer(draft: LoadedModel, vocab: DraftVocab | None, *, num_blocks: int, block_size: int) -> ModelProposer:
    """The proposer, with the draft's own KV cache of ``num_blocks`` blocks."""
    cache = draft_layout(draft, block_size).allocate(num_blocks, draft.device)
    model = draft.model
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if vocab is not None:
        head = vocab.prune_head(head)
    network = DraftNetwork(model, len(model.layers), head)

    def bind() -> None:
        if getattr(model, "kv_cache_owner", None) is not cache:
            model.bind_kv_cache(cache)
            model.kv_cache_owner = cache

    proposer = ModelProposer("draft_model", network, vocab=vocab, block_size=block_size, device=draft.device, shares_target_cache=False, bind=bind)
    proposer.cache = cache
    return proposer


def write_truncated_checkpoint(target_path: str | None, num_layers: int, out: str | Path) -> Path:
    """A Hugging Face folder with the target's first ``num_layers`` layers (float32)."""
    from safetensors.torch import save_file

    from libs.model.source import resolve_model_path
    from libs.model.weights import read_gguf, read_hf_folder
    from libs.model.source import load_tokenizer

    src = resolve_model_path(target_path)
    cfg, state = read_gguf(src)[:2] if src.is_file() else read_hf_folder(src)
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    keep = {}
    for name, t in state.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        keep[name] = t.contiguous() if isinstance(t, torch.Tensor) else t
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / "model.safetensors"))
    config = {
        "model_type": cfg.architecture, "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = cfg.rope_scaling
    tok = load_tokenizer(target_path)
    config["eos_token_id"] = list(tok.eos_token_ids)
    if tok.bos_token_id is not None:
        config["bos_token_id"] = tok.bos_token_id
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.backend.save(str(out / "tokenizer.json"))
    tcfg = {"add_bos_token": tok.add_bos, "chat_template": tok.chat_template}
    if tok.bos_token_id is not None:
        tcfg["bos_token"] = tok.id_to_token(tok.bos_token_id)
    if tok.eos_token_ids:
        tcfg["eos_token"] = tok.id_to_token(tok.eos_token_ids[0])
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libs.engine.spec.draft_model", description="Write a draft checkpoint: a target's first N layers.")
    p.add_argument("--layers", type=int, required=True, help="layers to keep")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    try:
        path = write_truncated_checkpoint(args.model, args.layers, args.out)
    except (OSError, ValueError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
