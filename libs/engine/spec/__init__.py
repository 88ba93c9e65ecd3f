"""Speculative decoding: a proposer drafts ``k`` tokens, the target verifies them in one
forward, a rejection sampler keeps what the target would have produced.

Modules, one concept each:

- ``config``: ``--speculative-config`` (vLLM's JSON shape) → ``SpeculativeConfig``;
- ``proposer``: what proposers take and return; ``ngram`` (prompt lookup),
  ``model_proposer`` (drafting with a network), ``self_draft`` (the target's first
  layers), ``draft_model`` (a separate checkpoint);
- ``vocab``: the pruned draft vocabulary (d2t/t2d) and the command that builds it;
- ``rejection``: the verify step's logits → emitted tokens, and the device state
  (kernels/rejection inside);
- ``verify``: the speculative step as the engine's loop runs it (propose, the
  verification on the device with async prepare, settle: KV rollback and prefix-cache
  commits);
- ``adaptive``: per-sequence switch-off when acceptance is too low to pay;
- ``metrics``: acceptance counters with vLLM's names.

``create_spec_decoder`` wires them for an engine.
"""

from __future__ import annotations

from typing import Callable

import torch

from libs.engine.spec.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "create_spec_decoder", "parse_speculative_config"]


def create_spec_decoder(config: SpeculativeConfig, *, loaded, draft, block_manager, bind_target: Callable[[], None], device: torch.device):
    """A ``SpecDecoder`` for an engine. ``draft``: the loaded draft checkpoint
    (``draft_model`` only, loaded first so the engine can budget its cache)."""
    from libs.engine.spec.ngram import NgramProposer
    from libs.engine.spec.verify import SpecDecoder
    from libs.engine.spec.vocab import DraftVocab

    vocab = DraftVocab.load(config.draft_vocab, loaded.config.vocab_size) if config.draft_vocab else None
    bs = block_manager.block_size
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "self_draft":
        from libs.engine.spec.self_draft import self_draft_proposer

        proposer = self_draft_proposer(loaded.model, config.num_draft_layers, vocab, block_size=bs, device=device, bind=bind_target)
    else:
        from libs.engine.spec.draft_model import draft_model_proposer

        proposer = draft_model_proposer(draft, vocab, num_blocks=block_manager.num_blocks, block_size=bs)
    return SpecDecoder(config, proposer, block_manager, device=device, async_prepare=config.resolve_async_prepare(device.type))
